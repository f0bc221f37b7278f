"""The SP loop's records: its state between iterations (one per scheduler), a decode batch's
launch plan, the drafts and the transit outputs on their way to the host.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Deque, Dict, List, Optional, Set, Tuple

import numpy as np
import torch
from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
from sglang.srt.managers.schedule_policy import CLIP_MAX_NEW_TOKENS

from spexis_sglang.core.slot_state import Rows, SlotState
from spexis_sglang.core.sp_stats import SPStats
from spexis_sglang.srt.host_staging import HostReadback, HostStaging
from spexis_sglang.srt.prefill_adder import SPRunningBatch
from spexis_sglang.srt.protocol import PLACEHOLDER_TOKEN, PROXY_DRAFT_IDS, unpack_drafts
from spexis_sglang.srt.sp_alpha import AlphaController
from spexis_sglang.srt.sp_emit import SlotEmit
from spexis_sglang.srt.sp_forced import ForcedAcceptance
from spexis_sglang.srt.sp_sampling import SlotSampling
from spexis_sglang.srt.stats import SP_PHASES, PhaseTimer

logger = logging.getLogger(__name__)


def max_new_left(req: Req) -> int:
    """Tokens ``req`` may still generate, clipped as SGLang's admission clips them."""
    left = req.sampling_params.max_new_tokens - len(req.output_ids)
    return max(0, min(left, CLIP_MAX_NEW_TOKENS))


class PendingDrafts:
    """The drafts of one launched decode batch, read when the next batch is built.

    On a GPU they come back to the host in one copy queued behind the forward
    (:class:`HostReadback`); :meth:`read` waits for it, so nobody reads the buffer early.
    Ranks that never see drafts hold placeholders."""

    def __init__(self, rows: Rows, packed=None, event=None, source=None, buckets=False):
        self.rows = rows
        self._packed = packed  # pack_drafts' layout, on the host once the event is done
        self._event = event
        self._source = source  # keeps the copy's device tensor alive until it is read
        self.has_buckets = buckets

    def ready(self) -> bool:
        """The copy has landed (reading does not wait)."""
        return self._event is None or self._event.query()

    def placeholders(self) -> Tuple[np.ndarray, np.ndarray]:
        """What a rank records without reading: placeholder ids, confidence 1."""
        n = len(self.rows)
        return np.full(n, PLACEHOLDER_TOKEN, dtype=np.int64), np.ones(n)

    def read(self) -> Tuple[np.ndarray, np.ndarray, Optional[np.ndarray]]:
        """Draft ids, confidences and (stage 0 with a predictor) length buckets, per row."""
        if self._packed is None:
            return (*self.placeholders(), None)
        if self._event is not None:
            self._event.synchronize()
        ids, conf, buckets = unpack_drafts(self._packed.numpy())
        return ids, conf, buckets if self.has_buckets else None


class TransitOutputs:
    """What the last stage returned for the batch in transit: the tensors on this rank's
    device (stage 0's redo reads the true tokens and drafts there) and their host copy."""

    def __init__(self, tensors: Dict[str, torch.Tensor], n: int, readback: HostReadback):
        self.tensors = tensors
        ids = tensors["next_token_ids"][:n].to(torch.int64)
        drafts = tensors.get(PROXY_DRAFT_IDS)  # a prefill's drafts are never verified
        drafts = torch.zeros_like(ids) if drafts is None else drafts[:n]
        # true token and the draft it verifies, a row each, in one device-to-host copy (rows
        # first: the readback ring grows its pinned buffers along the rows only)
        self.device = torch.stack((ids, drafts), dim=1)
        self._host, self._event = readback.start(self.device)
        #: SGLang's result record, for batches that need more than the tokens (logprobs)
        self.batch_result = None
        self.result_event = None

    def read(self) -> Tuple[np.ndarray, np.ndarray]:
        """True tokens and the drafts they verify, on the host (waits for the copy)."""
        if self._event is not None:
            self._event.synchronize()
        host = self._host.numpy()
        return host[:, 0].copy(), host[:, 1].copy()


@dataclass
class LaunchPlan:
    """How the device completes a decode batch when it launches (``run_batch``)."""

    #: some rows take their input from stage 0's latest draft on the device
    has_spec: bool
    #: rows with an alternative: the transit batch's verdict decides where they run
    alternatives: Optional[torch.Tensor] = None
    #: per row, its request's row in the transit batch (meaningful where it has an alternative)
    transit_rows: Optional[torch.Tensor] = None
    #: the transit batch's outputs (set between scheduling and launch, stage 0)
    transit: Optional[TransitOutputs] = None


