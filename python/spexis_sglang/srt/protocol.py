"""What travels between the SP ranks and to the client: wire keys, stage 0's plan, labels.

One name per thing: the proxy keys stage 0's model adds to its ``PPProxyTensors``, the plan
stage 0 relays with the requests, and the benchmark-only forced-acceptance names live here and
nowhere else.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional, Tuple

import numpy as np
import torch

#: stage 0's draft per row (int64 ``[rows]``) and its confidence (float32 ``[rows]``): they go
#: down the pipe with the hidden states and come back from the last stage with the true tokens
PROXY_DRAFT_IDS = "spexis_draft_ids"
PROXY_DRAFT_CONF = "spexis_draft_conf"
#: stage 0's remaining-length bucket per row (with --spexis-length-predictor); read by stage 0's
#: scheduler only, never sent down the pipe
PROXY_LENGTH_BUCKET = "spexis_length_bucket"
#: stage 0's drafts packed for the host (:func:`pack_drafts`): one device-to-host copy per
#: iteration instead of one per tensor; read by stage 0's scheduler only, never sent down
PROXY_DRAFT_HOST = "spexis_draft_host"
#: stage 0 under SP: the draft head's hidden state at each row's last token, from which the
#: scheduler makes the drafts after the forward (``spexis_make_drafts``); never sent down
PROXY_DRAFT_HIDDEN = "spexis_draft_hidden"
#: each row's position as stage 0 ran it (int64 ``[rows]``), sent down with the proxy of a
#: batch launched before the results it depends on were processed: where the transit batch
#: rejected a row's chain, the row ran as the normal row at an earlier position
#: (``SlotState.conditional_alternatives``), and the later stages run it there too
PROXY_POSITIONS = "spexis_positions"
#: every proxy key of ours starts with this (what the later stages keep from a received proxy)
PROXY_PREFIX = "spexis_"
#: the keys the last stage sends back to stage 0 with the true tokens
PROXY_RETURNED = (PROXY_DRAFT_IDS, PROXY_DRAFT_CONF)
#: stage 0's own proxy keys, dropped before the proxy goes down the pipe
PROXY_STAGE0_ONLY = (PROXY_LENGTH_BUCKET, PROXY_DRAFT_HOST, PROXY_DRAFT_HIDDEN)

#: the input token of a speculative row on ranks that never see drafts (only stage 0 embeds)
PLACEHOLDER_TOKEN = 0

#: meta_info key carried by every token produced in the benchmark-only forced-acceptance mode
FORCED_LABEL = "spexis_benchmark_forced_acceptance"
#: sampling_params.custom_params key: a request's own forced acceptance (benchmark mode only),
#: so one server sweeps several values of theta without a restart
FORCE_ACCEPT_PARAM = "spexis_force_accept"


def pack_drafts(
    ids: torch.Tensor, conf: torch.Tensor, buckets: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """``[rows, 3]`` float64: draft id, confidence, length bucket (-1 without a predictor).

    Exact: ids and buckets are integers far below 2**53, confidences float32. Rows are
    contiguous, so a CUDA-graph replay's padded output sliced to the batch stays one block."""
    if buckets is None:
        buckets = torch.full_like(ids, -1)
    return torch.stack((ids.double(), conf.double(), buckets.double()), dim=1)


def unpack_drafts(packed: np.ndarray) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """:func:`pack_drafts`' columns on the host, copied: ids (int64), confidences (float64),
    buckets (int64)."""
    return (
        packed[:, 0].astype(np.int64),
        packed[:, 1].copy(),
        packed[:, 2].astype(np.int64),
    )


@dataclass
class SpexisPlan:
    """Stage 0's decisions for one iteration, relayed to the later stages with the requests."""

    iteration: int
    #: selective speculation: request slots (``req_pool_idx``, mirrored on every rank) whose
    #: pending draft stage 0 dropped this iteration
    dropped: List[int] = field(default_factory=list)
    #: alpha 1: request slots whose speculative row stage 0 left out of this iteration's batch
    #: with its draft kept for a later one (``SlotState.select_pp``)
    held: List[int] = field(default_factory=list)
    #: look-ahead admission: admit at most this many waiting requests now (None = no limit)
    admit_cap: Optional[int] = None

    def is_empty(self) -> bool:
        """Nothing decided: the later stages act on it exactly as on no plan at all."""
        return not self.dropped and not self.held and self.admit_cap is None


def relay_payload(recv_reqs: Optional[list], plan: SpexisPlan) -> list:
    """What a stage relays to the next one: its received requests, then its plan unless empty.

    Leaving an empty plan out makes a steady decode iteration's relay ``[]``, which SGLang's
    ``point_to_point_pyobj`` sends as one size message (no pickle, no second message)."""
    relay = list(recv_reqs or [])
    if not plan.is_empty():
        relay.append(plan)
    return relay
