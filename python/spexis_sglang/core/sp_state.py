"""Per-request bookkeeping of speculative parallelism: epochs, not flags (docs/design.md §2-3).

Positions and rows
------------------
A request has ``verified_len`` verified tokens ``x_0 .. x_{V-1}`` (prompt plus committed
output). A *row* at position ``p`` feeds the token at ``p`` through the model; stage 0 turns
it into a *draft* for ``p + 1`` (with a confidence), the last stage into the *true* token for
``p + 1``, which comes back ``N`` iterations later.

* A **normal** row has a verified input: it sits at ``p = V - 1`` with input ``x_{V-1}``.
* A **speculative** row at ``p`` has as input the (unverified) draft made by the row at
  ``p - 1`` of the same epoch.

Epochs
------
Every request carries an *epoch*. Each launched row records ``(position, epoch)``. When the
true token for ``p + 1`` arrives and disagrees with the draft the row at ``p + 1`` was built
on, the epoch is bumped: all rows still in flight were built on the wrong token, and since
their epoch is now old, their results are recognised as *stale* and ignored when they come
back. The request's next row is a normal row carrying the corrected token. One integer
replaces the flush / drop / just-fixed flags of the reference implementation.

Because each pipeline stage executes iterations in order, the results of a request's rows
return in launch order; :meth:`SPState.on_result` checks this and raises
:class:`SPProtocolError` on a violation (a bug in the caller, never a model event).

Removal and draining
--------------------
Finishes, aborts (including stop strings, which SGLang handles as aborts) and retractions
call :meth:`SPState.remove`. The request stops producing rows at once, but its in-flight rows
still write KV into its slots, so those slots must not be freed yet: the request moves to a
*draining* table, its returning rows are answered ``STALE``, and once the last one is back
it is reported by :meth:`SPState.pop_drained`. Results for ids the state has never seen (or
has forgotten) are answered ``STALE`` as well, so a late row can never crash the scheduler.

Memory accounting
-----------------
The KV slots a request owns extend to its highest launched position (stale positions stay
allocated and are overwritten by the re-executed rows, docs/design.md §4).
:meth:`SPState.num_inflight_positions` is the number of those slots beyond the verified
tokens: what admission and retraction must add to ``verified_len``.

Typical driving sequence per iteration (SGLang scheduler on stage 0)::

    for rid, pos, epoch, tok in last_stage_results:      # rows launched N iterations ago
        outcome = st.on_result(rid, pos, epoch, tok)      # ACCEPTED/REJECTED/APPENDED/STALE
        if outcome is not Outcome.STALE: emit(rid, tok)
    for rid, pos, epoch, tok, conf in stage0_drafts:      # rows launched this iteration
        st.on_draft(rid, pos, epoch, tok, conf)
    cand = [rid for rid in running if st.has_pending_draft(rid)]
    drop = select_drops([st.candidate_confidence(r) for r in cand], alpha)
    for i in drop: st.drop_draft(cand[i])
    for rid in running:
        row = st.launch_next(rid)       # = next_row + on_launch; None: wait for verification
        if row: add_to_batch(rid, row.position, row.token, row.epoch)
    for rid in st.pop_drained(): free_kv(rid)
"""

from __future__ import annotations

import logging
from collections import deque
from typing import Hashable, Iterable, NamedTuple

from .sp_outcome import Outcome, SPProtocolError
from .sp_stats import SPStats

logger = logging.getLogger(__name__)

__all__ = ["Outcome", "RowPlan", "SPProtocolError", "SPState", "SPStats"]


class RowPlan(NamedTuple):
    """The next row of a request: launch ``token`` at ``position`` tagged with ``epoch``."""

    rid: Hashable
    position: int
    token: int
    is_spec: bool
    confidence: float
    epoch: int


class _Req:
    """Mutable per-request record (internal)."""

    __slots__ = (
        "epoch",
        "verified_len",
        "last_token",
        "frontier",
        "high_water",
        "inflight",
        "drafts",
        "pending",
    )

    def __init__(self, verified_len: int, last_token: int, epoch: int) -> None:
        self.epoch = epoch
        self.verified_len = verified_len
        self.last_token = last_token
        # Position of the next row to launch in the current epoch.
        self.frontier = verified_len - 1
        # One past the highest position any row of this request has been launched at.
        self.high_water = verified_len - 1
        # (position, epoch) of rows launched and not yet returned, oldest first.
        self.inflight: deque[tuple[int, int]] = deque()
        # (position, token, confidence) of launched speculative rows of the current epoch
        # whose input is not yet verified, oldest first.
        self.drafts: deque[tuple[int, int, float]] = deque()
        # Draft for position `frontier` (token, confidence), made but not launched.
        self.pending: tuple[int, float] | None = None


