"""Benchmark-only forced acceptance (``--spexis-benchmark-force-accept``), one batch at a time.

With dummy weights the draft head never agrees with the target, so throughput at a realistic
acceptance rate Θ is measured by pretending: a row built on a draft accepts it with
probability Θ, whatever the model said. Every rank must draw the same verdict without sharing
a random stream, so the draw is a hash of (seed, request id, position, epoch) turned into a
uniform number (splitmix64's finaliser, ``core/row_hash.py``), computed for a whole batch with
numpy. The epoch is counted from the request's admission, so the draws do not depend on which
slot it got.
Outputs in this mode are not the model's: every token is labelled (``FORCED_LABEL``).
"""

from __future__ import annotations

import zlib
from typing import Optional

import numpy as np
from sglang.srt.managers.schedule_batch import Req

from spexis_sglang.core.row_hash import below64, row_key, uniform64, uniform64_scalar
from spexis_sglang.core.slot_state import Rows
from spexis_sglang.srt.protocol import FORCE_ACCEPT_PARAM, FORCED_LABEL

__all__ = [
    "ForcedAcceptance",
    "force_accept_param_error",
    "rejected_token",
    "uniform64",
    "uniform64_scalar",
]


def force_accept_param_error(req: Req, mode_on: bool) -> Optional[str]:
    """A request's ``custom_params.spexis_force_accept`` is only for the benchmark mode."""
    custom = req.sampling_params.custom_params or {}
    if FORCE_ACCEPT_PARAM not in custom:
        return None
    if not mode_on:
        return (
            f"custom_params.{FORCE_ACCEPT_PARAM} needs a Spexis SP server started with "
            "--spexis-benchmark-force-accept"
        )
    value = custom[FORCE_ACCEPT_PARAM]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
        return f"custom_params.{FORCE_ACCEPT_PARAM} must be a number in [0, 1], got {value!r}"
    return None


def rejected_token(true_ids, drafts, vocab_size: int):
    """The token a forced rejection commits: the model's, or the next id where the model
    agreed with the draft (numpy arrays or torch tensors alike)."""
    where = np.where if isinstance(true_ids, np.ndarray) else _torch_where
    return where(true_ids == drafts, (drafts + 1) % vocab_size, true_ids)


def _torch_where(cond, a, b):
    import torch

    return torch.where(cond, a, b)


class ForcedAcceptance:
    """Per-slot hash base, epoch origin and Θ of the requests decoding under SP."""

    def __init__(self, capacity: int, seed: int, default_theta: float, vocab_size: int) -> None:
        self.seed = seed
        self.default_theta = default_theta
        self.vocab_size = vocab_size
        self._base = np.zeros(capacity, dtype=np.uint64)
        self._epoch0 = np.zeros(capacity, dtype=np.int64)
        self._theta = np.zeros(capacity, dtype=np.float64)
        # the same draw in fewer passes (row_hash.below64): hash key and Θ * 2**64 per slot
        self._key = np.zeros(capacity, dtype=np.uint64)
        self._threshold = np.zeros(capacity, dtype=np.float64)
        # per slot: the request's tag list (its customized_info entry) and its theta
        self._labels = np.full(capacity, None, dtype=object)

    def theta(self, req: Req) -> float:
        """The request's Θ: its ``custom_params`` value (validated on arrival), else the
        server's."""
        custom = req.sampling_params.custom_params or {}
        return float(custom.get(FORCE_ACCEPT_PARAM, self.default_theta))

    def admit(self, slot: int, req: Req, epoch: int) -> None:
        self._base[slot] = zlib.crc32(f"{self.seed}:{req.rid}".encode())
        self._epoch0[slot] = epoch
        self._theta[slot] = self.theta(req)
        self._key[slot] = row_key(int(self._base[slot]), epoch)
        self._threshold[slot] = self._theta[slot] * 2.0**64

    def accepts(self, slots: np.ndarray, positions: np.ndarray, epochs: np.ndarray) -> np.ndarray:
        """Whether the row ``(slot, position, epoch)`` accepts the draft built on it (if one
        is): ``uniform64(base, position, epoch - epoch0) < theta``. A function of the row
        alone, so it is known before the row's true token is (the pipelined loop decides on
        the host which rows the device redoes)."""
        return below64(self._key[slots], positions, epochs, self._threshold[slots])

    def true_tokens(
        self, rows: Rows, true_ids: np.ndarray, drafts: np.ndarray, built_on_draft: np.ndarray
    ) -> np.ndarray:
        """The tokens verification should see: for a row whose next position carries a
        launched draft, the draft with probability Θ, otherwise a token that differs from it
        (:func:`rejected_token`)."""
        accept = self.accepts(rows.slot, rows.position, rows.epoch)
        rejected = rejected_token(true_ids, drafts, self.vocab_size)
        return np.where(built_on_draft, np.where(accept, drafts, rejected), true_ids)

    def label(self, req: Req) -> None:
        """Tag every output token so the client sees it came from forced acceptance (on
        admission: the tokens so far). The tag list is SGLang's ``customized_info`` entry; the
        list and the request's Θ are kept by slot for the per-token tags that follow."""
        if req.customized_info is None:
            req.customized_info = {}
        values = req.customized_info.setdefault(FORCED_LABEL, [])
        values.extend([float(self._theta[req.req_pool_idx])] * (len(req.output_ids) - len(values)))
        self._labels[req.req_pool_idx] = (values, values[-1] if values else self.theta(req))

    def label_one(self, req: Req) -> None:
        """Tag the token just committed (after :meth:`label` on admission)."""
        values, theta = self._labels[req.req_pool_idx]
        values.append(theta)

    def top_up(self, req: Req) -> None:
        """Tag every token committed since the last tag (after :meth:`label` on admission):
        the labels are read only when the request's output is streamed, so the SP loop's fast
        path tags them then, not per token."""
        values, theta = self._labels[req.req_pool_idx]
        missing = len(req.output_ids) - len(values)
        if missing > 0:
            values.extend([theta] * missing)
