"""A returned batch's results: a prefill's as SGLang processes them (its requests then start
decoding under SP), a decode batch's verdicts (``SlotState.on_result``), committed tokens,
finishes and streaming; releasing requests and freeing their KV once their rows have drained.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, List

import numpy as np
import torch
from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
from sglang.srt.mem_cache.common import release_kv_cache
from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode
from sglang.srt.utils.common import ceil_align

from spexis_sglang.core.slot_state import NO_LIMIT, Rows
from spexis_sglang.srt import sp_grammar
from spexis_sglang.srt.sp_emit import emit_batch
from spexis_sglang.srt.sp_logprobs import DecodeLogprobs
from spexis_sglang.srt.sp_penalties import needs_penalizer
from spexis_sglang.srt.sp_records import SPBatch, TransitOutputs

if TYPE_CHECKING:
    from spexis_sglang.srt.sp_scheduler import SpexisScheduler

logger = logging.getLogger(__name__)


class SPVerifyMixin:
    """A returned batch's results, and releasing requests. (A mixin of
    :class:`~.sp_scheduler.SpexisScheduler`.)"""

    def sp_process_result(self: SpexisScheduler, batch: ScheduleBatch, outputs: TransitOutputs):
        """A returned batch's results: a prefill's as SGLang processes them (its requests then
        start decoding under SP); a decode batch's verdicts, committed tokens and finishes; a
        mixed batch's, both."""
        record = self.sp.record(batch)
        if not record.has_rows:
            self.process_batch_result(batch, outputs.batch_result)
            self.sp_admit_prefilled(batch)
            return
        true_ids, drafts = outputs.read()
        result = outputs.batch_result
        if record.mixed:
            # the prefill's tokens come first (sp_mixed), its result record holds only them
            self.process_batch_result(record.prefill, result)
            self.sp_admit_prefilled(record.prefill)
            p = record.rows_offset
            batch, result = record.rows_batch, None
            true_ids, drafts = true_ids[p:], drafts[p:]
        self._sp_commit_rows(batch, record, true_ids, drafts, result)

    def _sp_commit_rows(
        self: SpexisScheduler,
        batch: ScheduleBatch,
        record: SPBatch,
        true_ids: np.ndarray,
        drafts: np.ndarray,
        result,
    ) -> None:
        """A batch of SP rows: verdicts (``SlotState.on_result``), committed tokens, finishes
        and streaming. ``batch.reqs`` holds each row's request, ``result`` SGLang's result
        record where the rows return more than tokens."""
        sp = self.sp
        rows: Rows = record.rows
        forced = sp.forced
        if forced is not None:
            # Benchmark-only: pretend the target agreed with the draft w.p. theta (timed
            # apart: a serving loop does not do this)
            with sp.phases.phase("forced"):
                built_on_draft = sp.slots.verifies_draft(rows)
                true_ids = forced.true_tokens(rows, true_ids, drafts, built_on_draft)
        # SlotState counts the verdicts, stale rows and redone rows into sp.stats
        # (a batch whose drafts were not made verified placeholders: no verdicts to count)
        made = record.drafts_made
        res = sp.slots.on_result(true_ids, launched_drafts=drafts, count_verdicts=made)
        if sp.alpha is not None and made:
            sp.alpha.on_result(rows, res.verdict)
        n_committed = int(np.count_nonzero(res.committed))
        n_stale = len(rows) - n_committed
        if n_committed == 0:
            return
        if record.plain:
            # tokens only: SGLang's per-request finish check and streaming only where they
            # can act (sp_emit); the steady state commits every row, so no subsets then
            if n_stale:
                committed = np.flatnonzero(res.committed)
                slots, tokens = rows.slot[committed], true_ids[committed]
                positions = rows.position[committed]
            else:
                committed, slots, tokens, positions = None, rows.slot, true_ids, rows.position
            finished, to_stream = emit_batch(
                sp.emit,
                batch.reqs,
                slots,
                tokens,
                positions,
                time.perf_counter(),
                forced.top_up if forced is not None else None,
                index=committed,
            )
            for req in finished:
                self._sp_release(req, retracted=False)
            self.output_streamer.stream_output(to_stream, False)
            self.metrics_reporter.num_generated_tokens += n_committed
            return
        committed = np.flatnonzero(res.committed)
        # per committed token, what SGLang does per emitted token
        logprobs = DecodeLogprobs.from_result(batch, result)
        reqs = batch.reqs
        # tokens held back while the request rode plain batches come first
        sp.emit.flush([reqs[i] for i in committed.tolist()], rows.slot[committed])
        touched: List[Req] = []
        finished: List[Req] = []
        for i, token, position in zip(
            committed.tolist(), true_ids[committed].tolist(), rows.position[committed].tolist()
        ):
            req = reqs[i]
            req.kv_committed_len = position + 1
            req.output_ids.append(token)
            if self._sp_counts_reasoning(req):  # stock order: before the finish check
                req.update_reasoning_tokens(token, self.model_config.think_end_ids)
            if logprobs is not None:  # a committed row: its prefix is verified
                logprobs.record(req, i, token)
            if forced is not None:
                forced.label_one(req)
            req.time_stats.set_last_decode_finish_time()
            req.update_finish_state(1)
            if req.grammar is not None:  # stock order: after the finish check
                sp_grammar.accept_committed(req, token)
            if req.finished():
                finished.append(req)
            touched.append(req)
        for req in finished:
            self._sp_release(req, retracted=False)
        self.output_streamer.stream_output(touched, logprobs is not None)
        self.metrics_reporter.num_generated_tokens += len(touched)

    def sp_admit_prefilled(self: SpexisScheduler, batch: ScheduleBatch) -> None:
        """Requests whose prefill result is in start decoding under SP."""
        sp = self.sp
        if batch.chunked_req is not None:
            # As stock SGLang does when it filters a chunked request out of a finished
            # prefill batch: the admission limit hit while that request was in flight no
            # longer holds. (Without this, SP's single running batch stayed "full" until a
            # request finished, leaving the last of 512 requests queued for a whole wave.)
            sp.running.batch_is_full = False
        context = self.req_to_token_pool.req_to_token.shape[1]
        for req in batch.reqs:
            if req.finished() or req.is_retracted or req.inflight_middle_chunks > 0:
                continue
            # batch.chunked_req: this batch carried a non-final chunk of req. (A retracted
            # request keeps its output_ids, so "has output" does not mean "prefilled".)
            if req is batch.chunked_req or req is self.chunked_req:
                continue
            slot = req.req_pool_idx
            if slot is None or sp.req_at[slot] is req or not req.output_ids:
                continue
            if slot in sp.draining:
                continue
            prompt_len = len(req.origin_input_ids)
            max_new = req.sampling_params.max_new_tokens
            limit = min(context, NO_LIMIT if max_new is None else prompt_len + max_new)
            verified = prompt_len + len(req.output_ids)
            if req.kv.kv_allocated_len != verified - 1:
                # SlotState assumes the prefill left KV for exactly the verified tokens but
                # the last (needs_slot); anything else would leak or overwrite KV slots
                raise RuntimeError(
                    f"Spexis: request {req.rid} starts decoding with KV for "
                    f"{req.kv.kv_allocated_len} positions, expected {verified - 1}"
                )
            sp.slots.admit(slot, verified, req.output_ids[-1], limit)
            sp.req_at[slot] = req
            sp.length_bucket[slot] = -1
            sp.plain[slot] = not (
                req.return_logprob
                or req.grammar is not None
                or req.return_hidden_states_mode != CaptureHiddenMode.NULL
                or self._sp_counts_reasoning(req)
            )
            # the device may redo the request's rows only if nothing the host prepares for a
            # row depends on its position or input (tokens only, no penalizer or logit
            # processor reading the output so far); the same decides whether its rows may
            # ride along a prefill chunk (sp_mixed)
            sp.mixable[slot] = (
                sp.plain[slot]
                and not needs_penalizer(req.sampling_params)
                and getattr(req, "custom_logit_processor", None) is None
                and not getattr(req, "return_sampling_mask", False)
            )
            sp.patchable[slot] = sp.redo_rows and sp.mixable[slot]
            sp.emit.admit(slot, req, verified)
            if sp.sampling is not None:
                sp.sampling.admit(slot, req)
            if sp.forced is not None:
                sp.forced.admit(slot, req, int(sp.slots.epoch(slot)[0]))
                sp.forced.label(req)
            if sp.length_oracle is not None:
                sp.length_oracle.admit(slot, req, verified, limit)
            sp.admissions_delayed.discard(req.rid)
            sp.running.reqs.append(req)

    def sp_flush_tokens(self: SpexisScheduler) -> None:
        """Append every held-back committed token to its request (``sp_emit``): before
        SGLang code that reads the running requests' ``output_ids`` or ``kv_committed_len``."""
        sp = self.sp
        slots = sp.emit.pending_slots()
        if slots.size:
            sp.emit.flush(sp.req_at[slots].tolist(), slots)

    def _sp_counts_reasoning(self: SpexisScheduler, req: Req) -> bool:
        """The request counts its reasoning tokens (``require_reasoning`` with a reasoning
        parser): SGLang's result processing advances the count per emitted token."""
        return bool(req.require_reasoning and self.model_config.think_end_ids)

    def _sp_release(self: SpexisScheduler, req: Req, retracted: bool) -> None:
        """Stop a request's rows; its KV is freed once the rows in flight have drained."""
        sp = self.sp
        slot = req.req_pool_idx
        sp.emit.flush([req], np.array([slot], dtype=np.int64))
        if sp.forced is not None:
            sp.forced.top_up(req)  # the fast emit path tags tokens when they stream
        allocated = int(sp.slots.allocated_len(slot)[0])
        req.kv.kv_allocated_len = max(req.kv.kv_allocated_len, allocated)
        sp.slots.release(slot)
        sp.req_at[slot] = None
        sp.draining[slot] = (req, retracted)
        sp.released_since_filter = True
        sp.running.batch_is_full = False

    def sp_release_drained(self: SpexisScheduler) -> None:
        """Free the KV of finished / retracted requests whose in-flight rows have all returned."""
        sp = self.sp
        drained = sp.slots.pop_drained()
        if drained.size == 0:
            return
        for slot in drained.tolist():
            sp.length_bucket[slot] = -1
            entry = sp.draining.pop(slot, None)
            if entry is None:
                continue
            req, retracted = entry
            self._sp_free_unverified_slots(req)
            if retracted:
                release_kv_cache(req, self.tree_cache, is_insert=False)
                req.reset_for_retract()
                self._add_request_to_queue(req, is_retracted=True)
            else:
                release_kv_cache(req, self.tree_cache)
                req.time_stats.set_completion_time()
        sp.running.batch_is_full = False

    def _sp_free_unverified_slots(self: SpexisScheduler, req: Req) -> None:
        """Free the KV past the verified tokens, so that SGLang's release sees none.

        With ``--page-size > 1`` the page that holds the last verified token is left to
        ``release_kv_cache`` (it frees that partial page with the request's other pages);
        only the pages after it are freed here."""
        if req.kv is None or req.req_pool_idx is None:
            return
        start, end = req.kv_committed_len, req.kv.kv_allocated_len
        if end > start:
            first = ceil_align(start, self.token_to_kv_pool_allocator.page_size)
            if end > first:
                slots = self.req_to_token_pool.req_to_token[req.req_pool_idx, first:end]
                self.token_to_kv_pool_allocator.free(slots.to(torch.int64))
            req.kv.kv_allocated_len = start