class SPState:
    """Speculative-parallel state of all running requests (see the module docstring).

    Args:
        max_unverified: optional cap on the number of launched, unverified drafts per
            request; when reached, :meth:`next_row` returns ``None`` (the request waits for
            verification). ``None`` means no cap (the pipeline depth bounds it anyway).
    """

    def __init__(self, max_unverified: int | None = None) -> None:
        if max_unverified is not None and max_unverified < 0:
            raise ValueError("max_unverified must be >= 0 or None")
        self.max_unverified = max_unverified
        self._reqs: dict[Hashable, _Req] = {}
        # rid -> in-flight (position, epoch) rows of a removed request
        self._draining: dict[Hashable, deque[tuple[int, int]]] = {}
        self._drained: list[Hashable] = []
        self.stats = SPStats()

    # ------------------------------------------------------------------ lifecycle
    def add(self, rid: Hashable, verified_len: int, last_token: int) -> None:
        """Start tracking a request whose ``verified_len`` tokens are known.

        ``last_token`` is ``x_{V-1}``. The first row is a normal row at ``V - 1`` — for a
        request that was just prefilled, that is the prefill's last position: launch it with
        :meth:`on_launch` so its draft can be speculated on before its result returns.
        """
        if verified_len < 1:
            raise ValueError(f"verified_len must be >= 1, got {verified_len}")
        if rid in self._reqs:
            raise SPProtocolError(f"request {rid!r} is already tracked")
        if rid in self._draining:
            raise SPProtocolError(
                f"request {rid!r} still has {len(self._draining[rid])} in-flight rows from "
                "before its removal; wait until pop_drained() reports it"
            )
        self._reqs[rid] = _Req(int(verified_len), int(last_token), 0)

    def remove(self, rid: Hashable) -> None:
        """Stop a request (finish, abort, stop string, retraction).

        Its in-flight rows drain as ``STALE``; once none is left, :meth:`pop_drained`
        returns the id and its KV slots may be freed. Removing an unknown id is a no-op.
        """
        req = self._reqs.pop(rid, None)
        if req is None:
            return
        if req.inflight:
            self._draining[rid] = req.inflight
        else:
            self._drained.append(rid)

    def pop_drained(self) -> list[Hashable]:
        """Ids removed with no rows left in flight since the last call (free their KV now)."""
        out, self._drained = self._drained, []
        return out

    def is_draining(self, rid: Hashable) -> bool:
        return rid in self._draining

    def __contains__(self, rid: object) -> bool:
        return rid in self._reqs

    def __len__(self) -> int:
        return len(self._reqs)

    @property
    def rids(self) -> list[Hashable]:
        return list(self._reqs)

    # ------------------------------------------------------------------ queries
    def _get(self, rid: Hashable) -> _Req:
        try:
            return self._reqs[rid]
        except KeyError:
            raise KeyError(f"request {rid!r} is not tracked (removed or never added)") from None

    def epoch(self, rid: Hashable) -> int:
        return self._get(rid).epoch

    def verified_len(self, rid: Hashable) -> int:
        return self._get(rid).verified_len

    def num_unverified(self, rid: Hashable) -> int:
        """Launched speculative rows of the current epoch whose input is not yet verified."""
        return len(self._get(rid).drafts)

    def draft_tokens(self, rid: Hashable) -> list[int]:
        """Tokens of the launched, unverified drafts, oldest first (positions ``V ..``).

        With the committed tokens they form the input a request's newest row was built on:
        what the row's sampling must be conditioned on (penalties, ``min_new_tokens``).
        """
        return [tok for _, tok, _ in self._get(rid).drafts]

    def num_inflight_rows(self, rid: Hashable) -> int:
        """Rows launched and not yet returned (valid and stale)."""
        if rid in self._reqs:
            return len(self._reqs[rid].inflight)
        return len(self._draining.get(rid, ()))

    def num_inflight_positions(self, rid: Hashable) -> int:
        """KV slots the request holds beyond its verified tokens (for memory accounting)."""
        req = self._get(rid)
        return max(0, req.high_water - req.verified_len)

    def kv_len(self, rid: Hashable) -> int:
        """Slots the request's rows occupy: ``verified_len + num_inflight_positions``."""
        req = self._get(rid)
        return max(req.verified_len, req.high_water)

    def chain_confidence(self, rid: Hashable) -> float:
        """Product of the confidences of the request's launched, unverified drafts (1 if none).

        The chance, by the draft head's own estimate, that the request's newest in-flight
        row is not already doomed.
        """
        c = 1.0
        for _, _, conf in self._get(rid).drafts:
            c *= conf
        return c

    def has_pending_draft(self, rid: Hashable) -> bool:
        """True when the request's next row would be speculative (it is a drop candidate)."""
        req = self._reqs.get(rid)
        return req is not None and req.pending is not None and req.frontier >= req.verified_len

    def candidate_confidence(self, rid: Hashable) -> float:
        """Chain confidence of the row the pending draft would start: the selection key (§5.1)."""
        req = self._get(rid)
        if req.pending is None:
            raise SPProtocolError(f"request {rid!r} has no pending draft")
        return self.chain_confidence(rid) * req.pending[1]

    def next_row(self, rid: Hashable) -> RowPlan | None:
        """The row to launch next for ``rid``, or ``None`` if it must wait for verification.

        * ``frontier == V - 1``: a normal row with the verified (possibly corrected) token.
        * ``frontier >= V`` and a pending draft: a speculative row on that draft.
        * otherwise (draft not made yet, dropped, or ``max_unverified`` reached): ``None``.
        """
        req = self._get(rid)
        if req.frontier == req.verified_len - 1:
            return RowPlan(rid, req.frontier, req.last_token, False, 1.0, req.epoch)
        if req.pending is None:
            return None
        if self.max_unverified is not None and len(req.drafts) >= self.max_unverified:
            return None
        tok, conf = req.pending
        return RowPlan(rid, req.frontier, tok, True, conf, req.epoch)

    def launch_next(self, rid: Hashable) -> RowPlan | None:
        """:meth:`next_row` and :meth:`on_launch` in one step (the scheduler's fast path).

        Returns the launched row (its ``epoch`` is the tag to send along), or ``None`` when
        the request must wait.
        """
        plan = self.next_row(rid)
        if plan is not None:
            self.on_launch(rid, plan.position, plan.token, plan.is_spec, plan.confidence)
        return plan

    # ------------------------------------------------------------------ events
    def on_launch(
        self,
        rid: Hashable,
        position: int,
        token: int,
        is_spec: bool,
        confidence: float = 1.0,
    ) -> int:
        """Record that a row was launched; returns the epoch to tag it with.

        The row must be the one :meth:`next_row` describes (same position, kind and token);
        anything else raises :class:`SPProtocolError`, because launching a row the state did
        not plan would silently corrupt the verification chain.
        """
        req = self._get(rid)
        if position != req.frontier:
            raise SPProtocolError(
                f"request {rid!r}: launch at position {position}, expected {req.frontier}"
            )
        if is_spec:
            if req.frontier < req.verified_len or req.pending is None:
                raise SPProtocolError(f"request {rid!r}: no draft to speculate on at {position}")
            if req.pending[0] != token:
                raise SPProtocolError(
                    f"request {rid!r}: speculative token {token} is not the pending draft "
                    f"{req.pending[0]}"
                )
            req.drafts.append((position, int(token), float(confidence)))
            self.stats.rows_spec += 1
        else:
            if req.frontier != req.verified_len - 1:
                raise SPProtocolError(
                    f"request {rid!r}: a normal row needs a verified input at {position}, "
                    f"but only {req.verified_len} tokens are verified"
                )
            if token != req.last_token:
                raise SPProtocolError(
                    f"request {rid!r}: normal row token {token} is not the verified token "
                    f"{req.last_token}"
                )
            self.stats.rows_normal += 1
        req.pending = None
        req.inflight.append((position, req.epoch))
        req.frontier = position + 1
        if position + 1 > req.high_water:
            req.high_water = position + 1
        return req.epoch

    def on_draft(
        self, rid: Hashable, position: int, epoch: int, token: int, confidence: float
    ) -> bool:
        """Record the draft that stage 0 made for ``position + 1`` from row ``(position, epoch)``.

        Returns ``False`` (and records nothing) when the draft is useless: the request is
        gone, the row is stale, it is not the request's newest row, or ``position + 1`` is
        already verified.
        """
        req = self._reqs.get(rid)
        if (
            req is None
            or epoch != req.epoch
            or position + 1 != req.frontier
            or req.frontier < req.verified_len
        ):
            return False
        req.pending = (int(token), float(confidence))
        return True

    def drop_draft(self, rid: Hashable, selective: bool = False) -> None:
        """Decline the pending draft: the request waits for verification instead.

        ``selective``: selective speculation declined it (``stats.drafts_dropped``); otherwise
        it could not be launched (length limit, KV memory: ``stats.drafts_withheld``).
        """
        req = self._get(rid)
        if req.pending is not None:
            req.pending = None
            if selective:
                self.stats.drafts_dropped += 1
            else:
                self.stats.drafts_withheld += 1

    def on_result(
        self,
        rid: Hashable,
        position: int,
        epoch: int,
        true_token: int,
        launched_draft: int | None = None,
    ) -> Outcome:
        """Process the true token for ``position + 1`` from row ``(position, epoch)``.

        Non-stale outcomes commit ``true_token`` (the caller emits it). ``REJECTED`` bumps
        the epoch; the next row is a normal row with ``true_token``.

        ``launched_draft`` is the draft the row ``(position, epoch)`` produced, when the
        caller knows it better than the state: later pipeline stages learn a draft's value
        only when it comes back with the true token, so they launch speculative rows with a
        placeholder and pass the real draft here.
        """
        req = self._reqs.get(rid)
        if req is None:
            rows = self._draining.get(rid)
            if rows is None:
                logger.debug("result for unknown request %r treated as stale", rid)
            else:
                self._pop_row(rid, rows, position, epoch)
                if not rows:
                    del self._draining[rid]
                    self._drained.append(rid)
            self.stats.rows_stale += 1
            return Outcome.STALE
        self._pop_row(rid, req.inflight, position, epoch)
        if epoch != req.epoch:
            self.stats.rows_stale += 1
            return Outcome.STALE
        if position != req.verified_len - 1:
            raise SPProtocolError(
                f"request {rid!r}: valid row at {position} returned but {req.verified_len} "
                "tokens are verified"
            )
        true_token = int(true_token)
        req.verified_len += 1
        req.last_token = true_token
        if req.drafts:
            d_pos, d_tok, _ = req.drafts.popleft()
            if launched_draft is not None:
                d_tok = int(launched_draft)
            if d_pos != position + 1:
                raise SPProtocolError(
                    f"request {rid!r}: oldest draft at {d_pos}, expected {position + 1}"
                )
            self.stats.tokens_committed += 1
            if d_tok == true_token:
                self.stats.accepted += 1
                return Outcome.ACCEPTED
            req.epoch += 1
            req.drafts.clear()
            req.pending = None
            req.frontier = req.verified_len - 1
            self.stats.rejected += 1
            return Outcome.REJECTED
        # No launched row depends on this token. A pending (unlaunched) draft for the same
        # position is obsolete now: the next row is a normal row with the true token.
        if req.frontier == position + 1:
            req.pending = None
        self.stats.tokens_committed += 1
        return Outcome.APPENDED

    @staticmethod
    def _pop_row(rid: Hashable, rows: deque[tuple[int, int]], position: int, epoch: int) -> None:
        if not rows:
            raise SPProtocolError(
                f"request {rid!r}: result for row ({position}, epoch {epoch}) with no row in flight"
            )
        head = rows[0]
        if head != (position, epoch):
            raise SPProtocolError(
                f"request {rid!r}: result for row ({position}, epoch {epoch}) but the oldest "
                f"in-flight row is ({head[0]}, epoch {head[1]}); results must return in "
                "launch order"
            )
        rows.popleft()

    # ------------------------------------------------------------------ bulk helpers
    def candidate_confidences(self, rids: Iterable[Hashable]) -> list[float]:
        """:meth:`candidate_confidence` for many requests."""
        return [self.candidate_confidence(r) for r in rids]