@dataclass
class SPBatch:
    """What the SP loop keeps about a batch it launched, beside SGLang's ``ScheduleBatch``.

    Held in :attr:`SPLoopState.batches` under the batch's identity from its launch until its
    results are processed (the batch itself stays in the loop's ``mbs`` until then), so no
    field of ours rides on SGLang's objects."""

    #: "prefill" (SGLang's admission), "decode" (SP rows) or "mixed" (SP rows riding along a
    #: prefill chunk, ``sp_mixed``)
    kind: str
    #: the decode rows, as launched (SlotState rewrites the rows the device redid)
    rows: Optional[Rows] = None
    #: every row returns tokens only (no logprobs, grammar, hidden states): the fast emit
    plain: bool = False
    #: how the device completes the batch at launch (``_sp_resolve_rows``)
    launch: Optional[LaunchPlan] = None
    #: later stages: our keys of the received proxy (drafts, confidences, positions)
    extras: Dict[str, torch.Tensor] = field(default_factory=dict)
    #: stage 0: the batch's drafts on their way to the host
    drafts: Optional[PendingDrafts] = None
    #: the last stage penalises or masks rows by the drafts they are built on: it reads the
    #: drafts' values (the other ranks record placeholders)
    needs_drafts: bool = False
    #: stage 0 makes this batch's drafts after its forward (the LM head of the draft head):
    #: False where nothing would use them (``AlphaController.drafts_wanted``), and the rows
    #: are then verified against placeholders (not counted as verdicts)
    drafts_made: bool = True
    #: stage 0: where each row ran (a redone row at its alternative), sent down with the proxy
    positions: Optional[torch.Tensor] = None
    #: a mixed batch's parts: SGLang's prefill (its results are processed on it) and the
    #: batch of the rows riding along
    prefill: Optional[ScheduleBatch] = None
    rows_batch: Optional[ScheduleBatch] = None

    @property
    def decode(self) -> bool:
        return self.kind == "decode"

    @property
    def mixed(self) -> bool:
        return self.kind == "mixed"

    @property
    def has_rows(self) -> bool:
        """The batch carries SP rows (a decode or a mixed batch)."""
        return self.kind != "prefill"

    @property
    def rows_offset(self) -> int:
        """Where the rows' results start in the batch's outputs (after a mixed prefill's)."""
        return len(self.prefill.reqs) if self.prefill is not None else 0


