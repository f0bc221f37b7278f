"""Speculative-parallel bookkeeping in arrays indexed by request slot: :class:`SPState` for the
hot path (docs/design.md §2-3).

:class:`SlotState` keeps exactly the state of :class:`~.sp_state.SPState` (read its module
docstring first: positions, rows, epochs, draining), but in preallocated numpy arrays indexed
by a request's *slot* (SGLang's ``req_pool_idx``, an int in ``[0, capacity)``), and every event
is a batch operation on numpy arrays: a decode iteration costs a few dozen numpy calls instead
of several Python calls per row. ``SPState`` stays the oracle: ``tests/core/test_slot_state.py``
drives both on random event sequences and demands identical rows, verdicts and commits.

Per-slot state
--------------
``epoch``, ``verified_len`` (V), ``last_token``, ``frontier`` (F, the position of the next row),
``high_water``, the number of rows in flight, the pending draft (made, not launched) and its
confidence, and ``limit`` (the length the request may reach; see *Useless drafts*).

Epochs are per slot and never go back: a slot's next occupant starts one above the epoch its
last occupant ended with (``SPState`` starts every request at 0; the tags differ by a constant
per request, the verdicts do not), so a draft applied late for a row of the previous occupant
is recognised as stale like any other.

The launched, unverified drafts of the current epoch are exactly the speculative rows at
positions ``V .. F-1`` (a normal row sits at ``V-1``; every later row of the epoch is
speculative; an acceptance moves ``V`` up by one, a rejection resets ``F`` to ``V-1``), so their
number is ``max(0, F - V)`` and no queue is needed: their tokens and confidences live in a ring
of ``depth`` entries per slot indexed by ``position % depth``. ``depth`` is the most rows a
request may have in flight (the pipeline's loop depth): the unverified drafts are in flight
behind the normal row, so they never exceed ``depth - 1``.

Batches
-------
:meth:`SlotState.on_launch` records the launched :class:`Rows` in a FIFO. Each pipeline stage
executes iterations in order, so results return batch by batch in launch order:
:meth:`SlotState.on_result` takes the true tokens of the oldest batch in flight (optionally
checking its slots: one order check per batch, where ``SPState`` checks every row). A request
has at most one row per batch, so the rows of a batch update distinct slots and one pass of
numpy operations processes them all.

Every event that changes the state bumps a version; :meth:`SlotState.next_rows` stamps the rows
it plans with it (``Rows.plan``, kept by a boolean :meth:`Rows.take`). Launching rows stamped
with the current version skips the per-row checks that they are the planned ones (nothing
changed since they were planned, and a subset of a plan is a plan); any other rows are checked
row by row, as before. The depth check runs either way.

Useless drafts
--------------
``admit(..., limit=L)``: the request stops at ``L`` tokens (prompt + ``max_new_tokens``, or the
context length if smaller), so a speculative row at ``p`` is useful only if ``p + 1 < L``.
:meth:`SlotState.next_rows` drops the pending draft of a request whose next row would be a
useless speculative row (``SPState.drop_draft``, as ``sp_build_decode_batch`` does after
``next_row``), and :meth:`SlotState.on_result` flags the commits that reach ``L``.

Release and draining
--------------------
:meth:`SlotState.release` (finish, abort, stop string, retraction) is ``SPState.remove``: the
slot stops producing rows, its rows in flight come back ``STALE``, and once the last one is back
:meth:`SlotState.pop_drained` reports the slot (free its KV now; the slot may then be admitted
again). Releasing a slot that is not active is a no-op.

Typical driving sequence per iteration (stage 0)::

    res = st.on_result(true_ids)                 # oldest batch in flight, launched N ago
    emit(res.committed_slots, res.committed_tokens)           # verdicts in res.verdict
    st.release(finished_slots)                   # e.g. res.rows.slot[res.at_limit], EOS, aborts
    st.on_draft(last.slot, last.position, last.epoch, draft_ids, draft_conf)   # batch t-1
    rows = st.next_rows(running_slots)           # who rides this iteration, on which token
    rows, dropped = st.select(rows, alpha)       # drop the floor(alpha * B) least confident
    rows = rows.take(fits_in_kv(st.needs_slot(rows)))         # memory (drop(): spec first)
    st.on_launch(rows); last = rows              # launch; rows.epoch is the tag to send along
    for slot in st.pop_drained(): free_kv(slot)

Later PP ranks mirror this with placeholder drafts and pass the real drafts, which come back
with the true tokens, as ``on_result(true_ids, launched_drafts=drafts)``.
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass

import numpy as np

from .selection import select_drops
from .sp_outcome import Outcome, SPProtocolError
from .sp_stats import SPStats

__all__ = ["NO_LIMIT", "Results", "Rows", "SlotState", "SlotStateError", "SlotStatus", "Verdict"]

#: ``limit`` of a request without one (no length bound on speculation).
NO_LIMIT = np.iinfo(np.int64).max


class SlotStateError(SPProtocolError):
    """The caller broke the protocol of :class:`SlotState` (a bug in the caller)."""


class Verdict(enum.IntEnum):
    """:class:`~.sp_state.Outcome` as a small integer, for arrays of verdicts."""

    STALE = 0
    APPENDED = 1
    ACCEPTED = 2
    REJECTED = 3

    @property
    def outcome(self) -> Outcome:
        return _OUTCOME[self]


_OUTCOME = {
    Verdict.STALE: Outcome.STALE,
    Verdict.APPENDED: Outcome.APPENDED,
    Verdict.ACCEPTED: Outcome.ACCEPTED,
    Verdict.REJECTED: Outcome.REJECTED,
}


class SlotStatus(enum.IntEnum):
    """Life cycle of a slot: FREE -> ACTIVE (admit) -> DRAINING (release) -> FREE."""

    FREE = 0
    ACTIVE = 1
    #: Released with rows still in flight: they return ``STALE``; the slot is not reusable yet.
    DRAINING = 2


# plain ints for the hot path (an enum attribute lookup costs more than a small numpy op)
_FREE, _ACTIVE, _DRAINING = int(SlotStatus.FREE), int(SlotStatus.ACTIVE), int(SlotStatus.DRAINING)
_STALE, _APPENDED, _ACCEPTED, _REJECTED = (
    int(Verdict.STALE),
    int(Verdict.APPENDED),
    int(Verdict.ACCEPTED),
    int(Verdict.REJECTED),
)
_ACCEPTED8, _REJECTED8, _APPENDED8 = (np.int8(v) for v in (_ACCEPTED, _REJECTED, _APPENDED))


#: the per-row arrays of :class:`Rows`, in order
_ROW_ARRAYS = ("slot", "position", "epoch", "is_spec", "token", "confidence")


def _i64(x: object) -> np.ndarray:
    if type(x) is np.ndarray and x.dtype == np.int64 and x.ndim == 1:
        return x
    return np.atleast_1d(np.asarray(x, dtype=np.int64))


@dataclass(frozen=True, slots=True)
class Rows:
    """Rows of one decode batch, one entry per request (a request has at most one row).

    ``token`` is the input token: the verified token of a normal row, the pending draft of a
    speculative row (a placeholder on ranks that never see drafts). ``confidence`` is 1 for a
    normal row, the draft's confidence for a speculative row.
    """

    slot: np.ndarray  # int64
    position: np.ndarray  # int64
    epoch: np.ndarray  # int64
    is_spec: np.ndarray  # bool
    token: np.ndarray  # int64
    confidence: np.ndarray  # float64
    #: the state version that planned these rows (:meth:`SlotState.next_rows`); -1: not a
    #: plan of the state (built or reordered by the caller), so a launch checks every row
    plan: int = -1

    def __len__(self) -> int:
        return int(self.slot.shape[0])

    def take(self, index: np.ndarray) -> Rows:
        """The rows selected by a boolean mask or an index array (in that order).

        A mask keeps a plan a plan (a subset of planned rows is planned); an index array may
        repeat or reorder rows, so its rows are no longer the state's plan."""
        return Rows(
            self.slot[index],
            self.position[index],
            self.epoch[index],
            self.is_spec[index],
            self.token[index],
            self.confidence[index],
            self.plan if getattr(index, "dtype", None) == np.bool_ else -1,
        )

    def without(self, slots: np.ndarray) -> Rows:
        """The rows whose slot is not in ``slots`` (e.g. drops decided on stage 0)."""
        slots = _i64(slots)
        if slots.size == 0:
            return self
        return self.take(~np.isin(self.slot, slots))

    @staticmethod
    def empty() -> Rows:
        z = np.empty(0, dtype=np.int64)
        return Rows(z, z, z, np.empty(0, dtype=bool), z, np.empty(0, dtype=np.float64))


