"""Stage 0's drop ratio: a fixed ``--spexis-alpha`` or one chosen online (``auto``).

:class:`AlphaController` sits between the SP loop and :meth:`SlotState.select` on stage 0
(only stage 0 decides drops; the other ranks apply the dropped slots relayed in the plan, so
nothing new travels). It feeds :class:`~spexis_sglang.core.online_alpha.OnlineAlpha` (read its
module docstring for what is measured and how alpha is chosen) from three points of the loop:

* :meth:`select` (building a decode batch): the iteration's alpha (0 on explore iterations),
  and the confidence-rank bin of every candidate among *all* candidates, before drops (the
  selection key ``SlotState.candidate_confidence``);
* :meth:`on_launch` (the batch is launched): the bin of each launched speculative row goes
  into a small per-slot ring indexed by ``position % depth``, as ``SlotState`` keeps its
  drafts; the time since the previous decode launch is one latency sample;
* :meth:`on_result` (its true tokens are back): a valid row at ``p`` whose verdict is
  ACCEPTED or REJECTED verified the draft of the speculative row at ``p + 1``, launched in a
  later iteration and still in flight, so its ring entry is still the one written at its
  launch (a request has at most ``depth`` rows in flight, at consecutive positions).

Latency samples: stage 0 measures the wall time between two consecutive decode launches (a
prefill or an idle iteration between them discards the sample). In that time stage 0 ran its
part of the newest batch while the later stages ran the batches before it, all at once, so the
stage with the largest batch set the pace: the sample is set against the largest of the last
``depth`` decode batches (in a steady state, the rows of every batch; around an explore
iteration inside (0, 1), what paced the pipe). A sample whose pipe held batches of both regimes
is left out: a probe's (alpha 1's rows while at 0) beside others, or an explore iteration's
(alpha 0's rows while at 1) beside others. The later launch waited for the oldest batch's true
tokens, so such a sample is paced by the oldest batch, not the largest: on an emulated two-GPU
box (B = 512) a pipe of two probe batches and a full one took 10.7-11.3 ms, where full batches
alone took 20-22 and a fixed alpha 1's 256-row ones 12; set against the largest, such samples made
B rows look cheap in either regime (see ``OnlineAlpha``'s probes).

With a fixed alpha the controller only observes (no explore iterations): the live profile and
the alpha the chooser would pick appear in ``/server_info`` (``spexis_alpha``); run at alpha 0,
that is the offline choice for the current workload. Since nothing is decided from it, a fixed
alpha observes only every ``observe_every``-th iteration (``--spexis-alpha-observe``, default
:data:`~spexis_sglang.core.online_alpha.FIXED_ALPHA_OBSERVE_EVERY`; 1 observes every one):
ranking every candidate, crediting verdicts and fitting latency cost stage 0 ~0.1-0.2 ms per
iteration at B=256 on CPU, the largest part of what the controller costs. An observed
iteration's verdicts and latency sample count ``observe_every`` times
(:meth:`OnlineAlpha.record_verdicts`' and :meth:`~OnlineAlpha.record_iteration`'s ``weight``),
so the decayed counts keep their scale (the readiness thresholds and the prior weigh as before)
and the estimates stay unbiased; they are a sample, so they are noisier. The drops themselves
never depend on it: a fixed alpha drops the same rows either way.

``auto`` waits for the confidences only where a drop depends on them. While its alpha lies
strictly inside (0, 1) the drops are chosen by confidence, so every iteration reads them and
is observed (weight 1). At alpha 0 (every draft kept) and alpha 1 (every draft dropped: PP)
they decide nothing, so stage 0 builds the next batch without waiting for its own forward
(that wait, the draft_sync phase, cost 1.2-1.5x the forward's GPU time at small batches on the
GPU); it then observes only its explore iterations (alpha 0: every rank launched), each
counting for the iterations since the previous one (the explore period backs off at alpha 1,
see :mod:`~spexis_sglang.core.online_alpha`). Latency samples need no confidence: ``auto``
takes one at every launch, weight 1, marked where the iteration's drops waited for the
confidences (alpha inside (0, 1); its explore iterations drop nothing and do not wait), so the
chooser charges an interior alpha the wait it costs. At alpha 0 its probes run ``depth``
iterations at alpha 1 (stock PP micro-batches, the drafts held for the next batch) for the
latency fit only: not observed, no wait.

An observed iteration whose drops do not depend on the confidences (``auto``'s explore
iterations, a fixed alpha of 0 or 1 sampled by its observer) does not wait for them either:
where the drafts' copy has not landed when the batch is built, the SP loop hands the pending
copies over (:meth:`AlphaController.defer_confidences`) and the candidates are ranked once they
land: at a later build if the copy is done by then (:meth:`AlphaController.land_deferred`), at
the latest when a verdict needs the rank (:meth:`on_result`: the batch that verifies them came
back from the last stage, so the forward that made them has finished and the copy queued behind
it has landed, or all but), or after ``depth + 1`` more launches (the copy's pinned buffer is
reused after ``2 N + 2``). The launched rows carry a tag in the ring until then. The key's
other factor, the confidence of the drafts a candidate's row is built on, is taken at
selection, as with an immediate read. The confidences that land are written back into
``SlotState`` (:meth:`SlotState.backfill_confidences`), so the keys of the rows built on those
drafts are the ones an immediate read would have given them.
"""

