"""Length-aware admission: admit now (aggr) or at the first eviction-free iteration (delay).

Paper §5.2 and appendix A.3. Over a period of ``I`` iterations (the gap between two
arrivals), with ``bs`` running requests, decode latency ``t_d`` and prefill (or recompute)
latency ``t_p = pdr * t_d``:

* **aggr** admits the new request now; the look-ahead projection says it will cause ``n``
  evictions, the ``k``-th victim waiting ``i_wait^k`` iterations before its recompute;
* **delay** admits it ``i_delay`` iterations later, at the first iteration from which the
  projection stays within capacity.

In units of ``t_d`` (appendix A.3)::

    Tok_aggr  = (bs+1) I - sum_k i_wait^k         T_aggr  = I + (n+1)(pdr-1)
    Tok_delay = (bs+1) I - i_delay                T_delay = I + (pdr-1)
    G = (Tok_delay / T_delay) / (Tok_aggr / T_aggr)

which is the paper's closed form
``G = [I + (n+1)(pdr-1)] / [I + pdr - 1] * [bs+1 - i_delay/I] / [bs+1 - sum_k i_wait^k / I]``.
``G > 1`` means delaying is faster. :func:`gain` computes it, with two optional refinements
that default to the paper: ``finished_iters`` subtracts from both token counts the
iterations in which requests that finish during the period no longer decode (the paper
assumes ``bs`` constant), and ``n_recompute`` counts only recomputes that fall within the
period (a victim still waiting at the end of the period is charged its wait, not a prefill).

:class:`AdmissionPlanner` turns the look-ahead projection (:mod:`lookahead`) into these
inputs and decides, for each waiting request in FCFS order, "admit now" or "delay by ``k``
iterations". Its eviction forecast plays the projection forward the way a scheduler would:
before each iteration, if the expected demand exceeds capacity, running requests are
evicted in ``victim_order`` until it fits; evicted requests keep their progress and are
recomputed, first evicted first, at the first later iteration where they fit again.
:func:`simulation.simulate_admission` plays both policies out request by request; with a
deterministic world (``theta = 1``, exact predictions) the two agree exactly (tests).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence

import numpy as np

from .lookahead import LookaheadModel

logger = logging.getLogger(__name__)

__all__ = [
    "gain",
    "AdmissionDecision",
    "AdmissionPlan",
    "EvictionForecast",
    "AdmissionPlanner",
    "reservation_admit_count",
]


def gain(
    period: float,
    running: int,
    pdr: float,
    i_delay: float,
    i_waits: Sequence[float],
    n_recompute: int | None = None,
    finished_iters: float = 0.0,
) -> float:
    """Throughput ratio ``G = Thr_delay / Thr_aggr`` (§5.2, appendix A.3).

    Args:
        period: ``I``, iterations between two arrivals (> 0).
        running: ``bs``, running decode requests before the arrival.
        pdr: ``t_p / t_d``, prefill-to-decode (= recompute-to-decode) latency ratio.
        i_delay: iterations the new request waits under *delay*; at ``>= period`` it is
            not prefilled within the period (its wait is capped at ``period``).
        i_waits: ``i_wait^k`` per eviction under *aggr* (``n = len(i_waits)``).
        n_recompute: recomputes within the period (default ``n``, the paper).
        finished_iters: iterations, summed over requests that finish during the period,
            after their finish (they decode in neither policy). Default 0, the paper.
    """
    if period <= 0:
        raise ValueError(f"period must be > 0, got {period}")
    if pdr <= 0:
        raise ValueError(f"pdr must be > 0, got {pdr}")
    if running < 0 or i_delay < 0 or any(w < 0 for w in i_waits):
        raise ValueError("running, i_delay and i_waits must be >= 0")
    if sum(i_waits) > running * period:
        raise ValueError(
            f"sum(i_waits) = {sum(i_waits)} exceeds running * period = {running * period}: "
            "evicted requests are running requests, each out at most the whole period"
        )
    n = len(i_waits)
    n_rec = n if n_recompute is None else int(n_recompute)
    base = (running + 1) * period - finished_iters
    tok_aggr = base - float(sum(i_waits))
    t_aggr = period + (1 + n_rec) * (pdr - 1.0)
    wait = min(float(i_delay), float(period))
    tok_delay = base - wait
    t_delay = period + ((pdr - 1.0) if i_delay < period else 0.0)
    if tok_aggr <= 0.0:
        # Degenerate (possible only with finished_iters overlapping the waits): aggr
        # decodes nothing in the period, so delaying cannot be worse.
        return float("inf") if tok_delay > 0.0 else 1.0
    return (tok_delay / t_delay) / (tok_aggr / t_aggr)


@dataclass(frozen=True)
class EvictionForecast:
    """Expected evictions if a request is admitted now (within the analysed window)."""

    #: (running-request index, iteration of eviction), in order of eviction
    evictions: tuple[tuple[int, int], ...]
    #: i_wait per eviction (truncated at the end of the window)
    waits: tuple[int, ...]
    #: recomputes within the window
    recomputes: int
    #: True if even evicting every running request cannot make room
    unresolvable: bool = False


@dataclass(slots=True)
class AdmissionDecision:
    """Decision for one waiting request (``index`` into the waiting list)."""

    index: int
    admit_now: bool
    #: when to admit: 0 = now; k > 0 = k iterations from now; None = not within the
    #: horizon (re-evaluate later)
    delay_iters: int | None
    #: ``G`` when the aggr-vs-delay trade-off was evaluated, else None
    gain: float | None = None
    #: expected evictions if admitted now (0 when it fits)
    evictions: int = 0
    #: "fits" (no eviction expected) | "gain" (trade-off decided by G) | "fcfs" (queued
    #: behind a delayed request, or beyond the horizon)
    reason: str = "fits"
    #: the eviction-free alternative: first iteration (from now) at which admission would
    #: evict nobody, None if there is none within the horizon; equals ``delay_iters``
    #: unless the request is admitted now despite expected evictions
    eviction_free_delay: int | None = 0
    forecast: EvictionForecast | None = field(default=None, compare=False, repr=False)


_FITS, _GAIN, _FCFS = 0, 1, 2
_REASONS = ("fits", "gain", "fcfs")


class AdmissionPlan:
    """Admission decisions for a queue, as arrays (index = position in the queue).

    ``admit_now`` is what the scheduler acts on; with FCFS the admitted requests always form
    a prefix of the queue, so ``num_admit_now`` requests are admitted from the head.
    Indexing or iterating gives :class:`AdmissionDecision` objects.

    Everything that decides this iteration (``admit_now``, ``gain``, ``evictions``,
    ``reason_code``, ``forecasts``) is computed by :meth:`AdmissionPlanner.decide`. The
    future slots of requests queued behind a delayed one (``delay_iters`` and
    ``eviction_free_delay`` where ``reason == "fcfs"``) are computed exactly, but only on
    first access, so a scheduler that reads only ``admit_now`` does not pay for them.
    """

    __slots__ = (
        "admit_now",
        "gain",
        "evictions",
        "reason_code",
        "forecasts",
        "_delay",
        "_free",
        "_pending",
    )

    def __init__(self, n: int) -> None:
        #: admit this request now
        self.admit_now = np.zeros(n, dtype=bool)
        #: G where the aggr-vs-delay trade-off was evaluated, NaN elsewhere
        self.gain = np.full(n, np.nan)
        #: expected evictions if admitted now (where evaluated)
        self.evictions = np.zeros(n, dtype=np.int64)
        #: 0 = fits, 1 = gain, 2 = fcfs (see ``AdmissionDecision.reason``)
        self.reason_code = np.full(n, _FCFS, dtype=np.int8)
        #: eviction forecasts by queue index, where evaluated
        self.forecasts: dict[int, EvictionForecast] = {}
        self._delay = np.full(n, -1, dtype=np.int64)
        self._free = np.full(n, -1, dtype=np.int64)
        self._pending: Callable[[], None] | None = None

    @property
    def delay_iters(self) -> np.ndarray:
        """When to admit: 0 = now, k = in k iterations, -1 = not within the horizon."""
        self._settle()
        return self._delay

    @property
    def eviction_free_delay(self) -> np.ndarray:
        """First iteration (from now) at which admission evicts nobody; -1 = none in horizon."""
        self._settle()
        return self._free

    def _settle(self) -> None:
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending()

    def _fits(self, start: int, stop: int) -> None:
        self.admit_now[start:stop] = True
        self._delay[start:stop] = 0
        self._free[start:stop] = 0
        self.reason_code[start:stop] = _FITS

    def _gain(self, j: int, admit: bool, free: int | None, g: float, fc: EvictionForecast) -> None:
        self.admit_now[j] = admit
        self._delay[j] = 0 if admit else (-1 if free is None else free)
        self._free[j] = -1 if free is None else free
        self.gain[j] = g
        self.evictions[j] = len(fc.evictions)
        self.reason_code[j] = _GAIN
        self.forecasts[j] = fc

    @property
    def num_admit_now(self) -> int:
        return int(np.count_nonzero(self.admit_now))

    def __len__(self) -> int:
        return int(self.admit_now.size)

    def __getitem__(self, k: int) -> AdmissionDecision:
        n = len(self)
        if not -n <= k < n:
            raise IndexError(k)
        k %= n
        d = int(self.delay_iters[k])
        f = int(self.eviction_free_delay[k])
        g = float(self.gain[k])
        return AdmissionDecision(
            index=k,
            admit_now=bool(self.admit_now[k]),
            delay_iters=None if d < 0 else d,
            gain=None if np.isnan(g) else g,
            evictions=int(self.evictions[k]),
            reason=_REASONS[int(self.reason_code[k])],
            eviction_free_delay=None if f < 0 else f,
            forecast=self.forecasts.get(k),
        )

    def __iter__(self) -> Iterator[AdmissionDecision]:
        return (self[k] for k in range(len(self)))

    def __repr__(self) -> str:
        return f"AdmissionPlan({len(self)} waiting, {self.num_admit_now} admitted now)"


class AdmissionPlanner:
    """Admission by the look-ahead projection and the gain ``G`` (§5.2).

    Args:
        model: the :class:`lookahead.LookaheadModel` (pipeline depth, theta, predictor).
        capacity: KV capacity in tokens available to running requests.
        pdr: prefill-to-decode latency ratio ``t_p / t_d``.
        period: ``I`` in iterations (expected iterations between arrivals); default: the
            model's horizon.
        fcfs: keep arrival order — a request is never admitted before an earlier one.
    """

    def __init__(
        self,
        model: LookaheadModel,
        capacity: float,
        pdr: float,
        period: int | None = None,
        fcfs: bool = True,
    ) -> None:
        if capacity <= 0:
            raise ValueError(f"capacity must be > 0 tokens, got {capacity}")
        if pdr <= 0:
            raise ValueError(f"pdr must be > 0, got {pdr}")
        self.model = model
        self.capacity = float(capacity)
        self.pdr = float(pdr)
        self.period = int(period) if period is not None else model.horizon
        if self.period < 1:
            raise ValueError(f"period must be >= 1 iteration, got {period}")
        self.fcfs = fcfs
        h = model.horizon
        eg = model.expected_generated
        self._new_growth = eg.copy()  # new request admitted now: P + E[G_i] after iteration i
        self._new_growth[0] = 0.0
        self._window = min(self.period, h)
        self._h = h
        self._eg1 = float(eg[1])
        self._growth = model.growth_matrix
        self._count_cache = np.arange(1, 129, dtype=float)[:, None]

    # ------------------------------------------------------------------ helpers
    @staticmethod
    def default_victim_order(lengths: np.ndarray, bucket_rows: np.ndarray) -> np.ndarray:
        """Requests without a finish prediction first, then longer predicted remaining
        lengths; within a group larger KV footprints first (fewest evictions); then index.
        """
        # one stable sort on a composite key: bucket row (descending), then length
        # (descending); ties keep index order
        key = bucket_rows * (2.0 * (lengths.max(initial=0.0) + 1.0)) + lengths
        return np.argsort(-key, kind="stable")

    def _delay_slot(self, slack: np.ndarray, prompt: float, d_min: int) -> int | None:
        """Earliest admission iteration d >= d_min (1 = now) such that a request holding
        ``prompt + E[G_{i-d+1}]`` tokens at iterations ``i = d .. H`` fits in ``slack[i-1]``
        (the capacity left by everything else), or None.

        Candidates are checked eight at a time, O(8 H) each. If the first eight fail, the
        search jumps ahead: a request admitted at d holds at least ``prompt + E[G_1]`` from
        d on, so d cannot precede the first iteration from which the suffix minimum of the
        slack allows that.
        """
        h = self._h
        growth = self._growth
        d0 = d_min
        jumped = False
        while d0 <= h:
            d1 = min(h, d0 + 7)
            room = (slack[None, :] - growth[d0 - 1 : d1]).min(axis=1)
            ok = (room >= prompt).nonzero()[0]
            if ok.size:
                return d0 + int(ok[0])
            d0 = d1 + 1
            if not jumped and d0 <= h:
                jumped = True
                suffix_min = np.minimum.accumulate(slack[::-1])[::-1]
                cand = (suffix_min[d0 - 1 :] >= prompt + self._eg1).nonzero()[0]
                if cand.size == 0:
                    return None
                d0 += int(cand[0])
        return None

    def forecast_aggr(
        self,
        base: np.ndarray,
        prompt: float,
        lengths: np.ndarray,
        bucket_rows: np.ndarray,
        victim_order: np.ndarray,
    ) -> EvictionForecast:
        """Play the expected trajectory forward with the request admitted now.

        ``base`` is the expected demand (H+1 values, index = iterations from now) of running
        requests plus earlier admissions, without this request. Iteration ``i`` runs as a
        scheduler would: if the demand exceeds capacity, evict running requests in
        ``victim_order`` until it fits; then recompute evicted requests, first evicted
        first, while they fit. Requests keep their progress while evicted.

        The forecast jumps from event to event (an overflow or a possible recompute) with
        vector operations over the remaining iterations, so its cost grows with the number
        of evictions rather than with the horizon.
        """
        cap = self.capacity
        w = self._window
        model = self.model
        others = base + prompt + self._new_growth
        adj = np.zeros_like(others)  # change to `others` from evicted / shifted victims
        order = victim_order
        nxt = 0  # victims order[:nxt] have been touched
        traj: dict[int, np.ndarray] = {}
        pos: dict[int, int] = {}  # touched victim -> position in victim_order
        lag: dict[int, int] = {}  # running touched victim -> iterations spent out so far
        out_at: dict[int, int] = {}  # evicted victim -> iteration of eviction
        out_clock: dict[int, int] = {}  # evicted victim -> iterations it had run
        finished: set[int] = set()
        queue: list[int] = []
        events: list[tuple[int, int]] = []
        waits: list[int] = []
        recomputes = 0
        unresolvable = False
        i = 1
        while i <= w:
            demand_v = others[i : w + 1] + adj[i : w + 1]
            over = (demand_v > cap).nonzero()[0]
            j = i + int(over[0]) if over.size else w + 1
            if queue:
                head = queue[0]
                need = traj[head][out_clock[head] + 1]
                start = max(i, out_at[head] + 1)
                if start < j:
                    ok = (demand_v[start - i : j - i] + need <= cap).nonzero()[0]
                    if ok.size:
                        j = start + int(ok[0])
            if j > w:
                break
            i = j
            demand = float(others[i] + adj[i])
            while demand > cap:  # evict in victim order
                running = [v for v in lag if v not in out_at]
                if running:
                    v = min(running, key=pos.__getitem__)
                elif nxt < order.size:
                    v = int(order[nxt])
                    nxt += 1
                    traj[v] = model.trajectory_of_row(lengths[v], int(bucket_rows[v]))
                    pos[v] = nxt - 1
                    lag[v] = 0
                else:
                    unresolvable = True
                    break
                need = traj[v][i - lag[v]]
                if need <= 0.0:  # finished: can never free anything again
                    finished.add(v)
                    del lag[v]
                    continue
                adj[i:] -= traj[v][i - lag[v] : traj[v].size - lag[v]]
                out_at[v] = i
                out_clock[v] = i - 1 - lag[v]
                queue.append(v)
                events.append((v, i))
                demand -= need
            if unresolvable:
                break
            while queue:  # recompute, first evicted first
                v = queue[0]
                need = traj[v][out_clock[v] + 1]
                if out_at[v] >= i or demand + need > cap:
                    break
                queue.pop(0)
                waits.append(i - out_at.pop(v))
                recomputes += 1
                demand += need
                lag[v] = i - (out_clock.pop(v) + 1)
                adj[i:] += traj[v][i - lag[v] : traj[v].size - lag[v]]
            i += 1
        for v in queue:
            waits.append(w + 1 - out_at[v])
        return EvictionForecast(tuple(events), tuple(waits), recomputes, unresolvable)

    # ------------------------------------------------------------------ decision
    def decide(
        self,
        lengths: Sequence[float] | np.ndarray,
        buckets: Sequence[int | None] | np.ndarray,
        waiting_tokens: Sequence[float] | np.ndarray,
        victim_order: Sequence[int] | np.ndarray | None = None,
    ) -> AdmissionPlan:
        """Decide admission for each waiting request (in the given, FCFS order).

        1. The longest prefix of the queue that fits with no expected eviction is admitted
           now (``reason="fits"``), all at once.
        2. For the next request the eviction forecast of admitting it now (aggr) and its
           first eviction-free iteration (delay) give ``G``; ``G <= 1`` admits it now and
           step 2 repeats for the next one, ``G > 1`` delays it (``reason="gain"``).
        3. Behind a delayed request (FCFS) every request gets its own first eviction-free
           iteration, no earlier than its predecessor's, with the earlier ones' expected
           memory reserved (``reason="fcfs"``); requests that share a slot are placed
           together. With ``fcfs=False`` each later request goes through step 2 instead.

        Args:
            lengths: KV tokens held by each running request (verified + in-flight).
            buckets: predicted remaining-length bucket per running request (-1 / None: none).
            waiting_tokens: KV tokens each waiting request needs at admission (its prompt,
                minus any cached prefix).
            victim_order: running-request indices in the order the scheduler would retract
                them (SGLang's retraction order); default :meth:`default_victim_order`.

        Returns:
            An :class:`AdmissionPlan` (arrays over the queue; iterate or index it for
            per-request :class:`AdmissionDecision` objects).
        """
        model = self.model
        ln = np.asarray(lengths, dtype=float)
        rows = model.bucket_index(buckets)
        wt = np.asarray(waiting_tokens, dtype=float)
        if wt.ndim != 1 or (wt.size and (wt.min() < 0 or not np.isfinite(wt.sum()))):
            raise ValueError("waiting_tokens must be a 1-D array of finite values >= 0")
        n_wait = wt.size
        plan = AdmissionPlan(n_wait)
        if n_wait == 0:
            return plan
        full = model.project_rows(ln, rows)
        cap = self.capacity
        eg = self._new_growth
        # 1. FCFS prefix that fits now with no eviction, all at once.
        cum = np.cumsum(wt)
        need = full[None, 1:] + cum[:, None] + self._counts(n_wait) * eg[None, 1:]
        fits = need.max(axis=1) <= cap
        j = n_wait if fits.all() else int(fits.argmin())
        plan._fits(0, j)
        if j == n_wait:
            return plan
        slack = cap - (full + (cum[j - 1] if j else 0.0) + j * eg)  # index: iterations
        # 2. Aggr vs delay, by the gain G.
        order = (
            self.default_victim_order(ln, rows)
            if victim_order is None
            else np.asarray(victim_order, dtype=np.int64)
        )
        fin_iters = self._finished_iters(model.expected_finished_rows(rows))
        j, slack, d_min = self._tradeoff(plan, j, slack, wt, ln, rows, order, fin_iters)
        if j >= n_wait:
            return plan
        # 3. FCFS queue behind a delayed request: exact future slots, computed on first
        # access of plan.delay_iters / eviction_free_delay (nothing here decides now).
        plan._pending = lambda: self._plan_queue(plan, j, slack, d_min, wt, cum)
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("admission: %d waiting, %d admitted now", n_wait, plan.num_admit_now)
        return plan

    def _plan_queue(
        self,
        plan: AdmissionPlan,
        j: int,
        slack: np.ndarray,
        d_min: int,
        wt: np.ndarray,
        cum: np.ndarray,
    ) -> None:
        """Step 3 of :meth:`decide`: for each request from ``j`` on, its first eviction-free
        slot no earlier than its predecessor's, with the predecessors' memory reserved. The
        head's slot comes from :meth:`_delay_slot`; every following request that fits there
        as well takes the same slot. Cost O(distinct slots), at most the horizon."""
        n_wait = wt.size
        h = self._h
        csum_all = np.concatenate(([0.0], cum))
        block = min(16, n_wait - j)
        grow = self._counts(block) * self.model.expected_generated[None, 1:]  # c * E[G_k]
        while j < n_wait:
            d = self._delay_slot(slack[1:], float(wt[j]), d_min)
            if d is None:
                break  # the rest stays "not within the horizon"
            lag = h - d + 1
            k_n = min(block, n_wait - j)
            # excess[c-1, :]: requests j .. j+c-1 admitted together at d, iterations d..H
            excess = (csum_all[j + 1 : j + k_n + 1] - csum_all[j])[:, None] + grow[:k_n, :lag]
            bad = ((excess - slack[None, d:]).max(axis=1) > 0.0).nonzero()[0]
            m = int(bad[0]) if bad.size else k_n  # bad[0] >= 1: request j alone fits at d
            plan._delay[j : j + m] = d - 1
            plan._free[j : j + m] = d - 1
            slack[d:] -= excess[m - 1]
            d_min = d
            j += m

    def _tradeoff(
        self,
        plan: AdmissionPlan,
        j: int,
        slack: np.ndarray,
        wt: np.ndarray,
        ln: np.ndarray,
        rows: np.ndarray,
        order: np.ndarray,
        fin_iters: float,
    ) -> tuple[int, np.ndarray, int]:
        """Step 2 of :meth:`decide` from request ``j``; returns (next j, slack, d_min)."""
        eg = self._new_growth
        cap = self.capacity
        n_wait = wt.size
        while j < n_wait:
            prompt = float(wt[j])
            d = self._delay_slot(slack[1:], prompt, 1)
            if d == 1:
                plan._fits(j, j + 1)
                slack = slack - prompt - eg
                j += 1
                continue
            fc = self.forecast_aggr(cap - slack, prompt, ln, rows, order)
            free = self._h if d is None else d - 1
            g = (
                float("inf")
                if fc.unresolvable
                else gain(
                    self.period,
                    ln.size,
                    self.pdr,
                    free,
                    fc.waits,
                    n_recompute=fc.recomputes,
                    finished_iters=fin_iters,
                )
            )
            admit = g <= 1.0
            plan._gain(j, admit, None if d is None else d - 1, g, fc)
            j += 1
            if admit:
                slack = slack - prompt - eg
                continue
            if d is None:
                if self.fcfs:
                    return n_wait, slack, self._h + 1
                continue  # nothing to reserve; later requests are judged on their own
            slack = slack.copy()
            slack[d:] -= prompt + self.model.expected_generated[1 : self._h - d + 2]
            if self.fcfs:
                return j, slack, d
        return j, slack, 1

    def _counts(self, n: int) -> np.ndarray:
        """Column vector 1 .. n (cached)."""
        if self._count_cache.shape[0] < n:
            self._count_cache = np.arange(1, 2 * n + 1, dtype=float)[:, None]
        return self._count_cache[:n]

    def _finished_iters(self, fin: np.ndarray) -> float:
        """sum_{i=0}^{I-1} E[#finished by i] (finished requests decode in neither policy)."""
        i_n = self.period
        h = self._h
        if i_n <= h + 1:
            return float(fin[:i_n].sum())
        return float(fin.sum() + (i_n - h - 1) * fin[h])


def reservation_admit_count(
    free: float,
    held: Sequence[float] | np.ndarray,
    grow: Sequence[float] | np.ndarray,
    finish: Sequence[float] | np.ndarray,
    prompts: Sequence[float] | np.ndarray,
    grow_new: Sequence[float] | np.ndarray,
) -> int:
    """How many waiting requests (a prefix of the queue) fit over time, not just now.

    SGLang's admission reserves, at every step, each running request's future tokens and a
    new request's whole ``max_new_tokens``, as if nothing ever finished: memory that a
    request about to finish will free stays idle. This check plays the KV demand forward
    instead. Time ``t`` counts steps in which every request grows by at most one token (up
    to its cap); running request ``j`` releases everything it holds no later than step
    ``finish[j]`` (``inf``: not counted on). Relative to now, the demand at step ``t`` with
    the first ``n`` waiting requests admitted is::

        D_n(t) = sum_{j: finish_j > t} min(t, grow_j) - sum_{j: finish_j <= t} held_j
                 + sum_{c < n} (prompts_c + min(t, grow_new_c))

    and ``n`` is the largest count with ``D_n(t) <= free`` for every ``t >= 0``. Between two
    releases ``D_n`` never decreases, so its peak is at an iteration just before a release
    or at the end. With no release counted on (every ``finish`` infinite) this is SGLang's
    own check, ``sum grow + sum (prompt + grow_new) <= free``; a release can only lower the
    peak, so the count is never below that.

    Args:
        free: KV tokens free now (available plus evictable).
        held: tokens each running request holds now.
        grow: tokens each running request may still take (its reservation).
        finish: step (>= 1) by which each running request has released its memory.
        prompts: tokens each waiting request takes at admission (its prefill, plus a page).
        grow_new: tokens each waiting request may take after admission.
    """
    pr = np.asarray(prompts, dtype=float)
    gn = np.asarray(grow_new, dtype=float)
    if pr.shape != gn.shape or pr.ndim != 1:
        raise ValueError("prompts and grow_new must be 1-D arrays of one length")
    if pr.size == 0:
        return 0
    hl = np.asarray(held, dtype=float)
    gr = np.asarray(grow, dtype=float)
    fin = np.asarray(finish, dtype=float)
    if not (hl.shape == gr.shape == fin.shape):
        raise ValueError("held, grow and finish must have one length")
    if (fin < 1).any():
        raise ValueError("finish must be >= 1 iteration")
    # peak candidates: the iteration before each release, and the end (after every release)
    ends = np.unique(fin[np.isfinite(fin)] - 1.0)
    t = np.concatenate((ends, [np.inf]))
    running = (fin[None, :] > t[:, None]) | np.isinf(fin)[None, :]  # (T, B)
    base = np.where(running, np.minimum(t[:, None], gr[None, :]), -hl[None, :]).sum(axis=1)
    new = pr[:, None] + np.minimum(t[None, :], gn[:, None])  # (W, T)
    demand = base[None, :] + np.cumsum(new, axis=0)
    ok = (demand <= free).all(axis=1)
    return int(pr.size if ok.all() else ok.argmin())