@dataclass(slots=True)
class _Launched:
    """A batch in flight: its rows, and for a conditional launch (:meth:`SlotState.on_launch`)
    each row's alternative position (-1: none) and the sequence number of the batch whose
    verdicts decide it."""

    rows: Rows
    seq: int
    alternatives: np.ndarray | None = None
    depends_on: int = -1


@dataclass(frozen=True, slots=True)
class Results:
    """What the true tokens of one returning batch meant (see :meth:`SlotState.on_result`)."""

    #: The batch as launched (its slots, positions, epochs, ...).
    rows: Rows
    #: ``Verdict`` per row (int8).
    verdict: np.ndarray
    #: The true token per row (meaningful where ``committed``).
    true_token: np.ndarray
    #: The row's true token was committed (verdict is not STALE).
    committed: np.ndarray
    #: Committed, and the request now has ``limit`` tokens (finished by length).
    at_limit: np.ndarray

    @property
    def committed_slots(self) -> np.ndarray:
        return self.rows.slot[self.committed]

    @property
    def committed_tokens(self) -> np.ndarray:
        return self.true_token[self.committed]


class SlotState:
    """Speculative-parallel state of all running requests, by slot (see the module docstring).

    Args:
        capacity: number of slots (SGLang's ``req_to_token_pool`` size).
        depth: the most rows a request may have in flight at once (the pipeline's loop depth,
            ``N`` for an ``N``-stage pipeline); launching more raises :class:`SlotStateError`.
        max_unverified: as in :class:`~.sp_state.SPState`: cap on launched, unverified drafts
            per request (``None``: no cap).
        pipelined: batches are launched before the oldest batch's results are processed
            (:meth:`conditional_alternatives`); ``depth`` is then ``N + 1``.
    """

    def __init__(
        self,
        capacity: int,
        depth: int,
        max_unverified: int | None = None,
        pipelined: bool = False,
    ) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        if depth < 1:
            raise ValueError(f"depth must be >= 1, got {depth}")
        if max_unverified is not None and max_unverified < 0:
            raise ValueError("max_unverified must be >= 0 or None")
        self.capacity = int(capacity)
        self.depth = int(depth)
        self.max_unverified = max_unverified
        self.pipelined = bool(pipelined)
        c, d = self.capacity, self.depth
        self._status = np.zeros(c, dtype=np.int8)
        self._epoch = np.zeros(c, dtype=np.int64)
        self._verified = np.zeros(c, dtype=np.int64)
        self._last = np.zeros(c, dtype=np.int64)
        self._frontier = np.zeros(c, dtype=np.int64)
        self._high = np.zeros(c, dtype=np.int64)
        self._inflight = np.zeros(c, dtype=np.int64)
        self._limit = np.full(c, NO_LIMIT, dtype=np.int64)
        self._has_pending = np.zeros(c, dtype=bool)
        self._pending_tok = np.zeros(c, dtype=np.int64)
        self._pending_conf = np.zeros(c, dtype=np.float64)
        # launched, unverified drafts at positions V..F-1, stored at [slot, position % depth]
        self._ring_tok = np.zeros((c, d), dtype=np.int64)
        self._ring_conf = np.ones((c, d), dtype=np.float64)
        self._mark = np.full(c, -1, dtype=np.int64)  # scratch for the uniqueness check
        self._arange = np.arange(c, dtype=np.int64)
        # launched batches, oldest first: (rows, alternatives, the batch they depend on)
        self._batches: deque[_Launched] = deque()
        self._launches = 0  # batches launched so far (their sequence numbers)
        self._drained: list[np.ndarray] = []
        # scratch for conditional launches: slots of a batch stamped with a counter
        self._stamp = np.zeros(c, dtype=np.int64)
        self._stamp_count = 0
        self._scratch_tok = np.zeros(c, dtype=np.int64)
        self._scratch_pos = np.zeros(c, dtype=np.int64)
        # bumped by every event that changes the state: rows planned at this version are
        # still the plan (Rows.plan; on_launch skips its per-row checks for them)
        self._version = 0
        # rows, verdicts and declined drafts are counted here; the scheduler counts the rest
        # into the same object and exports it (SPStats)
        self.stats = SPStats()

    # ------------------------------------------------------------------ lifecycle
    def admit(
        self,
        slots: np.ndarray | int,
        verified_len: np.ndarray | int,
        last_token: np.ndarray | int,
        limit: np.ndarray | int | None = None,
    ) -> None:
        """Start tracking requests (``SPState.add``), one per slot; arguments broadcast.

        ``verified_len`` tokens are known, ``last_token`` is ``x_{V-1}``; the first row is a
        normal row at ``V - 1``. ``limit``: the length at which the request finishes (speculative
        rows that could only produce tokens beyond it are never launched); ``None``: unbounded.
        """
        s = self._check_slots(_i64(slots))
        v = np.broadcast_to(_i64(verified_len), s.shape)
        tok = np.broadcast_to(_i64(last_token), s.shape)
        if (v < 1).any():
            raise ValueError(f"verified_len must be >= 1, got {v.min()}")
        status = self._status[s]
        if (status == _ACTIVE).any():
            raise SlotStateError(f"slots {s[status == _ACTIVE]} are already active")
        if (status == _DRAINING).any():
            raise SlotStateError(
                f"slots {s[status == _DRAINING]} still have rows in flight from "
                "before their release; wait until pop_drained() reports them"
            )
        self._check_unique(s)
        self._version += 1
        self._status[s] = _ACTIVE
        self._verified[s] = v
        self._last[s] = tok
        self._frontier[s] = v - 1
        self._high[s] = v - 1
        self._inflight[s] = 0
        self._limit[s] = NO_LIMIT if limit is None else np.broadcast_to(_i64(limit), s.shape)
        self._has_pending[s] = False

    def release(self, slots: np.ndarray | int) -> None:
        """Stop requests (``SPState.remove``): their rows in flight drain as ``STALE``.

        Slots with nothing in flight are reported by the next :meth:`pop_drained` at once.
        Releasing a slot that is not active is a no-op.
        """
        s = self._check_slots(_i64(slots))
        s = s[self._status[s] == _ACTIVE]
        if s.size == 0:
            return
        self._check_unique(s)
        self._version += 1
        self._has_pending[s] = False
        idle = self._inflight[s] == 0
        self._status[s] = np.where(idle, _FREE, _DRAINING)
        if idle.any():
            self._free(s[idle])

    def pop_drained(self) -> np.ndarray:
        """Slots released with no rows left in flight since the last call, in the order they
        drained (free their KV now; they may be admitted again)."""
        if not self._drained:
            return np.empty(0, dtype=np.int64)
        out = np.concatenate(self._drained)
        self._drained = []
        return out

    # ------------------------------------------------------------------ queries
    def status(self, slots: np.ndarray | int) -> np.ndarray:
        """:class:`SlotStatus` per slot (int8)."""
        return self._status[self._check_slots(_i64(slots))]

    def active_slots(self) -> np.ndarray:
        """Active slots, ascending."""
        return np.flatnonzero(self._status == _ACTIVE)

    @property
    def num_batches_in_flight(self) -> int:
        return len(self._batches)

    def epoch(self, slots: np.ndarray | int) -> np.ndarray:
        return self._epoch[self._active(slots)]

    def verified_len(self, slots: np.ndarray | int) -> np.ndarray:
        return self._verified[self._active(slots)]

    def num_unverified(self, slots: np.ndarray | int) -> np.ndarray:
        """Launched speculative rows of the current epoch whose input is not yet verified."""
        s = self._active(slots)
        return np.maximum(self._frontier[s] - self._verified[s], 0)

    def draft_tokens(self, slot: int) -> list[int]:
        """Tokens of the request's launched, unverified drafts, oldest first (positions
        ``V ..``): with the committed tokens, the input its newest row was built on
        (``SPState.draft_tokens``)."""
        s = int(self._active(slot)[0])
        v = int(self._verified[s])
        count = max(int(self._frontier[s]) - v, 0)
        return [int(self._ring_tok[s, (v + k) % self.depth]) for k in range(count)]

    def allocated_len(self, slots: np.ndarray | int) -> np.ndarray:
        """Positions below which the request's KV slots exist (its high-water mark), draining
        slots included: what to free when it goes."""
        return self._high[self._check_slots(_i64(slots))]

    def num_inflight_rows(self, slots: np.ndarray | int) -> np.ndarray:
        """Rows launched and not yet returned (valid and stale; draining slots too)."""
        return self._inflight[self._check_slots(_i64(slots))]

    def num_inflight_positions(self, slots: np.ndarray | int) -> np.ndarray:
        """KV slots the request holds beyond its verified tokens (memory accounting)."""
        s = self._active(slots)
        return np.maximum(self._high[s] - self._verified[s], 0)

    def kv_len(self, slots: np.ndarray | int) -> np.ndarray:
        """``verified_len + num_inflight_positions``."""
        s = self._active(slots)
        return np.maximum(self._verified[s], self._high[s])

    def has_pending_draft(self, slots: np.ndarray | int) -> np.ndarray:
        """The request's next row would be speculative (it is a selection candidate)."""
        s = self._active(slots)
        return self._has_pending[s] & (self._frontier[s] >= self._verified[s])

    def chain_confidence(self, slots: np.ndarray | int) -> np.ndarray:
        """Product of the confidences of the launched, unverified drafts (1 if none).

        Multiplied oldest first, as ``SPState.chain_confidence`` does, so the floats agree
        bit for bit.
        """
        s = self._active(slots)
        return self._chain(s)

    def candidate_confidence(self, slots: np.ndarray | int) -> np.ndarray:
        """Chain confidence of the row each pending draft would start: the selection key."""
        s = self._active(slots)
        if not self._has_pending[s].all():
            raise SlotStateError(f"slots {s[~self._has_pending[s]]} have no pending draft")
        return self._chain(s) * self._pending_conf[s]

    def needs_slot(self, rows: Rows) -> np.ndarray:
        """Rows that write past the request's KV: they need a new KV slot.

        Assumes the request held KV for positions ``< V - 1`` when admitted (as after its
        prefill): the KV then covers exactly the positions below ``high_water``.
        """
        return rows.position >= self._high[rows.slot]

    def verifies_draft(self, rows: Rows) -> np.ndarray:
        """Per row of a batch in flight: it is valid and a launched speculative row sits at
        its next position, i.e. its true token will accept or reject a draft (``on_result``
        would say ACCEPTED or REJECTED, not APPENDED or STALE)."""
        s = rows.slot
        valid = (self._status[s] == _ACTIVE) & (rows.epoch == self._epoch[s])
        return valid & (self._frontier[s] > rows.position + 1)

    # ------------------------------------------------------------------ building a batch
    def next_rows(
        self, slots: np.ndarray | None = None, patchable: np.ndarray | None = None
    ) -> Rows:
        """The next row of every request that has one (``SPState.next_row`` per request).

        Args:
            slots: the running requests in batch order (the order decides selection ties);
                default: every active slot, ascending. Draining slots are skipped (a finished
                request may still sit in the running list); free slots are an error.
            patchable: for a batch launched before the oldest batch's results are processed
                (see :meth:`conditional_alternatives`), which slots the device can redo
                (a boolean array over all slots); None otherwise.

        A request without a row waits for verification (its draft is not made yet, was dropped,
        or ``max_unverified`` drafts are in flight). A speculative row the request could not use
        (``position + 1 >= limit``) is not returned and its draft is dropped
        (``SPState.drop_draft``, counted in ``stats.drafts_withheld``). A ``pipelined`` state
        keeps such a draft pending and returns its row only when the row has an alternative
        the request can use (``patchable``: a rejection by the oldest batch makes it the normal
        row at ``V``, useful while ``V + 1 < limit``).
        """
        if slots is None:
            s = np.flatnonzero(self._status == _ACTIVE)
        else:
            s = self._check_slots(_i64(slots))
            status = self._status[s]
            active = status == _ACTIVE
            if not active.all():
                if (status == _FREE).any():
                    raise SlotStateError(f"slots {s[status == _FREE]} are not admitted")
                s = s[active]
        f = self._frontier[s]
        v = self._verified[s]
        normal = f == v - 1
        spec = ~normal & self._has_pending[s]
        if self.max_unverified is not None:
            spec &= f - v < self.max_unverified
        useless = spec & (f + 1 >= self._limit[s])
        if self.pipelined:
            # the draft stays pending: once its chain's oldest row is in transit, a rejection
            # there would turn the row into a useful normal row (patchable given)
            if patchable is not None and useless.any():
                rescued = useless & patchable[s] & (v + 1 < self._limit[s])
                if rescued.any():
                    useless &= ~(rescued & self._in_head(s))
            spec &= ~useless
        elif useless.any():
            self._version += 1
            self._has_pending[s[useless]] = False
            self.stats.drafts_withheld += int(np.count_nonzero(useless))
            spec &= ~useless
        keep = normal | spec
        if not keep.all():  # the steady state keeps every request: no copies then
            s, f, spec = s[keep], f[keep], spec[keep]
        token = np.where(spec, self._pending_tok[s], self._last[s])
        conf = np.where(spec, self._pending_conf[s], 1.0)
        return Rows(s, f, self._epoch[s], spec, token, conf, self._version)

    def drop(self, slots: np.ndarray | int, selective: bool = False) -> None:
        """Decline the pending drafts of these requests (``SPState.drop_draft``): they wait
        for verification. Remove their rows from the batch as well (:meth:`Rows.without`).
        ``selective``: stage 0's selective speculation declined them (the drops a later rank
        applies), counted in ``stats.drafts_dropped``; else ``stats.drafts_withheld``."""
        s = self._active(slots)
        self._version += 1
        had = int(np.count_nonzero(self._has_pending[s]))
        if selective:
            self.stats.drafts_dropped += had
        else:
            self.stats.drafts_withheld += had
        self._has_pending[s] = False

    def select(self, rows: Rows, alpha: float) -> tuple[Rows, np.ndarray]:
        """Selective speculation (§5.1) over the speculative rows of ``rows``, in row order.

        Drops the ``floor(alpha * B)`` candidates with the lowest :meth:`candidate_confidence`
        (``selection.select_drops``; ties drop the later row). Returns the kept rows and the
        dropped slots (what stage 0 sends to the other ranks, which apply them with
        :meth:`drop` and :meth:`Rows.without`).
        """
        if alpha <= 0:
            return rows, np.empty(0, dtype=np.int64)
        cand = np.flatnonzero(rows.is_spec)
        if cand.size == 0:
            return rows, np.empty(0, dtype=np.int64)
        cs = self._active(rows.slot[cand])
        if not self._has_pending[cs].all():
            raise SlotStateError("select() takes the rows of next_rows(): a draft is missing")
        drops = select_drops(self._chain(cs) * self._pending_conf[cs], alpha)
        if drops.size == 0:
            return rows, np.empty(0, dtype=np.int64)
        keep = np.ones(len(rows), dtype=bool)
        keep[cand[drops]] = False
        dropped = cs[drops]
        return self._take_declining(rows, keep, dropped), dropped

    def select_pp(
        self, rows: Rows, patchable: np.ndarray, pipelined: bool, cap: int | None = None
    ) -> tuple[Rows, np.ndarray, np.ndarray]:
        """Selection at alpha 1 (no speculation that can be wasted): what stock PP runs.

        A speculative row the device would redo where the transit batch rejects its draft
        (its request's row is in the oldest batch in flight, ``pipelined``, and the slot is
        ``patchable``: :meth:`conditional_alternatives`) is never wasted, so it stays: it is
        the request's next row, N iterations after the last, as in a stock PP micro-batch.
        Any other speculative row of a patchable slot is *held*: left out of this batch with
        its draft kept pending, to run once its request's row reaches the oldest batch (a
        declined draft would leave the request nothing to launch then, and its next row would
        wait for verification: one iteration in N + 1 idle). Slots that cannot be redone
        drop their drafts as :meth:`select` does.

        ``cap``: at most this many rows (stock PP's micro-batch, ``ceil(B / N)``); the rows
        past it wait one iteration (held, drafts kept), which moves their requests to the next
        phase, so requests that run in step spread over the N phases as PP's micro-batches do
        instead of all riding one batch every N iterations with the stages idle in between.

        Returns the kept rows, the dropped slots and the held slots (the later stages remove
        both: :meth:`drop` the first)."""
        empty = np.empty(0, dtype=np.int64)
        keep = np.ones(len(rows), dtype=bool)
        dropped = empty
        cand = np.flatnonzero(rows.is_spec)
        if cand.size:
            cs = self._active(rows.slot[cand])
            patch = patchable[cs].astype(bool)
            redoable = np.zeros(cs.shape[0], dtype=bool)
            if pipelined:
                redoable = patch & self._in_head(cs) & (rows.epoch[cand] == self._epoch[cs])
            dropped = cs[~patch]
            keep[cand[~redoable]] = False
        if cap is not None:
            keep &= np.cumsum(keep) <= max(cap, 1)
        if keep.all():
            return rows, empty, empty
        removed = rows.slot[~keep]
        held = removed[~np.isin(removed, dropped)]  # in row order
        return self._take_declining(rows, keep, dropped), dropped, held

    def _take_declining(self, rows: Rows, keep: np.ndarray, dropped: np.ndarray) -> Rows:
        """``rows`` where ``keep``, after declining the pending drafts of ``dropped`` (none of
        them among the kept rows). Rows that were the plan stay the plan: the kept rows are
        untouched by the drops."""
        planned = rows.plan == self._version
        if dropped.size:
            self._version += 1
            self._has_pending[dropped] = False
            self.stats.drafts_dropped += int(dropped.size)
        kept = rows.take(keep)
        if planned and dropped.size:
            kept = Rows(*(getattr(kept, f) for f in _ROW_ARRAYS), self._version)
        return kept

    # ------------------------------------------------------------------ events
    def conditional_alternatives(
        self, rows: Rows, patchable: np.ndarray | None = None
    ) -> np.ndarray:
        """For a batch about to launch while the true tokens of the oldest batch in flight are
        on their way to the device (the pipelined loop of ``sp_scheduler``): where each row
        goes if that batch rejects the draft the row is built on, else -1.

        A speculative row depends on the oldest batch when its request's row there is valid:
        that row sits at ``V - 1`` and its verdict accepts or rejects the draft at ``V``, on
        which this row's chain is built. If it rejects, the device runs this row instead as
        the normal row at ``V`` carrying the true token (so no iteration is lost to the
        rejection), and :meth:`on_result` records that conversion. Rows not ``patchable``
        (the device cannot redo them: e.g. a grammar mask built for the speculative input)
        get -1 and simply go stale on a rejection, as any other row of the old epoch.
        Pure: nothing changes until :meth:`on_launch` takes the result.
        """
        alt = np.full(len(rows), -1, dtype=np.int64)
        if not self._batches or len(rows) == 0:
            return alt
        s = rows.slot
        cond = rows.is_spec & self._in_head(s) & (rows.epoch == self._epoch[s])
        if patchable is not None:
            cond &= patchable
        alt[cond] = self._verified[s[cond]]
        return alt

    def on_launch(self, rows: Rows, alternatives: np.ndarray | None = None) -> None:
        """Record a launched batch (``SPState.on_launch`` per row) and queue it for its results.

        Every row must be the one :meth:`next_rows` describes (slot active, position, epoch,
        kind and token); anything else raises :class:`SlotStateError` before any state changes.
        The state keeps ``rows``: do not modify its arrays afterwards (:meth:`on_result`
        rewrites the rows a rejection converted, in place).

        ``alternatives``: :meth:`conditional_alternatives` of these rows, for a batch launched
        before the oldest batch's results are processed (its rows then depend on them).
        """
        s = self._check_slots(rows.slot)
        n = s.shape[0]
        pos, spec, token, conf = rows.position, rows.is_spec, rows.token, rows.confidence
        if not (pos.shape == rows.epoch.shape == spec.shape == token.shape == conf.shape == (n,)):
            for name in ("position", "epoch", "is_spec", "token", "confidence"):
                if getattr(rows, name).shape != (n,):
                    raise SlotStateError(f"rows.{name} has shape {getattr(rows, name).shape}")
        alt = None
        if alternatives is not None:
            alt = _i64(alternatives) if n else np.empty(0, dtype=np.int64)
            if alt.shape != (n,):
                raise SlotStateError(f"{alt.shape[0]} alternatives for a batch of {n} rows")
        inflight = self._inflight[s]
        if n and rows.plan != self._version:
            self._check_unique(s)
            self._check_launch(rows, s, inflight)
        elif n and int(inflight.max()) >= self.depth:
            self._launch_error(rows, s)
        self._version += 1
        # Every row's token and confidence go to the ring at its position: a speculative
        # row's are the launched draft read back until it is verified; a normal row launches
        # when the request has no unverified draft (frontier V - 1), so its column holds
        # nothing live then, and its launch makes the live range V .. frontier - 1 empty.
        col = pos % self.depth
        self._ring_tok[s, col] = token
        self._ring_conf[s, col] = conf
        n_spec = int(np.count_nonzero(spec))
        self.stats.rows_spec += n_spec
        self.stats.rows_normal += n - n_spec
        front = pos + 1
        self._has_pending[s] = False
        self._inflight[s] = inflight + 1
        self._frontier[s] = front
        self._high[s] = np.maximum(self._high[s], front)
        launched = _Launched(rows, self._launches)
        self._launches += 1
        if alt is not None and self._batches and (alt >= 0).any():
            launched.alternatives = alt
            launched.depends_on = self._batches[0].seq
        self._batches.append(launched)

    def _check_launch(self, rows: Rows, s: np.ndarray, inflight: np.ndarray) -> None:
        f, v, spec = self._frontier[s], self._verified[s], rows.is_spec
        ok = (self._status[s] == _ACTIVE) & (rows.position == f)
        ok &= (rows.epoch == self._epoch[s]) & (inflight < self.depth)
        ok &= rows.token == np.where(spec, self._pending_tok[s], self._last[s])
        ok &= np.where(spec, (f >= v) & self._has_pending[s], f == v - 1)
        if not ok.all():
            self._launch_error(rows, s)

    def _launch_error(self, rows: Rows, s: np.ndarray) -> None:
        """Raise the first reason a launched row is not the planned one."""
        bad = self._status[s] != _ACTIVE
        if bad.any():
            raise SlotStateError(f"launch for slots {s[bad]} that are not active")
        f, v = self._frontier[s], self._verified[s]
        bad = rows.position != f
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise SlotStateError(
                f"slot {s[i]}: launch at position {rows.position[i]}, expected {f[i]}"
            )
        bad = rows.epoch != self._epoch[s]
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise SlotStateError(
                f"slot {s[i]}: row tagged epoch {rows.epoch[i]}, the request is at "
                f"{self._epoch[s[i]]}"
            )
        spec = rows.is_spec
        ok_spec = (f >= v) & self._has_pending[s] & (rows.token == self._pending_tok[s])
        ok_normal = (f == v - 1) & (rows.token == self._last[s])
        bad = np.where(spec, ~ok_spec, ~ok_normal)
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            kind = "speculative" if spec[i] else "normal"
            raise SlotStateError(
                f"slot {s[i]}: {kind} row at {rows.position[i]} with token {rows.token[i]} is "
                f"not the planned one (verified_len {v[i]}, pending draft "
                f"{self._pending_tok[s[i]] if self._has_pending[s[i]] else None}, verified "
                f"token {self._last[s[i]]})"
            )
        bad = self._inflight[s] >= self.depth
        if bad.any():
            raise SlotStateError(f"slots {s[bad]} already have depth={self.depth} rows in flight")
        raise SlotStateError("a launched row is not the planned one")  # not reached

    def on_draft(
        self,
        slots: np.ndarray,
        positions: np.ndarray,
        epochs: np.ndarray,
        tokens: np.ndarray,
        confidences: np.ndarray,
    ) -> np.ndarray:
        """Record the drafts stage 0 made from rows ``(slot, position, epoch)`` for
        ``position + 1`` (``SPState.on_draft`` per row); one row per slot.

        Returns the mask of drafts recorded; the others are useless (request gone, row stale
        or not the newest, or ``position + 1`` already verified).
        """
        s = self._check_slots(_i64(slots))
        p, e = _i64(positions), _i64(epochs)
        f = self._frontier[s]
        ok = (
            (self._status[s] == _ACTIVE)
            & (e == self._epoch[s])
            & (p + 1 == f)
            & (f >= self._verified[s])
        )
        self._version += 1
        if ok.all():  # the drafts of the batch just launched: every one is recorded
            self._has_pending[s] = True
            self._pending_tok[s] = tokens
            self._pending_conf[s] = confidences
        elif ok.any():
            so = s[ok]
            self._has_pending[so] = True
            self._pending_tok[so] = _i64(tokens)[ok]
            self._pending_conf[so] = np.asarray(confidences, dtype=np.float64)[ok]
        return ok

    def backfill_confidences(
        self,
        slots: np.ndarray,
        positions: np.ndarray,
        epochs: np.ndarray,
        confidences: np.ndarray,
    ) -> int:
        """The real confidences of drafts :meth:`on_draft` recorded with placeholders (made
        from rows ``(slot, position, epoch)``), once they reach the host: a draft still
        pending takes its own, one launched and still unverified in flight takes it in the
        chain of the rows built on it. Drafts since verified, dropped, or left behind by a
        rejection (another epoch) are passed over. Only the selection key changes. Returns
        how many drafts took their confidence."""
        s = self._check_slots(_i64(slots))
        q = _i64(positions) + 1  # the position each draft is for
        conf = np.asarray(confidences, dtype=np.float64)
        live = (self._status[s] == _ACTIVE) & (_i64(epochs) == self._epoch[s])
        pending = live & self._has_pending[s] & (self._frontier[s] == q)
        self._pending_conf[s[pending]] = conf[pending]
        flying = live & ~pending & (self._verified[s] <= q) & (q < self._frontier[s])
        self._ring_conf[s[flying], q[flying] % self.depth] = conf[flying]
        return int(np.count_nonzero(pending | flying))

    def on_result(
        self,
        true_tokens: np.ndarray,
        launched_drafts: np.ndarray | None = None,
        slots: np.ndarray | None = None,
        count_verdicts: bool = True,
    ) -> Results:
        """Process the true tokens of the oldest batch in flight (``SPState.on_result`` per row).

        ``true_tokens[i]`` is the token for ``position + 1`` of the batch's row ``i``. A row is
        ``STALE`` if its request was released or its epoch is old; otherwise its token is
        committed and it is ``ACCEPTED`` / ``REJECTED`` when a launched speculative row was
        built on a draft for that position (equal / different: the epoch is bumped and the next
        row is a normal row with the true token), else ``APPENDED``.

        Args:
            launched_drafts: the draft each row produced, when the caller knows it better than
                the state (later PP ranks launch speculative rows with placeholders).
            slots: if given, must equal the batch's slots (a check that the caller processes
                results in launch order).
            count_verdicts: False where the batch's drafts were never made (placeholders
                stood in): its ACCEPTED / REJECTED verdicts act as usual but are counted in
                ``stats.unmade_drafts_verified``, not as accepted or rejected drafts.
        """
        if not self._batches:
            raise SlotStateError("result with no batch in flight")
        head = self._batches[0]
        rows = head.rows
        n = len(rows)
        y = _i64(true_tokens) if n else np.empty(0, dtype=np.int64)
        if y.shape != (n,):
            raise SlotStateError(f"{y.shape[0]} true tokens for a batch of {n} rows")
        if slots is not None and not np.array_equal(_i64(slots), rows.slot):
            raise SlotStateError("results out of launch order: slots differ from the oldest batch")
        ld = None
        if launched_drafts is not None:
            ld = _i64(launched_drafts) if n else np.empty(0, dtype=np.int64)
            if ld.shape != (n,):
                raise SlotStateError(f"{ld.shape[0]} launched drafts for a batch of {n} rows")
        s, p = rows.slot, rows.position
        status = self._status[s]
        valid = (status == _ACTIVE) & (rows.epoch == self._epoch[s])
        # the steady state: every row valid, so no subsets are taken
        all_valid = bool(valid.all())
        vs, vp = (s, p) if all_valid else (s[valid], p[valid])
        vp1 = vp + 1
        bad = vp1 != self._verified[vs]
        if bad.any():
            raise SlotStateError(
                f"slot {vs[bad][0]}: valid row at {vp[bad][0]} returned but "
                f"{self._verified[vs[bad][0]]} tokens are verified"
            )
        self._batches.popleft()
        self._version += 1

        # every row leaves the pipe; draining slots whose last row this was are free again
        self._inflight[s] -= 1
        if not all_valid:
            draining = status == _DRAINING
            if draining.any():
                ds = s[draining]
                done = ds[self._inflight[ds] == 0]
                if done.size:
                    self._free(done)

        vy = y if all_valid else y[valid]
        front = self._frontier[vs]
        has_draft = front > vp1  # a speculative row sits at vp + 1
        if ld is None:
            d_tok = self._ring_tok[vs, vp1 % self.depth]
        else:
            d_tok = ld if all_valid else ld[valid]
        acc = has_draft & (d_tok == vy)
        rej = has_draft ^ acc
        vp2 = vp1 + 1
        self._verified[vs] = vp2
        self._last[vs] = vy
        n_acc = int(np.count_nonzero(acc))
        n_rej = int(np.count_nonzero(rej))
        if n_rej:
            rs = vs[rej]
            self._epoch[rs] += 1
            self._frontier[rs] = vp1[rej]
        # a rejected row's pending draft is built on the wrong token; where no launched row
        # depends on the token, a pending draft for the same position is obsolete (the next
        # row is a normal row with the true token)
        self._has_pending[vs[rej | (front == vp1)]] = False
        if n_rej:
            self._convert(head.seq, rs, vp1[rej], vy[rej])

        v_verdict = np.where(has_draft, np.where(acc, _ACCEPTED8, _REJECTED8), _APPENDED8)
        v_limit = vp2 >= self._limit[vs]
        if all_valid:
            verdict, at_limit = v_verdict, v_limit
        else:
            verdict = np.full(n, _STALE, dtype=np.int8)
            verdict[valid] = v_verdict
            at_limit = np.zeros(n, dtype=bool)
            at_limit[valid] = v_limit
        if count_verdicts:
            self.stats.accepted += n_acc
            self.stats.rejected += n_rej
        else:
            self.stats.unmade_drafts_verified += n_acc + n_rej
        self.stats.tokens_committed += vs.size
        self.stats.rows_stale += n - vs.size
        return Results(rows, verdict, y, valid, at_limit)

    # ------------------------------------------------------------------ helpers
    def _in_head(self, s: np.ndarray) -> np.ndarray:
        """Per slot in ``s``: its request has a valid row in the oldest batch in flight."""
        if not self._batches:
            return np.zeros(s.shape[0], dtype=bool)
        head = self._batches[0].rows
        hs = head.slot
        valid = (self._status[hs] == _ACTIVE) & (head.epoch == self._epoch[hs])
        self._stamp_count += 1
        self._stamp[hs[valid]] = self._stamp_count
        return self._stamp[s] == self._stamp_count

    def _convert(
        self, seq: int, slots: np.ndarray, positions: np.ndarray, tokens: np.ndarray
    ) -> None:
        """Rows launched conditionally on batch ``seq`` whose request it just rejected
        (``slots``, with the rejected position and the true token there) ran on the device as
        the normal row at that position: record them so, in the new epoch."""
        for launched in self._batches:
            if launched.depends_on != seq:
                continue
            rows, alt = launched.rows, launched.alternatives
            self._stamp_count += 1
            self._stamp[slots] = self._stamp_count
            self._scratch_tok[slots] = tokens
            self._scratch_pos[slots] = positions
            hit = np.flatnonzero((alt >= 0) & (self._stamp[rows.slot] == self._stamp_count))
            if hit.size == 0:
                continue
            cs = rows.slot[hit]
            pos = alt[hit]
            wrong = self._scratch_pos[cs] != pos
            if wrong.any():
                raise SlotStateError(
                    f"slots {cs[wrong]}: a conditional row's alternative "
                    "is not the position its request's rejection reopened"
                )
            tok = self._scratch_tok[cs]
            rows.position[hit] = pos
            rows.epoch[hit] = self._epoch[cs]
            rows.is_spec[hit] = False
            rows.token[hit] = tok
            rows.confidence[hit] = 1.0
            col = pos % self.depth
            self._ring_tok[cs, col] = tok
            self._ring_conf[cs, col] = 1.0
            self._frontier[cs] = pos + 1
            k = int(hit.size)
            self.stats.rows_redone += k

    def _free(self, s: np.ndarray) -> None:
        self._status[s] = _FREE
        # the next occupant starts above every epoch the last one used: a late draft of the
        # last occupant's rows can never pass for one of the new occupant's
        self._epoch[s] += 1
        self._drained.append(s)

    def _chain(self, s: np.ndarray) -> np.ndarray:
        count = np.maximum(self._frontier[s] - self._verified[s], 0)
        c = np.ones(s.shape[0], dtype=np.float64)
        top = int(count.max()) if count.size else 0
        v = self._verified[s]
        for k in range(top):
            # x * 1.0 == x exactly: the product stays the oldest-first one of SPState
            c *= np.where(count > k, self._ring_conf[s, (v + k) % self.depth], 1.0)
        return c

    def _check_slots(self, s: np.ndarray) -> np.ndarray:
        if s.ndim != 1:
            raise SlotStateError(f"slots must be one-dimensional, got shape {s.shape}")
        # a negative slot reads as a huge unsigned one: one reduction checks both ends
        if s.size and s.view(np.uint64).max() >= self.capacity:
            raise SlotStateError(f"slots must lie in [0, {self.capacity}), got {s}")
        return s

    def _active(self, slots: np.ndarray | int) -> np.ndarray:
        s = self._check_slots(_i64(slots))
        bad = self._status[s] != _ACTIVE
        if bad.any():
            raise SlotStateError(f"slots {s[bad]} are not active (released or never admitted)")
        return s

    def _check_unique(self, s: np.ndarray) -> None:
        idx = self._arange[: s.shape[0]]
        self._mark[s] = idx
        if (self._mark[s] != idx).any():
            raise SlotStateError(f"a slot appears more than once in {s}")