from __future__ import annotations

import json
import time
from collections import deque
from dataclasses import dataclass
from typing import List, Optional, Protocol, Tuple

import numpy as np

from spexis_sglang.core.online_alpha import (
    AUTO_ALPHA_EXPLORE,
    AUTO_ALPHA_INITIAL,
    AUTO_ALPHA_INTERVAL,
    OnlineAlpha,
)
from spexis_sglang.core.slot_state import Rows, SlotState, Verdict
from spexis_sglang.core.sp_stats import SPStats

__all__ = ["AlphaController"]

_ACCEPTED, _REJECTED = int(Verdict.ACCEPTED), int(Verdict.REJECTED)
#: ring entries below this are a deferred ranking's tag (``-2 - its serial number``)
_NOT_OBSERVED = -1


class DraftCopy(Protocol):
    """One launched batch's drafts on their way to the host (``sp_records.PendingDrafts``):
    the rows they were made from, and their values once landed."""

    rows: Rows

    def ready(self) -> bool: ...

    def read(self) -> tuple: ...


@dataclass
class _DeferredRanking:
    """An observed iteration's candidates, ranked once their drafts' confidences land."""

    tag: int
    #: the candidates' slots and their selection key with placeholder own confidences
    slots: np.ndarray
    key: np.ndarray
    #: (copy, the slots its rows recorded a draft for, those rows' indices), oldest first
    sources: List[Tuple[DraftCopy, np.ndarray, np.ndarray]]
    #: the launch count when launched, and the ring entries it wrote (None: not launched)
    launch: int = -1
    launched: Optional[Tuple[np.ndarray, np.ndarray]] = None


