"""SGLang's ``PrefillAdder`` with its token reservation replaced by a count.

Under ``--spexis-lookahead-admission`` stage 0's gate decides how many waiting requests to
admit from a projection of the KV demand over time (:mod:`spexis_sglang.srt.admission_gate`),
and the count reaches every rank in the iteration's plan (``SpexisPlan.admit_cap``) and
SGLang's loop through ``get_num_allocatable_reqs``. SGLang's adder would still refuse a request
once its reservation (future tokens of the running requests, the new request's whole
``max_new_tokens``) exceeds the free memory, which is exactly the idle memory the projection
lends out. When SP's running batch (:class:`SPRunningBatch`) admits by count for one pass, this
adder keeps every other budget of SGLang's (prefill tokens, chunk size, the prompt must fit in
the memory free now) and lets the count be the limit. Otherwise it is SGLang's adder.

Installed in place of SGLang's class in every scheduler process (``hooks.install``):
``Scheduler._get_new_batch_prefill_raw`` looks ``PrefillAdder`` up at call time.
"""

from __future__ import annotations

import contextlib
import dataclasses

from sglang.srt.managers.schedule_batch import ScheduleBatch
from sglang.srt.managers.schedule_policy import (
    CLIP_MAX_NEW_TOKENS,
    AddReqResult,
    PrefillAdder,
)


@dataclasses.dataclass
class SPRunningBatch(ScheduleBatch):
    """SP's running batch (its requests in batch order, as SGLang's admission scans them) and
    what the admission pass under way tells the adder, which SGLang hands only this batch."""

    #: admit by the gate's count (no token reservation) in this pass
    admit_by_count: bool = False
    #: SP rows that ride along the chunk in this pass (``sp_mixed``; stock SGLang passes its
    #: running batch size under ``--enable-mixed-chunk``)
    mixed_decode_rows: int = 0

    @contextlib.contextmanager
    def admission_pass(self, *, by_count: bool, mixed_decode_rows: int):
        """The settings hold for one admission pass, decided afresh by the next."""
        self.admit_by_count, self.mixed_decode_rows = by_count, mixed_decode_rows
        try:
            yield
        finally:
            self.admit_by_count, self.mixed_decode_rows = False, 0


def _pass_of(running_batch) -> SPRunningBatch:
    """The running batch's pass settings (SGLang's own running batch: none)."""
    return running_batch if isinstance(running_batch, SPRunningBatch) else _NO_PASS


_NO_PASS = SPRunningBatch(reqs=[])


class SpexisPrefillAdder(PrefillAdder):
    """``PrefillAdder`` that, when the scheduler admits by count, reserves no future tokens;
    and that leaves room in the chunk for the SP rows riding along it."""

    def __init__(self, page_size, tree_cache, allocator, running_batch, *args, **kwargs):
        super().__init__(page_size, tree_cache, allocator, running_batch, *args, **kwargs)
        rows = _pass_of(running_batch).mixed_decode_rows
        if rows:
            # what SGLang's num_mixed_decode_tokens does (SP keeps SGLang's own mixing off)
            self.rem_input_tokens -= rows
            if self.rem_chunk_tokens is not None:
                self.rem_chunk_tokens -= rows
            self.rem_total_token_offset += rows
            self.cur_rem_token_offset += rows

    @property
    def count_admission(self) -> bool:
        return _pass_of(self.running_batch).admit_by_count

    @property
    def rem_total_tokens(self):
        if not self.count_admission:
            return super().rem_total_tokens
        # SGLang compares prompt + max_new_tokens + a page against this: with the reservation
        # replaced, what is left of the check is the prompt against the memory free now
        # (add_one_req below makes that exact)
        return self.cur_rem_tokens + CLIP_MAX_NEW_TOKENS + self.page_size

    def add_one_req(self, req, has_chunked_req, truncation_align_size):
        if self.count_admission:
            extend = len(req.full_untruncated_fill_ids) - len(req.prefix_indices)
            if self.ceil_paged_tokens(extend) + self.page_size > self.cur_rem_tokens:
                return AddReqResult.NO_TOKEN
        return super().add_one_req(req, has_chunked_req, truncation_align_size)
