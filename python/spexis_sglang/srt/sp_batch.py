"""Building a decode batch: every running request's next row (``SlotState.next_rows``), the
drops of selective speculation, the rows fitted to memory (``sp_memory``), their alternatives
when a transit batch's verdicts decide them, and the ``ScheduleBatch`` on one host-to-device
copy of its metadata; the sampling rank's penalizers and grammar masks per row.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Optional, Tuple

import numpy as np
import torch
from sglang.srt.managers.schedule_batch import ScheduleBatch
from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardMode

from spexis_sglang.core.slot_state import Rows
from spexis_sglang.srt import sp_grammar
from spexis_sglang.srt.protocol import SpexisPlan
from spexis_sglang.srt.sp_logprobs import set_decode_logprob_fields
from spexis_sglang.srt.sp_penalties import needs_penalizer, row_output_prefix, set_penalizer_state
from spexis_sglang.srt.sp_records import LaunchPlan, SPBatch
from spexis_sglang.srt.sp_sampling import SPSamplingBatchInfo

if TYPE_CHECKING:
    from spexis_sglang.srt.sp_scheduler import SpexisScheduler

logger = logging.getLogger(__name__)


def _required_penalizers(batch: ScheduleBatch):
    """The batch's penalizer orchestrator where a request in it uses a penalizer, else None."""
    info = batch.sampling_info
    orchestrator = info.penalizer_orchestrator if info is not None else None
    return orchestrator if orchestrator is not None and orchestrator.is_required else None


