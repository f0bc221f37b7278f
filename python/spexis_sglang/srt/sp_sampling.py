"""Sampling state of SP decode batches, kept per request slot and gathered per batch.

Stock SGLang builds a decode batch's ``SamplingBatchInfo`` once per running batch and filters
or merges it as requests come and go. SP builds a new batch every iteration (its rows change
with every verdict), and ``SamplingBatchInfo.from_schedule_batch`` reads five sampling
parameters and a dozen flags from every request: at B = 256 that was a large share of stage
0's per-iteration CPU time, spent on ranks that do not even sample.

Here each request's parameters are written once, when it starts decoding under SP, into
arrays indexed by its slot (``req_pool_idx``); a batch gathers them with one numpy index per
field. Only the rank that samples (the last PP stage) builds sampling state at all. Requests
that need what the arrays do not hold (penalizers, logit bias, custom logit processors,
sampling masks, grammars) make the batch take SGLang's own ``from_schedule_batch``.

Every SP decode batch's sampling state is a :class:`SPSamplingBatchInfo`: SGLang's, plus the
grammar masks of its rows (``sp_grammar``), which the rows' own drafts decide.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import numpy as np
import torch
from sglang.srt.constrained.base_grammar_backend import GrammarMask
from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
from sglang.srt.runtime_context import get_exec
from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo
from sglang.srt.sampling.sampling_params import TOP_K_ALL

from spexis_sglang.srt.sp_penalties import needs_penalizer

__all__ = ["SPSamplingBatchInfo", "SlotSampling"]

_DEFAULT_SEED = 42  # SGLang's seed for a request without sampling_seed


@dataclasses.dataclass
class SPSamplingBatchInfo(SamplingBatchInfo):
    """An SP decode batch's sampling state, with its rows' grammar masks when it has any.

    SGLang's sampler fills the masks from the requests' committed grammar states
    (``update_regex_vocab_mask``); an SP row is built on its own unverified drafts, so its
    mask is computed when the batch is built, after those drafts (``sp_grammar``).
    """

    #: the sampler's masks replace SGLang's own fill (None in ``row_mask``: no row constrained)
    rows_masked: bool = False
    row_mask: Optional[GrammarMask] = None
    #: stage 0's draft head takes its argmax over what this allows (None: draft freely)
    draft_mask: Optional[GrammarMask] = None

    def update_regex_vocab_mask(self) -> None:
        if not self.rows_masked:
            return super().update_regex_vocab_mask()
        self.grammar_mask = self.row_mask


class SlotSampling:
    """Per-slot temperature, top-p, top-k, min-p and seed; see the module docstring."""

    def __init__(self, capacity: int, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        # temperature, top_p, min_p: one float32 block, gathered and copied together
        self._floats = np.ones((3, capacity), dtype=np.float32)
        self._top_k = np.full(capacity, TOP_K_ALL, dtype=np.int32)
        self._seed = np.full(capacity, _DEFAULT_SEED, dtype=np.int64)
        #: the request needs SGLang's full from_schedule_batch (see needs_full_info)
        self._full = np.zeros(capacity, dtype=bool)
        self._deterministic = get_exec().deterministic.enable_deterministic_inference
        self._custom_processors = get_exec().features.enable_custom_logit_processor

    def admit(self, slot: int, req: Req) -> None:
        sp = req.sampling_params
        self._floats[0, slot] = sp.temperature
        self._floats[1, slot] = sp.top_p
        self._floats[2, slot] = sp.min_p
        self._top_k[slot] = sp.top_k
        self._seed[slot] = sp.sampling_seed if sp.sampling_seed is not None else _DEFAULT_SEED
        self._full[slot] = self.needs_full_info(req)

    def needs_full_info(self, req: Req) -> bool:
        """What only ``from_schedule_batch`` handles."""
        sp = req.sampling_params
        return (
            needs_penalizer(sp)
            or sp.logit_bias is not None
            or bool(req.return_sampling_mask)
            or req.grammar is not None
            or (self._custom_processors and req.custom_logit_processor is not None)
        )

    def build(self, batch: ScheduleBatch, slots: np.ndarray) -> SPSamplingBatchInfo:
        """The sampling state of ``batch``, whose rows belong to ``slots`` (in row order)."""
        if self._full[slots].any():
            return SPSamplingBatchInfo.from_schedule_batch(batch, self.vocab_size)
        device = batch.device
        floats = torch.from_numpy(self._floats[:, slots]).to(device, non_blocking=True)
        top_k = self._top_k[slots]
        top_p = self._floats[1, slots]
        seed: Optional[torch.Tensor] = None
        if self._deterministic:
            seed = torch.from_numpy(self._seed[slots]).to(device, non_blocking=True)
        greedy = top_k <= 1
        info = SPSamplingBatchInfo(
            temperatures=floats[0].view(-1, 1),
            top_ps=floats[1],
            top_ks=torch.from_numpy(top_k).to(device, non_blocking=True),
            min_ps=floats[2],
            sampling_seed=seed,
            is_all_greedy=bool(greedy.all()),
            is_any_greedy=bool(greedy.any()),
            need_top_p_sampling=bool((top_p != 1.0).any()),
            need_top_k_sampling=bool((top_k != TOP_K_ALL).any()),
            need_min_p_sampling=bool((self._floats[2, slots] > 0).any()),
            vocab_size=self.vocab_size,
            penalizer_orchestrator=None,
            device=device,
            return_sampling_masks=None,
            sampling_mask_max_top_k=0,
        )
        info.adjusted_from_schedule_batch(batch, self.vocab_size)
        return info