class AlphaController:
    """Stage 0's alpha and the live measurements behind ``--spexis-alpha auto``.

    Args:
        capacity: request slots (``SlotState.capacity``).
        depth: rows a request may have in flight (``SlotState.depth``).
        num_stages: pipeline stages.
        alpha: the fixed drop ratio (ignored when ``auto``).
        auto: choose alpha online.
        interval, explore: see :class:`OnlineAlpha` (``explore`` applies with ``auto`` only).
        clock: seconds (``time.perf_counter``; tests pass their own).
        observe_every: with a fixed alpha, observe every this-many-th iteration only (its
            verdicts and latency sample weighted by it); ``auto`` observes its explore
            iterations at alpha 0 or 1 and every iteration inside (0, 1) (every iteration
            when ``explore`` <= 1).
    """

    def __init__(
        self,
        capacity: int,
        depth: int,
        num_stages: int,
        alpha: float = 0.0,
        auto: bool = False,
        interval: int = AUTO_ALPHA_INTERVAL,
        explore: int = AUTO_ALPHA_EXPLORE,
        clock=time.perf_counter,
        observe_every: int = 1,
    ) -> None:
        if observe_every < 1:
            raise ValueError(f"observe_every must be >= 1, got {observe_every}")
        self.auto = bool(auto)
        if self.auto:
            self.observe_every = int(explore) if explore > 1 else 1
        else:
            self.observe_every = int(observe_every)
        self._weight = float(self.observe_every)  # a fixed alpha's latency samples
        # this iteration's candidates were ranked (select); its launch is observed
        self._observed = True
        # decode launches so far, and the count at the latest observed one
        self._launches = 0
        self._observed_launch = 0
        self.fixed = float(alpha)
        self.online = OnlineAlpha(
            num_stages,
            interval=interval,
            explore=explore if self.auto else 0,
            initial=AUTO_ALPHA_INITIAL if self.auto else self.fixed,
            probe_length=int(depth) + 1,
        )
        self.depth = int(depth)
        self._clock = clock
        #: an open text file: one line per decode launch (SPEXIS_ALPHA_LOG), or None
        self.sample_log = None
        # rank bin of the launched speculative row at (slot, position % depth); -1: launched
        # on an iteration that was not observed (its verdict is not credited)
        self._ring = np.zeros((capacity, self.depth), dtype=np.int64)
        # how many drafts each observed one stands for (1, or the sampling period)
        self._ring_weight = np.ones((capacity, self.depth))
        self._iteration_weight = 1.0
        # this iteration's candidates' bins, by slot (read back at launch)
        self._candidate_bin = np.zeros(capacity, dtype=np.int64)
        # scratch, by slot, for a deferred ranking
        self._own_conf = np.ones(capacity)
        self._bin_by_slot = np.zeros(capacity, dtype=np.int64)
        self._pipe_rows: deque[int] = deque(maxlen=self.depth)
        # each batch ran the other regime's rows: a probe (alpha 1 while at 0) or an explore
        # iteration while at 1 (alpha 0's rows)
        self._pipe_other: deque[bool] = deque(maxlen=self.depth)
        self._last_launch: Optional[Tuple[int, float]] = None
        self.iteration_alpha = self.alpha
        #: the SP loop recorded the drafts' real confidences for this iteration's select
        #: (placeholders otherwise: nothing is ranked then, unless their copies were handed
        #: over by :meth:`defer_confidences`)
        self.confidences_real = True
        # copies handed over for the next select, and the rankings waiting for theirs
        self._sources: List[Tuple[DraftCopy, np.ndarray, np.ndarray]] = []
        self._deferred: deque[_DeferredRanking] = deque()
        self._launch_tag: Optional[int] = None  # this select's deferred ranking, to launch
        self._slots: Optional[SlotState] = None  # where landed confidences are backfilled
        self._waited = False
        self._serial = 0
        #: rankings made later, and those whose copy was read before it reported done
        self.deferred_rankings = 0
        self.deferred_forced = 0

    @property
    def alpha(self) -> float:
        """The drop ratio in force (explore iterations aside)."""
        return self.online.alpha if self.auto else self.fixed

    def select(
        self,
        slots: SlotState,
        rows: Rows,
        running: int,
        patchable: Optional[np.ndarray] = None,
        pipelined: bool = False,
        stages: int = 1,
    ) -> Tuple[Rows, np.ndarray, np.ndarray]:
        """``SlotState.select`` at this iteration's alpha, recording the candidates' ranks.
        Returns the kept rows, the slots whose drafts were dropped and those whose rows wait
        for a later batch (alpha 1 with ``patchable`` given: ``SlotState.select_pp``, at most
        a stock PP micro-batch of ``ceil(running / stages)`` rows)."""
        choices = self.online.choices
        a = self.online.next_iteration(running)
        if self.sample_log is not None and self.online.choices != choices:
            self.sample_log.write(json.dumps({"choice": self.online.last_decision}) + "\n")
        self.iteration_alpha = a if self.auto else self.fixed
        k = self.observe_every
        if k == 1 or (self.auto and self._drops_by_confidence()):
            observe, self._iteration_weight = True, 1.0
        elif self.auto:  # its explore iterations, each standing for those since the last
            observe = self.online.exploring
            self._iteration_weight = float(self.online.explore_gap)
        else:
            observe, self._iteration_weight = self.online.iteration % k == 0, float(k)
        sources, self._sources = self._sources, []
        self._launch_tag = None
        deferred = observe and not self.confidences_real and bool(sources)
        self._observed = observe and (self.confidences_real or deferred)
        # this iteration's drops waited for the confidences (its latency sample says so)
        self._waited = 0.0 < self.iteration_alpha < 1.0 and self.confidences_real
        spec = rows.is_spec
        if self._observed and spec.any():
            cs = rows.slot[spec]
            key = slots.candidate_confidence(cs)
            if deferred:
                self._serial += 1
                tag = _NOT_OBSERVED - self._serial
                self._deferred.append(_DeferredRanking(tag, cs, key, sources))
                self._candidate_bin[cs] = self._launch_tag = tag
            else:
                self._candidate_bin[cs] = self.online.rank_bins(key)
        if self.iteration_alpha >= 1.0 and patchable is not None:
            cap = -(-running // max(stages, 1))
            return slots.select_pp(rows, patchable, pipelined, cap)
        kept, dropped = slots.select(rows, self.iteration_alpha)
        return kept, dropped, np.empty(0, dtype=np.int64)

    def needs_confidences(self) -> bool:
        """The next :meth:`select` drops drafts by their confidences: the SP loop must wait
        for them to reach the host."""
        if not self.auto:
            return 0.0 < self.fixed < 1.0
        # a choice iteration (peek None) that moves alpha inside (0, 1) drops by placeholder
        # confidences once: any drop is lossless, so it is not worth a wait every interval.
        # An explore iteration inside (0, 1) drops nothing: it does not wait either, and its
        # latency sample is what the wait is measured against (OnlineAlpha.latency).
        a = self.online.peek_alpha()
        if a is None:
            a = self.online.alpha
        return 0.0 < a < 1.0

    def drafts_wanted(self) -> bool:
        """Whether the batch this iteration launches should make its drafts (after
        :meth:`select`). Not at alpha 1 with no observed, explore, probe or choice iteration
        within the next ``depth + 1``: every draft it makes is then either dropped or the
        input of a row the device redoes on the true token (``SlotState.select_pp``), and no
        verdict on it is credited, so stage 0 may skip the draft head's LM head. The
        iterations that follow one that may speculate or observe find drafts made by then (a
        request's latest is at most ``depth`` launches old, or held one iteration more)."""
        if self.iteration_alpha < 1.0 or self._observed:
            return True
        ahead = self.depth + 1
        if self.auto:
            return not self.online.settled_at_one(ahead)
        # a fixed alpha 1: its observed iterations credit verdicts
        return self.observe_every == 1 or self._until_observed() <= ahead

    def _drops_by_confidence(self) -> bool:
        return 0.0 < self.online.alpha < 1.0

    def wants_confidences(self) -> bool:
        """The next :meth:`select` observes but its drops do not depend on the confidences
        (``auto``'s explore iterations, a fixed alpha's sampled ones): the SP loop reads them
        if they have landed and says so (``confidences_real``), and otherwise hands their
        copies over (:meth:`defer_confidences`) rather than wait for the device."""
        return self._next_observed()

    def defer_confidences(self, copy: DraftCopy, slots: np.ndarray, rows: np.ndarray) -> None:
        """The next :meth:`select` ranks its candidates later: ``copy`` holds the drafts
        recorded (as placeholders) for ``slots``, at ``rows`` of the copy. Called for each
        batch applied before that select, oldest first (a later draft of a slot wins)."""
        self._sources.append((copy, np.asarray(slots, dtype=np.int64), np.asarray(rows)))

    def land_deferred(self, slots: SlotState) -> None:
        """Rank the deferred candidates whose copies have landed (or are more than ``depth``
        launches old) and write their confidences back into ``slots``: the SP loop calls this before
        it records new drafts, where an immediate read would have recorded these."""
        self._slots = slots
        self._resolve_deferred(force=False)

    def _resolve_deferred(self, force: bool) -> None:
        """Rank the deferred candidates whose copies have landed (all of them if ``force``),
        oldest first, and write the bins into the ring entries their launch tagged."""
        while self._deferred:
            d = self._deferred[0]
            if d.launched is None:  # selected, never launched (nothing fitted in memory)
                self._deferred.popleft()
                continue
            landed = all(c.ready() for c, _, _ in d.sources)  # a CUDA query each: once
            if not (force or landed or self._launches - d.launch > self.depth):
                return
            self._deferred.popleft()
            if not landed:
                self.deferred_forced += 1
            own = self._own_conf
            own[d.slots] = 1.0
            for copy, slots, rows in d.sources:
                conf = np.asarray(copy.read()[1])[rows]
                own[slots] = conf
                if self._slots is not None:  # later keys take them too (the chain's factor)
                    r = copy.rows
                    self._slots.backfill_confidences(slots, r.position[rows], r.epoch[rows], conf)
            bins = self._bin_by_slot
            bins[d.slots] = self.online.rank_bins(d.key * own[d.slots])
            s, col = d.launched
            mine = self._ring[s, col] == d.tag  # not rewritten by a later launch since
            self._ring[s[mine], col[mine]] = bins[s[mine]]
            self.deferred_rankings += 1

    def _next_observed(self) -> bool:
        if self.observe_every == 1:
            return True
        if self.auto:
            return self.online.next_explores()
        return self._until_observed() == 1

    def _until_observed(self) -> int:
        """A fixed alpha (``observe_every`` > 1): iterations from the current one to its next
        observed one (every ``observe_every``-th)."""
        return -self.online.iteration % self.observe_every

    def on_launch(self, rows: Rows, iteration: int) -> None:
        """A decode batch built at loop iteration ``iteration`` is launched."""
        observed = self._observed
        # every row is written (no mask): only a speculative row's entry is ever read (by the
        # result of the row before it), and a normal row launches when its request has no
        # launched draft in flight, so its column holds nothing that will be read
        s = rows.slot
        column = rows.position % self.depth
        self._ring[s, column] = self._candidate_bin[s] if observed else _NOT_OBSERVED
        if observed:
            self._ring_weight[s, column] = self._iteration_weight
            if self._launch_tag is not None:  # this select's ranking, deferred
                d = self._deferred[-1]
                tagged = self._candidate_bin[s] == d.tag
                d.launch, d.launched = self._launches + 1, (s[tagged], column[tagged])
                self._launch_tag = None
        now = self._clock()
        last = self._last_launch
        sampled = False
        other = self._pipe_other
        if last is None or last[0] != iteration - 1:
            self._pipe_rows.clear()  # a prefill or idle iteration in between
            other.clear()
        elif any(other) and not all(other):
            pass  # around a probe or an explore at 1: paced by both regimes' batches
        elif (observed or self.auto) and len(self._pipe_rows) == self.depth:
            weight = 1.0 if self.auto else self._weight
            self.online.record_iteration(
                max(self._pipe_rows), now - last[1], weight, waited=self._waited
            )
            sampled = True
        if self.sample_log is not None:
            self._log_launch(rows, iteration, now, last, sampled)
        self._pipe_rows.append(len(rows))
        online = self.online
        other.append(online.probing or (online.exploring and online.alpha >= 1.0))
        self._last_launch = (iteration, now)
        self._launches += 1
        if observed:
            self._observed_launch = self._launches

    def _log_launch(self, rows: Rows, iteration: int, now: float, last, sampled: bool) -> None:
        """One JSON line per decode launch (``SPEXIS_ALPHA_LOG``; what the latency fit saw)."""
        line = {
            "iteration": iteration,
            "rows": len(rows),
            "pipe_rows": list(self._pipe_rows),
            "seconds": None if last is None else round(now - last[1], 6),
            "alpha": self.iteration_alpha,
            "probe": bool(self.online.probing),
            "explore": bool(self.online.exploring),
            "sampled": sampled,
        }
        self.sample_log.write(json.dumps(line) + "\n")

    def on_result(self, rows: Rows, verdict: np.ndarray) -> None:
        """Verdicts of a returned batch: each ACCEPTED / REJECTED row verified the draft of
        the speculative row one position later."""
        if self._launches - self._observed_launch >= self.depth:
            # The drafts verified now were launched after this batch, within the last
            # depth - 1 launches (at most depth batches are in flight), none of them observed.
            return
        verified = (verdict == _ACCEPTED) | (verdict == _REJECTED)
        if not verified.any():
            return
        s = rows.slot[verified]
        column = (rows.position[verified] + 1) % self.depth
        bins = self._ring[s, column]
        if (bins < _NOT_OBSERVED).any():  # ranked later: their copies are done by now
            self._resolve_deferred(force=True)
            bins = self._ring[s, column]
        seen = bins >= 0  # drafts launched on observed iterations
        if not seen.all():
            s, column, bins = s[seen], column[seen], bins[seen]
        acc = verdict[verified][seen] == _ACCEPTED
        weight = self._ring_weight[s, column]
        if weight.size and (weight == weight[0]).all():
            weight = float(weight[0])
        self.online.record_verdicts(bins, acc, weight)

    def update_stats(self, stats: SPStats) -> None:
        """The alpha in force and the chooser's counters, for the log line and metrics."""
        stats.alpha = self.alpha
        stats.alpha_changes = self.online.changes
        stats.alpha_explore_iterations = self.online.explore_iterations
        stats.alpha_probe_iterations = self.online.probe_iterations

    def as_dict(self) -> dict:
        """The live state (``/server_info`` ``internal_states[0]["spexis_alpha"]``)."""
        d = self.online.as_dict()
        d["mode"] = "auto" if self.auto else "fixed"
        d["deferred_rankings"] = self.deferred_rankings
        d["deferred_forced"] = self.deferred_forced
        d["alpha"] = self.alpha
        if not self.auto:
            # what the chooser would pick from what it saw (meaningful at alpha 0, where every
            # rank is launched and verified)
            d["recommended_alpha"] = self.online.alpha
        return d
