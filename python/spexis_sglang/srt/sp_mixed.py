"""Mixed chunked prefill under SP (``--enable-mixed-chunk``): the running requests' SP rows ride
along a prefill chunk in one forward, as stock SGLang rides its decode batch along the chunk.

Without it an SP iteration that carries a prefill chunk carries nothing else, and every
decoding request waits out the chunk. A mixed iteration is built from two batches every rank
builds alike: SGLang's prefill (its own admission) and SP's decode rows
(``sp_build_decode_batch``). The forward runs them as one ``ForwardMode.MIXED`` batch, prefill
tokens first, each SP row an extend of one token at its own position (its request's KV slot,
as in a decode batch). Its results split again: the first ``P`` tokens are the prefill's
(SGLang's result processing, then the requests start decoding under SP), the rest verify the
rows (``SlotState.on_result``).

What a mixed batch leaves out, so that every rank decides alike and nothing changes a row's
token:

* rows whose request needs more than tokens (logprobs, grammar, hidden states, penalizers, a
  custom logit processor): such a running set keeps the iteration a plain prefill, and a
  prefill that returns logprobs, uses a grammar, hidden states, input embeddings or
  multimodal inputs stays unmixed as well (stock SGLang does not mix logprob batches either);
* the device's redo of rows (alternatives): a mixed batch's positions are known on the host,
  so its rows are built as if no batch were in transit (a row built on a draft the transit
  batch rejects is stale, as in the unpipelined loop), and the batch after it does not redo
  rows against it.
"""

from __future__ import annotations

import copy
import logging
from typing import TYPE_CHECKING, Optional

import torch
from sglang.srt.managers.schedule_batch import ScheduleBatch
from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardMode
from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo

from spexis_sglang.srt.protocol import SpexisPlan
from spexis_sglang.srt.sp_records import SPBatch

if TYPE_CHECKING:
    from spexis_sglang.srt.sp_scheduler import SpexisScheduler

logger = logging.getLogger(__name__)


def prefill_can_mix(prefill: ScheduleBatch) -> bool:
    """A prefill SP rows may ride along: it returns tokens only, from token ids."""
    return not (
        prefill.return_logprob
        or prefill.has_grammar
        or prefill.return_hidden_states_mode != CaptureHiddenMode.NULL
        or prefill.input_embeds is not None
        or any(m is not None for m in (prefill.multimodal_inputs or ()))
    )


class SPMixedMixin:
    """SP rows riding along a prefill chunk. (A mixin of
    :class:`~.sp_scheduler.SpexisScheduler`.)"""

    def sp_rows_can_mix(self: SpexisScheduler) -> bool:
        """Every running request's rows may ride along a prefill chunk (mirrored state: every
        rank answers alike)."""
        sp = self.sp
        if not sp.mixed_chunk or not sp.running.reqs:
            return False
        return bool(sp.mixable[self._sp_running_slots()].all())

    def sp_mix(
        self: SpexisScheduler,
        prefill: ScheduleBatch,
        plan_in: Optional[SpexisPlan],
        plan_out: SpexisPlan,
        rows_can_mix: bool,
    ) -> ScheduleBatch:
        """``prefill`` with every running request's next row riding along, or ``prefill``
        alone where they cannot ride (see the module docstring). ``rows_can_mix``:
        :meth:`sp_rows_can_mix`, as the admission that made ``prefill`` found it."""
        sp = self.sp
        decode = None
        if rows_can_mix and prefill_can_mix(prefill):
            decode = self.sp_build_decode_batch(plan_in, plan_out, transit=None)
        if decode is None:
            sp.add(prefill, SPBatch("prefill"))
            return prefill
        record = sp.batches.pop(id(decode))
        mixed = self._sp_mixed_batch(prefill, decode, record.rows.position)
        record.kind = "mixed"
        record.prefill = prefill
        record.rows_batch = decode
        sp.add(mixed, record)
        sp.stats.mixed_iterations += 1
        return mixed

    def _sp_mixed_batch(
        self: SpexisScheduler, prefill: ScheduleBatch, decode: ScheduleBatch, positions
    ) -> ScheduleBatch:
        """One ``MIXED`` batch: the prefill's tokens, then one token per SP row at the row's
        position (an extend of one token whose prefix is the request's KV before it). The
        prefill batch itself is left as it was: its results are processed on it."""
        mixed = copy.copy(prefill)
        n = len(decode.reqs)
        mixed.forward_mode = ForwardMode.MIXED
        mixed.reqs = prefill.reqs + decode.reqs
        mixed.decoding_reqs = decode.reqs
        mixed.req_pool_indices = torch.cat([prefill.req_pool_indices, decode.req_pool_indices])
        mixed.req_pool_indices_cpu = torch.cat(
            [prefill.req_pool_indices_cpu, decode.req_pool_indices_cpu]
        )
        mixed.seq_lens = torch.cat([prefill.seq_lens, decode.seq_lens])
        mixed.seq_lens_cpu = torch.cat([prefill.seq_lens_cpu, decode.seq_lens_cpu])
        mixed.orig_seq_lens = torch.cat(
            [prefill.orig_seq_lens, decode.orig_seq_lens.to(prefill.orig_seq_lens.dtype)]
        )
        mixed.seq_lens_sum = int(mixed.seq_lens_cpu.sum())
        mixed.out_cache_loc = torch.cat([prefill.out_cache_loc, decode.out_cache_loc])
        mixed.prefix_lens = list(prefill.prefix_lens) + positions.tolist()
        mixed.extend_lens = list(prefill.extend_lens) + [1] * n
        mixed.extend_num_tokens = prefill.extend_num_tokens + n
        mixed.extend_logprob_start_lens = list(prefill.extend_logprob_start_lens) + [0] * n
        mixed.is_prefill_only = False
        if mixed.multimodal_inputs is not None:
            mixed.multimodal_inputs = list(mixed.multimodal_inputs) + [None] * n
        # the sampling rank samples every request's last token; the others sample nothing
        mixed.sampling_info = (
            SamplingBatchInfo.from_schedule_batch(mixed, self.model_config.vocab_size)
            if self.sp.sampling is not None
            else None
        )
        return mixed

    def sp_resolve_mixed(self: SpexisScheduler, batch: ScheduleBatch) -> None:
        """The mixed batch's token ids on the device, before its forward: the prefill's, then
        the rows' (stage 0's speculative rows take their request's latest draft)."""
        record = self.sp.record(batch)
        rows_batch = record.rows_batch
        ids = rows_batch.input_ids
        if record.launch.has_spec:
            ids = torch.where(ids < 0, self.sp.draft_by_slot[rows_batch.req_pool_indices], ids)
        prefill_ids = batch.prefill_input_ids_cpu
        if prefill_ids is None:
            prefill_ids = record.prefill.input_ids
        batch.input_ids = torch.cat([prefill_ids.to(ids.device, non_blocking=True), ids])
        batch.prefill_input_ids_cpu = None
        batch.mix_running_indices = None

    def sp_mixed_prefill_outputs(self: SpexisScheduler, tensors: dict, n_prefill: int) -> dict:
        """The prefill's part of a mixed batch's output dict (its first tokens)."""
        return {"next_token_ids": tensors["next_token_ids"][:n_prefill]}