@dataclass
class SPLoopState:
    """Everything the SP loop keeps between iterations (one per scheduler)."""

    slots: SlotState
    #: the Req decoding under SP in each slot (None: free or draining)
    req_at: np.ndarray
    #: the running requests in batch order (SGLang's stock code scans this batch's reqs)
    running: SPRunningBatch
    #: the last stage's per-slot sampling parameters (None on the ranks that do not sample)
    sampling: Optional[SlotSampling]
    #: benchmark-only forced acceptance (None unless --spexis-benchmark-force-accept)
    forced: Optional[ForcedAcceptance]
    #: latest remaining-length bucket per slot (stage 0, with a length predictor; -1: none)
    length_bucket: np.ndarray
    #: the request returns nothing but tokens (no logprobs, hidden states or grammar): a
    #: batch of such requests is built without scanning them (_sp_decode_batch)
    plain: np.ndarray
    #: per-slot finish and stream prefilters of result processing (sp_emit)
    emit: SlotEmit
    rank0: bool
    #: stage 0's drop ratio, fixed or chosen online (None on the other ranks)
    alpha: Optional[AlphaController] = None
    #: this rank's loop by phase (seconds, cumulative; exported with the counters)
    phases: PhaseTimer = field(default_factory=lambda: PhaseTimer(SP_PHASES), repr=False)
    iteration: int = 0
    #: released requests whose KV is freed once their rows have drained: slot -> (req, retracted)
    draining: Dict[int, Tuple[Req, bool]] = field(default_factory=dict)
    #: drafts of launched decode batches not yet read (see sp_after_launch)
    pending_drafts: List[PendingDrafts] = field(default_factory=list)
    #: look-ahead admission's cap for this iteration (read by get_num_allocatable_reqs)
    admit_cap: Optional[int] = None
    #: stage 0: how many of the queue SGLang's own reservation would admit this iteration
    admit_reservation: Optional[int] = None
    #: a request was released since ``running`` was last filtered
    released_since_filter: bool = False
    #: (running.reqs, their slots): rebuilt when the list changes
    running_slots: Optional[Tuple[list, np.ndarray]] = None
    #: the batch metadata's host-to-device copy, through pinned buffers (a no-op on CPU)
    staging: Optional[HostStaging] = None
    #: the drafts' device-to-host copy, into pinned buffers (a no-op on CPU)
    readback: Optional[HostReadback] = None
    #: the transit batches' true tokens, device to host (a no-op on CPU)
    output_readback: Optional[HostReadback] = None
    #: the rows of a request the device may redo when the transit batch rejects their chain
    #: (tokens only, no penalizer, and an attention backend that reads lengths on the device)
    patchable: Optional[np.ndarray] = None
    #: the rows of a request may ride along a prefill chunk (tokens only, no penalizer or
    #: logit processor reading the output so far; ``sp_mixed``)
    mixable: Optional[np.ndarray] = None
    #: stage 0: each slot's latest draft on the device (the input of its next speculative row)
    draft_by_slot: Optional[torch.Tensor] = None
    #: each slot's row in the transit batch (scratch of _sp_transit_rows)
    transit_row: Optional[np.ndarray] = None
    #: the last stage: its own outputs of the batches in flight, oldest first
    own_outputs: Deque[TransitOutputs] = field(default_factory=deque)
    #: stage 0: launched batches whose length buckets have not reached the host yet
    late_buckets: List[PendingDrafts] = field(default_factory=list)
    #: look-ahead admission: ids of the waiting requests held back once that SGLang's
    #: reservation would have admitted (each counted once; dropped when they start decoding)
    admissions_delayed: Set[str] = field(default_factory=set)
    #: our record of each batch in flight, by ``id`` of SGLang's batch (see SPBatch)
    batches: Dict[int, SPBatch] = field(default_factory=dict)

    # -- set once when the loop starts (init_sp_state) --
    #: the device redoes the rows whose chain the transit batch rejects (where the attention
    #: backend reads the batch's lengths on the device; elsewhere they go stale)
    redo_rows: bool = False
    #: --enable-mixed-chunk: SP rows ride along prefill chunks (sp_mixed)
    mixed_chunk: bool = False
    #: stage 0 masks the drafts with the rows' grammars (sp_grammar)
    grammar_draft_mask: bool = False
    #: stage 0: the model whose draft head makes the drafts after each forward
    model: Optional[Any] = None
    #: stage 0 may leave a decode forward's drafts unmade where nothing would use them
    #: (``SPBatch.drafts_made``): one TP rank, no draft log or trace
    skip_unused_drafts: bool = False
    #: stage 0's Prometheus gauges (--enable-metrics)
    metrics: Optional[Any] = None
    #: stage 0: whether SGLang's request sockets hold nothing (request_poll)
    nothing_queued: Optional[Callable[[], bool]] = None
    #: stage 0: requests held until the scheduler is idle (a flush or a weight update, and
    #: what came after it; SPLoopMixin._sp_hold_for_idle)
    held_requests: List[Any] = field(default_factory=list)
    #: the relay between stages over a local zmq pipe (relay; None: SGLang's gloo relay)
    relay: Optional[Any] = None
    #: stage 0: the draft trace (SPEXIS_DRAFT_LOG; profiling)
    draft_log: Optional[Any] = None
    #: stage 0, benchmark only: length buckets from the truth (--spexis-benchmark-length-oracle)
    length_oracle: Optional[Any] = None
    #: look-ahead admission's gate (None: SGLang's admission)
    admission_gate: Optional[Any] = None
    #: the periodic log line: when it was written, at which decode iteration
    last_log: float = 0.0
    last_logged_iterations: int = 0

    @property
    def stats(self) -> SPStats:
        """The counters: the SP state counts rows and verdicts, the loop the rest."""
        return self.slots.stats

    def record(self, batch) -> Optional[SPBatch]:
        """Our record of ``batch`` (None: not a batch this loop launched)."""
        return None if batch is None else self.batches.get(id(batch))

    def add(self, batch, record: SPBatch) -> SPBatch:
        self.batches[id(batch)] = record
        return record
