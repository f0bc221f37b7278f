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
from typing import Sequence

import numpy as np

from .lookahead import LookaheadModel

logger = logging.getLogger(__name__)

__all__ = ["gain", "AdmissionDecision", "EvictionForecast", "AdmissionPlanner"]


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
    n = len(i_waits)
    n_rec = n if n_recompute is None else int(n_recompute)
    base = (running + 1) * period - finished_iters
    tok_aggr = base - float(sum(i_waits))
    t_aggr = period + (1 + n_rec) * (pdr - 1.0)
    wait = min(float(i_delay), float(period))
    tok_delay = base - wait
    t_delay = period + ((pdr - 1.0) if i_delay < period else 0.0)
    if tok_aggr <= 0:
        return float("inf")
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


@dataclass(frozen=True)
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
    #: behind a delayed request)
    reason: str = "fits"
    #: the eviction-free alternative: first iteration (from now) at which admission would
    #: evict nobody, None if there is none within the horizon; equals ``delay_iters``
    #: unless the request is admitted now despite expected evictions
    eviction_free_delay: int | None = 0
    forecast: EvictionForecast | None = field(default=None, compare=False, repr=False)


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

    # ------------------------------------------------------------------ helpers
    @staticmethod
    def default_victim_order(lengths: np.ndarray, bucket_rows: np.ndarray) -> np.ndarray:
        """Requests without a finish prediction first, then longer predicted remaining
        lengths; within a group larger KV footprints first (fewest evictions); then index.
        """
        idx = np.arange(lengths.size)
        return np.lexsort((idx, -lengths, -bucket_rows))

    def _delay_slot(self, slack: np.ndarray, prompt: float, d_min: int) -> int | None:
        """Earliest admission iteration d >= d_min (1 = now) that keeps the projection within
        capacity for the rest of the horizon, or None."""
        h = self._h
        if d_min > h:
            return None
        g = self.model.growth_matrix[d_min - 1 :]
        room = np.min(slack[None, :] - g, axis=1)
        ok = np.flatnonzero(room >= prompt)
        return int(ok[0]) + d_min if ok.size else None

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
        requests plus earlier admissions, without this request.
        """
        cap = self.capacity
        model = self.model
        others = base + prompt + self._new_growth
        traj: dict[int, np.ndarray] = {}
        clock: dict[int, int] = {}
        out: dict[int, int] = {}  # victim -> iteration evicted (currently out)
        queue: list[int] = []
        events: list[tuple[int, int]] = []
        waits: list[int] = []
        recomputes = 0
        unresolvable = False
        order = victim_order.tolist()
        for i in range(1, self._window + 1):
            demand = float(others[i])
            for v, tr in traj.items():
                demand -= tr[i]
                if v not in out:
                    demand += tr[clock[v] + 1]
            if demand > cap:
                for v in order:
                    if v in out:
                        continue
                    if v not in traj:
                        traj[v] = model.trajectory_of_row(lengths[v], int(bucket_rows[v]))
                        clock[v] = i - 1
                    need = traj[v][clock[v] + 1]
                    if need <= 0.0:
                        continue
                    out[v] = i
                    queue.append(v)
                    events.append((v, i))
                    demand -= need
                    if demand <= cap:
                        break
                else:
                    unresolvable = demand > cap
            still: list[int] = []
            for v in queue:
                need = traj[v][clock[v] + 1]
                if not still and out[v] < i and demand + need <= cap:
                    waits.append(i - out.pop(v))
                    recomputes += 1
                    demand += need
                else:
                    still.append(v)
            queue = still
            for v in traj:
                if v not in out:
                    clock[v] += 1
            if unresolvable:
                break
        for v in queue:
            waits.append(self._window + 1 - out[v])
        return EvictionForecast(tuple(events), tuple(waits), recomputes, unresolvable)

    # ------------------------------------------------------------------ decision
    def decide(
        self,
        lengths: Sequence[float] | np.ndarray,
        buckets: Sequence[int | None] | np.ndarray,
        waiting_tokens: Sequence[float] | np.ndarray,
        victim_order: Sequence[int] | np.ndarray | None = None,
    ) -> list[AdmissionDecision]:
        """Decide admission for each waiting request (in the given, FCFS order).

        Args:
            lengths: KV tokens held by each running request (verified + in-flight).
            buckets: predicted remaining-length bucket per running request (-1 / None: none).
            waiting_tokens: KV tokens each waiting request needs at admission (its prompt,
                minus any cached prefix).
            victim_order: running-request indices in the order the scheduler would retract
                them (SGLang's retraction order); default :meth:`default_victim_order`.

        Returns:
            One :class:`AdmissionDecision` per waiting request.
        """
        ln = np.asarray(lengths, dtype=float)
        rows = self.model.bucket_index(buckets)
        wt = np.asarray(waiting_tokens, dtype=float)
        if wt.ndim != 1 or (wt.size and (wt.min() < 0 or not np.all(np.isfinite(wt)))):
            raise ValueError("waiting_tokens must be a 1-D array of finite values >= 0")
        decisions: list[AdmissionDecision] = []
        if wt.size == 0:
            return decisions
        full = self.model.project_full(ln, buckets)
        cap = self.capacity
        eg = self._new_growth
        # 1. FCFS prefix that fits now with no eviction, all at once.
        cum = np.cumsum(wt)
        need = full[None, 1:] + cum[:, None] + np.arange(1, wt.size + 1)[:, None] * eg[None, 1:]
        fits = np.max(need, axis=1) <= cap
        j_star = int(np.argmin(fits)) if not fits.all() else wt.size
        for j in range(j_star):
            decisions.append(AdmissionDecision(j, True, 0))
        if j_star == wt.size:
            return decisions
        reserved = full + (cum[j_star - 1] if j_star else 0.0) + j_star * eg
        fin = None
        order = None
        d_min = 1
        delayed = False
        for j in range(j_star, wt.size):
            prompt = float(wt[j])
            slack = cap - reserved[1:]
            d = self._delay_slot(slack, prompt, d_min)
            free = None if d is None else d - 1
            if d == 1:
                decisions.append(AdmissionDecision(j, True, 0))
                reserved = reserved + prompt + eg
                continue
            if delayed and self.fcfs:
                # Queued behind a delayed request: its slot, no trade-off of its own.
                decisions.append(
                    AdmissionDecision(j, False, free, reason="fcfs", eviction_free_delay=free)
                )
                if d is None:
                    decisions.extend(self._beyond_horizon(j + 1, wt.size))
                    break
                reserved = self._reserve(reserved, prompt, d)
                d_min = d
                continue
            # 2. Trade-off: admit now with evictions (aggr) vs at d (delay).
            if order is None:
                order = (
                    self.default_victim_order(ln, rows)
                    if victim_order is None
                    else np.asarray(victim_order, dtype=np.int64)
                )
                fin = self.model.expected_finished(buckets)
            fc = self.forecast_aggr(reserved, prompt, ln, rows, order)
            g = (
                float("inf")
                if fc.unresolvable
                else gain(
                    self.period,
                    ln.size,
                    self.pdr,
                    free if free is not None else self._h,
                    fc.waits,
                    n_recompute=fc.recomputes,
                    finished_iters=self._finished_iters(fin),
                )
            )
            admit = g <= 1.0
            decisions.append(
                AdmissionDecision(
                    index=j,
                    admit_now=admit,
                    delay_iters=0 if admit else free,
                    gain=g,
                    evictions=len(fc.waits),
                    reason="gain",
                    eviction_free_delay=free,
                    forecast=fc,
                )
            )
            if admit:
                reserved = reserved + prompt + eg
                continue
            delayed = True
            if d is None:
                decisions.extend(self._beyond_horizon(j + 1, wt.size))
                break
            reserved = self._reserve(reserved, prompt, d)
            d_min = d if self.fcfs else 1
        logger.debug(
            "admission: %d waiting, %d admitted now",
            wt.size,
            sum(d.admit_now for d in decisions),
        )
        return decisions

    @staticmethod
    def _beyond_horizon(first: int, stop: int) -> list[AdmissionDecision]:
        return [
            AdmissionDecision(k, False, None, reason="fcfs", eviction_free_delay=None)
            for k in range(first, stop)
        ]

    def _reserve(self, reserved: np.ndarray, prompt: float, d: int) -> np.ndarray:
        out = reserved.copy()
        out[d:] += prompt + self.model.expected_generated[1 : self._h - d + 2]
        return out

    def _finished_iters(self, fin: np.ndarray) -> float:
        """sum_{i=0}^{I-1} E[#finished by i] (finished requests decode in neither policy)."""
        i_n = self.period
        h = self._h
        if i_n <= h + 1:
            return float(fin[:i_n].sum())
        return float(fin.sum() + (i_n - h - 1) * fin[h])
