"""Stage 0's drafts on the device and the host: a decode batch completed on the device at launch
(speculative rows take their request's latest draft, rows with an alternative run where the
transit batch's verdict puts them), the drafts' copy to the host behind the forward, and their
recording in ``SlotState`` (values read only where the host needs them).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Optional

import numpy as np
from sglang.srt.managers.schedule_batch import ScheduleBatch

from spexis_sglang.core.slot_state import Rows
from spexis_sglang.srt import rows_triton
from spexis_sglang.srt.protocol import (
    PROXY_DRAFT_CONF,
    PROXY_DRAFT_HIDDEN,
    PROXY_DRAFT_HOST,
    PROXY_DRAFT_IDS,
    PROXY_LENGTH_BUCKET,
    PROXY_POSITIONS,
    pack_drafts,
)
from spexis_sglang.srt.sp_grammar import draft_mask_of
from spexis_sglang.srt.sp_records import LaunchPlan, PendingDrafts, SPBatch

if TYPE_CHECKING:
    from spexis_sglang.srt.sp_scheduler import SpexisScheduler

logger = logging.getLogger(__name__)


class SPDraftsMixin:
    """Stage 0's drafts: completing a batch on the device, reading and recording drafts.
    (A mixin of :class:`~.sp_scheduler.SpexisScheduler`.)"""

    def _sp_resolve_rows(self: SpexisScheduler, batch: ScheduleBatch) -> None:
        """Complete a decode batch on the device, in stream order before its forward: stage
        0's speculative rows take their request's latest draft, and rows with an alternative
        run there where the transit batch rejected their chain (stage 0 decides from the true
        tokens that just arrived, the later stages take the positions stage 0 sent); one
        kernel on a GPU (``rows_triton``)."""
        sp = self.sp
        record = sp.record(batch)
        plan: LaunchPlan = record.launch
        if plan.alternatives is None and not plan.has_spec:
            return
        alternatives = transit = transit_rows = given = forced_vocab = None
        if plan.alternatives is not None:
            if sp.rank0:
                alternatives, transit_rows = plan.alternatives, plan.transit_rows
                transit = plan.transit.device
                if sp.forced is not None:  # benchmark only: the host chose the rows
                    forced_vocab = self.model_config.vocab_size
            else:
                given = record.extras[PROXY_POSITIONS]
        ids, positions, out_cache_loc = rows_triton.resolve_rows(
            batch.input_ids,
            batch.req_pool_indices,
            batch.seq_lens,
            batch.orig_seq_lens,
            self.req_to_token_pool.req_to_token,
            draft_by_slot=sp.draft_by_slot if plan.has_spec else None,
            alternatives=alternatives,
            transit_rows=transit_rows,
            transit=transit,
            given_positions=given,
            forced_vocab=forced_vocab,
        )
        batch.input_ids = ids
        if plan.alternatives is None:
            return
        batch.out_cache_loc = out_cache_loc
        if sp.rank0:
            record.positions = positions
        if batch.seq_lens.device.type == "cpu":  # exact host lengths (the GPU's are bounds)
            batch.seq_lens_sum = int(batch.seq_lens.sum())

    def _sp_make_drafts(
        self: SpexisScheduler, batch: ScheduleBatch, result, record: Optional[SPBatch]
    ) -> None:
        """Stage 0: the drafts of the forward just queued, from the draft head's hidden state
        (``spexis_make_drafts``: the head's LM head, on the forward stream behind it). A decode
        batch whose drafts nothing would use (``SPBatch.drafts_made``) skips it: its rows go
        down the pipe with the forward's placeholder drafts."""
        proxy = getattr(result, "pp_hidden_states_proxy_tensors", None)
        if proxy is None or PROXY_DRAFT_HIDDEN not in proxy.tensors:
            return
        tensors = proxy.tensors
        if record is not None and not record.drafts_made:
            del tensors[PROXY_DRAFT_HIDDEN]
            self.sp.stats.drafts_unmade_forwards += 1
            return
        rows = len(batch.reqs)
        mode = batch.forward_mode
        model = self.sp.model
        trace = None
        if model.spexis_traces_drafts:
            positions = (batch.seq_lens[:rows] - 1).tolist()
            trace = (mode.name, [r.rid for r in batch.reqs], positions)
        mask = None if mode.is_extend() else draft_mask_of(batch)
        if model.spexis_make_drafts(tensors, rows, mask, trace):
            self.sp.stats.draft_pass_replays += 1

    def sp_drafts_wanted(self: SpexisScheduler, batch: ScheduleBatch, record: SPBatch) -> bool:
        """Stage 0: whether a decode batch about to launch makes its drafts. Not where the
        alpha controller says nothing will use them (alpha 1 away from explore, probe and
        choice iterations: every row built on them is redone on the true token), nothing
        reads their values (a grammar's draft mask, penalties) and stage 0 may skip them."""
        sp = self.sp
        if not sp.skip_unused_drafts or record.needs_drafts or draft_mask_of(batch) is not None:
            return True
        return sp.alpha is None or sp.alpha.drafts_wanted()

    def _sp_start_draft_readback(self: SpexisScheduler, batch: ScheduleBatch, result) -> None:
        """Stage 0: record the batch's drafts per slot on the device (the inputs of the next
        speculative rows) and queue their copy to the host behind the forward that made them
        (one copy, one reusable event; on CPU the forward's own tensor)."""
        record = self.sp.record(batch)
        # a CUDA-graph replay returns its outputs padded; a mixed batch's rows follow its
        # prefill's requests
        start = record.rows_offset
        end = start + len(record.rows)
        tensors = result.pp_hidden_states_proxy_tensors.tensors
        slots = batch.req_pool_indices if not start else record.rows_batch.req_pool_indices
        self.sp.draft_by_slot[slots] = tensors[PROXY_DRAFT_IDS][start:end]
        packed = tensors[PROXY_DRAFT_HOST][start:end]
        host, event = self.sp.readback.start(packed)
        record.drafts = PendingDrafts(
            record.rows, host, event, packed, PROXY_LENGTH_BUCKET in tensors
        )

    def sp_after_launch(self: SpexisScheduler, batch: ScheduleBatch, result) -> None:
        """Take the drafts stage 0 just made (placeholders on the other stages).

        They are recorded when the next decode batch is built (:meth:`sp_apply_drafts`),
        after the transit batch's results have converted this batch's redone rows; on a GPU
        stage 0 copies them to the host behind the forward (:meth:`run_batch`) and reads them
        only where the host needs their values. Every rank applies its drafts at the same
        point of the loop, which keeps the mirrored states identical.
        """
        stats = self.sp.stats
        stats.iterations += 1
        record = self.sp.record(batch)
        if record is None or not record.has_rows:
            return
        if record.mixed:
            stats.mixed_forwards += 1
        elif getattr(result, "can_run_cuda_graph", False):
            stats.decode_graph_replays += 1
        else:
            stats.decode_eager_forwards += 1
        rows: Rows = record.rows
        if self.sp.rank0:
            pending = record.drafts
        elif record.needs_drafts:
            # The last stage penalises rows by the drafts they are built on (sp_penalties):
            # it takes the drafts' values from the proxy they came down the pipe with.
            # (A mixed batch's rows never need them: sp_mixed.)
            n = len(rows)
            extras = record.extras
            packed = pack_drafts(extras[PROXY_DRAFT_IDS][:n], extras[PROXY_DRAFT_CONF][:n])
            with self.forward_stream_ctx:
                host, event = self.sp.readback.start(packed)
            pending = PendingDrafts(rows, host, event, packed)
        else:
            pending = PendingDrafts(rows)  # placeholders
        self.sp.pending_drafts.append(pending)

    def sp_apply_drafts(self: SpexisScheduler) -> None:
        """Record the drafts of the decode batches launched so far, oldest first.

        Their values are read (waiting for the copy behind the forward) only where the host
        needs them: to choose which drafts to drop (alpha), for a grammar's draft mask or the
        last stage's penalties, or the draft log (an observed iteration whose drops do not
        depend on them ranks its candidates once the copy has landed:
        ``AlphaController.defer_confidences``). Otherwise a speculative row's input comes
        from the device (``_sp_resolve_rows``) and verification compares the draft that
        comes back with the true token, so placeholders are recorded and stage 0 does not
        wait for its own forward; a predictor's length buckets are taken once they have
        landed."""
        sp = self.sp
        self._sp_apply_late_buckets()
        if sp.alpha is not None:
            sp.alpha.land_deferred(sp.slots)  # confidences an observed iteration left behind
        if not sp.pending_drafts:
            return
        with sp.phases.phase("draft_sync"):
            pending, sp.pending_drafts = sp.pending_drafts, []
            read = self._sp_needs_draft_values()
            observe = not read and sp.alpha is not None and sp.alpha.wants_confidences()
            if observe:  # the next select observes: read what has landed, rank the rest later
                read = all(p.ready() for p in pending)
            if sp.alpha is not None:
                sp.alpha.confidences_real = read
            for p in pending:
                rows = p.rows
                if read:
                    ids, conf, buckets = p.read()
                else:
                    (ids, conf), buckets = p.placeholders(), None
                    if p.has_buckets:
                        sp.late_buckets.append(p)
                if sp.draft_log is not None:
                    self._sp_log_drafts(rows, ids, conf, buckets)
                recorded = sp.slots.on_draft(rows.slot, rows.position, rows.epoch, ids, conf)
                if observe and not read:
                    sp.alpha.defer_confidences(p, rows.slot[recorded], np.flatnonzero(recorded))
                self._sp_record_buckets(rows, buckets)
            if sp.length_oracle is not None:  # benchmark only: replaces a predictor
                for p in pending:
                    self._sp_record_buckets(p.rows, sp.length_oracle.buckets(p.rows))

    def _sp_needs_draft_values(self: SpexisScheduler) -> bool:
        sp = self.sp
        if not sp.rank0:
            return True  # placeholders, or the last stage's penalty drafts: no wait for these
        if sp.draft_log is not None:
            return True
        if sp.alpha is not None and sp.alpha.needs_confidences():
            return True
        # a grammar's draft mask reads the drafts (sp_grammar): not a tokens-only batch
        slots = self._sp_running_slots()
        return not bool(sp.plain[slots].all())

    def _sp_apply_late_buckets(self: SpexisScheduler) -> None:
        """Length buckets of earlier batches whose copy has landed since."""
        sp = self.sp
        if not sp.late_buckets:
            return
        waiting = []
        for p in sp.late_buckets:
            if p.ready():
                self._sp_record_buckets(p.rows, p.read()[2])
            else:
                waiting.append(p)
        sp.late_buckets = waiting

    def _sp_record_buckets(
        self: SpexisScheduler, rows: Rows, buckets: Optional[np.ndarray]
    ) -> None:
        if buckets is None:
            return
        sp = self.sp
        sp.stats.rows_predicted_ending += int(np.count_nonzero(buckets >= 0))
        live = sp.req_at[rows.slot] != None  # noqa: E711 (elementwise)
        sp.length_bucket[rows.slot[live]] = buckets[live]

    def _sp_log_drafts(self: SpexisScheduler, rows: Rows, ids, conf, buckets) -> None:
        reqs = self.sp.req_at[rows.slot]
        rids = [None if r is None else r.rid for r in reqs]
        self.sp.draft_log.write(rids, rows.position, rows.token, ids, conf, buckets)