class SPBatchMixin:
    """A decode batch: rows, selection, KV memory, alternatives, the ScheduleBatch. (A mixin of
    :class:`~.sp_scheduler.SpexisScheduler`.)"""

    def sp_get_next_batch(
        self: SpexisScheduler,
        plan_in: Optional[SpexisPlan],
        transit: Optional[ScheduleBatch] = None,
    ) -> Tuple[Optional[ScheduleBatch], SpexisPlan]:
        """This iteration's batch: a prefill (SGLang's admission; with ``--enable-mixed-chunk``
        the running requests' rows ride along), else every running request's next row.
        ``transit``: the batch whose results reach the device before this one runs (a decode
        batch's verdicts then decide where some rows run)."""
        sp = self.sp
        plan_out = SpexisPlan(iteration=sp.iteration)
        self.process_pending_chunked_abort()
        self._abort_on_waiting_timeout()
        if self.chunked_req is not None:
            if self.chunked_req.extend_range.end > len(self.chunked_req.prefix_indices):
                self.stash_chunked_request(self.chunked_req)

        if self.waiting_queue or self.chunked_req is not None:
            self.sp_flush_tokens()  # admission reads the running requests' output
        if sp.released_since_filter:
            req_at = sp.req_at
            sp.running.reqs = [r for r in sp.running.reqs if req_at[r.req_pool_idx] is r]
            sp.released_since_filter = False
        sp.admit_cap = plan_out.admit_cap = self.sp_admission_cap(plan_in)
        if sp.admit_cap is not None:
            # the limit is decided afresh every iteration: a "full" batch it caused must not
            # outlive it (stock SGLang clears batch_is_full only when memory frees up)
            sp.running.batch_is_full = False
        # a cap is the gate's count: it replaces SGLang's token reservation (prefill_adder);
        # rows that may ride along the chunk take their share of its tokens (sp_mixed)
        mixed_rows = len(sp.running.reqs) if self.sp_rows_can_mix() else 0
        try:
            with sp.running.admission_pass(
                by_count=sp.admit_cap is not None, mixed_decode_rows=mixed_rows
            ):
                prefill = self.get_new_batch_prefill(sp.running).batch_to_run
        finally:
            sp.admit_cap = None
        if prefill is not None and sp.admit_reservation is not None:
            # admitted while SGLang's reservation would still have held them back
            sp.stats.admissions_early += max(0, len(prefill.reqs) - sp.admit_reservation)
        sp.admit_reservation = None
        if prefill is not None:
            # the running requests' rows ride along where they can (sp_mixed)
            batch = self.sp_mix(prefill, plan_in, plan_out, rows_can_mix=mixed_rows > 0)
            self.sp_set_prefill_penalties(batch, prefill.reqs)
            return batch, plan_out
        record = sp.record(transit)
        pipelined = record is not None and record.decode
        batch = self.sp_build_decode_batch(plan_in, plan_out, transit if pipelined else None)
        return batch, plan_out

    def _sp_running_slots(self: SpexisScheduler) -> np.ndarray:
        """The running requests' slots in batch order (rebuilt only when the list changed)."""
        sp = self.sp
        reqs = sp.running.reqs
        cached = sp.running_slots
        if cached is None or cached[0] is not reqs or cached[1].shape[0] != len(reqs):
            slots = np.fromiter((r.req_pool_idx for r in reqs), dtype=np.int64, count=len(reqs))
            sp.running_slots = cached = (reqs, slots)
        return cached[1]

    def sp_build_decode_batch(
        self: SpexisScheduler,
        plan_in: Optional[SpexisPlan],
        plan_out: SpexisPlan,
        transit: Optional[ScheduleBatch] = None,
    ) -> Optional[ScheduleBatch]:
        """Every running request's next row (normal or on its draft), fitted to memory.

        ``transit``: the decode batch whose true tokens reach the device before this batch
        runs. A row built on a draft of its request's row there gets an alternative: where
        that row rejects, the device runs it as the normal row the rejection asks for."""
        sp = self.sp
        self.sp_apply_drafts()
        if not sp.running.reqs:
            return None
        patchable = sp.patchable if transit is not None else None
        running = self._sp_running_slots()
        sp.stats.running_requests = running.shape[0]
        rows = sp.slots.next_rows(running, patchable)
        rows = self.sp_apply_selection(rows, plan_in, plan_out, pipelined=transit is not None)
        retractions = sp.stats.retractions
        rows = self.sp_fit_memory(rows)
        ratio = self.new_token_ratio_tracker
        if sp.stats.retractions == retractions:
            # SGLang decays its admission's future-token reservation every decode step that
            # retracts nothing (update_running_batch); SP's decode iteration is that step
            ratio.decay_step()
        sp.stats.new_token_ratio = ratio.current
        if len(rows) == 0:
            return None
        alternatives = transit_rows = None
        if transit is not None:
            alternatives = sp.slots.conditional_alternatives(rows, patchable[rows.slot])
            if sp.forced is not None:
                # benchmark only: the verdict is a function of the transit row, known now;
                # the device redoes exactly the rows whose chain it rejects
                cond = np.flatnonzero(alternatives >= 0)
                s = rows.slot[cond]
                accepts = sp.forced.accepts(s, alternatives[cond] - 1, rows.epoch[cond])
                alternatives[cond[accepts]] = -1
            if (alternatives >= 0).any():
                transit_rows = self._sp_transit_rows(transit, rows)
            else:
                alternatives = None
        meta = self._sp_alloc_kv(rows, alternatives, transit_rows)
        sp.slots.on_launch(rows, alternatives=alternatives)  # counts the rows by kind
        if sp.alpha is not None:
            sp.alpha.on_launch(rows, sp.iteration)
        sp.stats.decode_iterations += 1
        batch = self._sp_decode_batch(rows, *meta, has_alternatives=alternatives is not None)
        if sp.rank0:
            record = sp.record(batch)
            record.drafts_made = self.sp_drafts_wanted(batch, record)
        return batch

    def _sp_transit_rows(self: SpexisScheduler, transit: ScheduleBatch, rows: Rows) -> np.ndarray:
        """Per row, the index of its request's row in the transit batch (0 if none)."""
        index = self.sp.transit_row
        t = self.sp.record(transit).rows.slot
        index[rows.slot] = 0
        index[t] = np.arange(t.shape[0], dtype=np.int64)
        return index[rows.slot]

    def _sp_decode_batch(
        self: SpexisScheduler,
        rows: Rows,
        meta_cpu: Tuple[torch.Tensor, torch.Tensor],
        meta: Tuple[torch.Tensor, ...],
        has_alternatives: bool = False,
    ) -> ScheduleBatch:
        """The ScheduleBatch of ``rows`` on ``_sp_alloc_kv``'s metadata (one host-to-device
        copy of ids, slots, positions and lengths; the tensors are views of it)."""
        reqs = self.sp.req_at[rows.slot].tolist()
        plain = bool(self.sp.plain[rows.slot].all())
        if plain:
            # what init_new would find scanning every request: nothing to return but tokens
            batch = ScheduleBatch(
                reqs=reqs,
                req_to_token_pool=self.req_to_token_pool,
                token_to_kv_pool_allocator=self.token_to_kv_pool_allocator,
                tree_cache=self.tree_cache,
                model_config=self.model_config,
                enable_overlap=False,
                return_logprob=False,
                has_grammar=False,
                device=self.req_to_token_pool.device,
                spec_algorithm=self.spec_algorithm,
                return_hidden_states=False,
                return_hidden_states_mode=CaptureHiddenMode.NULL,
                is_prefill_only=False,
            )
            batch.top_logprobs_nums = batch.token_ids_logprobs = None
        else:
            batch = ScheduleBatch.init_new(
                reqs,
                self.req_to_token_pool,
                self.token_to_kv_pool_allocator,
                self.tree_cache,
                self.model_config,
                False,
                self.spec_algorithm,
            )
            set_decode_logprob_fields(batch, reqs)
        batch.forward_mode = ForwardMode.DECODE
        n = len(rows)
        req_to_token = self.req_to_token_pool.req_to_token
        ids, slots, positions, lens, lens32 = meta[:5]
        batch.input_ids = ids
        batch.req_pool_indices_cpu, batch.seq_lens_cpu = meta_cpu
        batch.req_pool_indices = slots
        batch.seq_lens = lens
        batch.orig_seq_lens = lens32.view(torch.int32)[:n]
        batch.seq_lens_sum = int(rows.position.sum()) + n
        if not has_alternatives:  # (else the launch sets it where each row runs)
            batch.out_cache_loc = req_to_token[slots, positions].to(torch.int64)
        if self.sp.sampling is not None:
            batch.sampling_info = self.sp.sampling.build(batch, rows.slot)
        record = self.sp.add(batch, SPBatch("decode", rows, plain))
        record.launch = LaunchPlan(
            has_spec=self.sp.rank0 and bool(rows.is_spec.any()),
            alternatives=meta[5] if has_alternatives else None,
            transit_rows=meta[6] if has_alternatives else None,
        )
        self.sp_set_penalties(batch)
        self.sp_set_grammar_masks(batch)
        return batch

    def sp_set_grammar_masks(self: SpexisScheduler, batch: ScheduleBatch) -> None:
        """Constrained decoding: each row's grammar mask after its own drafts (``sp_grammar``),
        for the sampler on the last stage and for the draft head on stage 0."""
        if not batch.has_grammar:
            return
        last = self.pp_group.is_last_rank
        if not (last or self.sp.grammar_draft_mask):
            return
        if batch.sampling_info is None:  # stage 0: the draft head reads the mask from it
            batch.sampling_info = SPSamplingBatchInfo.from_schedule_batch(
                batch, self.model_config.vocab_size
            )
        record = self.sp.record(batch)
        rows: Rows = record.rows
        slots = rows.slot.tolist()
        record.needs_drafts |= sp_grammar.set_decode_masks(
            batch,
            rows.position.tolist(),
            lambda i: self.sp.slots.draft_tokens(slots[i]),
            vocab_size=self.model_config.vocab_size,
            sampling_rank=last,
            draft_rank=self.sp.grammar_draft_mask,
        )

    def sp_set_penalties(self: SpexisScheduler, batch: ScheduleBatch) -> None:
        """The sampling rank's penalizers see each row's output prefix (``sp_penalties``).

        The batch's penalizers are freshly prepared; on the last stage they are set from the
        committed output plus the drafts each row was built on. Such a batch also marks that
        the last stage needs the real values of the drafts its rows make
        (``sp_after_launch``): the other ranks record placeholders.
        """
        orchestrator = _required_penalizers(batch)
        if orchestrator is None:
            return
        record = self.sp.record(batch)
        record.needs_drafts = True
        slots = self.sp.slots
        prefixes = [
            (
                row_output_prefix(
                    req.output_ids,
                    slots.draft_tokens(slot),
                    len(req.origin_input_ids),
                    position,
                )
                if needs_penalizer(req.sampling_params)
                else None
            )
            for req, slot, position in zip(
                batch.reqs, record.rows.slot.tolist(), record.rows.position.tolist()
            )
        ]
        set_penalizer_state(orchestrator, prefixes)

    def sp_set_prefill_penalties(self: SpexisScheduler, batch: ScheduleBatch, prefill_reqs) -> None:
        """A request resumed after a retraction samples its next token in a prefill, whose
        penalizers SGLang prepares empty (it counts the output of its running batch only):
        the tokens the request generated before the retraction would go unpenalized, and
        ``min_new_tokens`` would count from zero again. On the sampling rank such a request's
        state is set from its output so far (the prefill's requests come first in ``batch``;
        the rows riding along a mixed batch use no penalizer)."""
        if self.sp.sampling is None or not any(r.output_ids for r in prefill_reqs):
            return
        orchestrator = _required_penalizers(batch)
        if orchestrator is None:
            return
        prefixes = [
            list(r.output_ids) if needs_penalizer(r.sampling_params) else None for r in prefill_reqs
        ]
        prefixes += [None] * (len(batch.reqs) - len(prefill_reqs))
        set_penalizer_state(orchestrator, prefixes)

    def sp_apply_selection(
        self: SpexisScheduler,
        rows: Rows,
        plan_in: Optional[SpexisPlan],
        plan_out: SpexisPlan,
        pipelined: bool = False,
    ) -> Rows:
        """Selective speculation: stage 0 drops the ⌊αB⌋ least confident drafts (§5.1); at
        alpha 1 it runs stock PP's schedule: the rows the device would redo, at most a PP
        micro-batch of them, the other rows held for a later batch (``SlotState.select_pp``).
        The later stages do the same to the same slots.
        ``pipelined``: a decode batch's results reach the device before this batch runs."""
        sp = self.sp
        if sp.rank0:
            running = self._sp_running_slots().shape[0]
            rows, dropped, held = sp.alpha.select(
                sp.slots, rows, running, sp.patchable, pipelined, self.ps.pp_size
            )
            sp.alpha.update_stats(sp.stats)
        else:
            dropped = np.asarray(plan_in.dropped if plan_in is not None else [], dtype=np.int64)
            held = np.asarray(plan_in.held if plan_in is not None else [], dtype=np.int64)
            if dropped.size:
                sp.slots.drop(dropped, selective=True)
                rows = rows.without(dropped)
            if held.size:
                rows = rows.without(held)
        if dropped.size:  # (SlotState counts them in stats.drafts_dropped)
            plan_out.dropped = dropped.tolist()
        if held.size:
            plan_out.held = held.tolist()
        return rows
