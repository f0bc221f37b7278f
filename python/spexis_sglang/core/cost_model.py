"""Cost model of speculative parallelism (paper §4, §5.1, Eq. 1-4, Table 1, appendix A).

Vocabulary (paper §4). ``B`` is the number of sequences the KV cache holds (the TP batch);
``N`` the number of pipeline stages; ``Theta`` the probability that a draft is accepted.
Under SP every resident request has at most one row in every iteration: a *normal* row
(verified input), an *accepted* speculative row, or a *rejected* (stale) speculative row.
Only normal and accepted rows yield a token, so the *effective batch* is
``B_eff(t) = s^a_t + n_t``.

Two families of results live here:

* the paper's closed forms, exactly as printed: Eq. 2 (``b_eff_star``), Eq. 3
  (``b_alpha_star``), Eq. 4 (``b_eff_alpha_star``) and the Table 1 throughputs; plus the
  recurrences they are limits of (``simulate_eq1``, ``simulate_eq3``);
* an exact steady state of selective speculation (``sp_alpha_exact``), derived as a renewal
  process from the same per-request mechanics that ``simulation.simulate_sp`` plays out row
  by row. It exists because Eq. 3-4 rest on the simplification "dropping affects only
  speculative execution" (§5.1); see ``sp_alpha_exact`` for the size of that error.

Throughputs are ``tokens / second`` with latency tables in seconds per iteration, where an
iteration is one launch of a batch into stage 0 (for PP and SP: one stage time; for TP: one
forward pass). Latencies come from profiled points (``LatencyTable``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np

__all__ = [
    "b_eff_star",
    "eq1_invariant",
    "eq1_limit",
    "Eq1Trace",
    "simulate_eq1",
    "b_alpha_star",
    "simulate_eq3",
    "b_eff_alpha_star",
    "SPAlphaSteadyState",
    "sp_alpha_exact",
    "sp_alpha_paper",
    "lookahead_theta",
    "LatencyTable",
    "throughput_tp",
    "throughput_pp",
    "throughput_sp",
    "throughput_sp_alpha",
]


def _check_stages(num_stages: int) -> int:
    if isinstance(num_stages, bool) or int(num_stages) != num_stages or num_stages < 1:
        raise ValueError(f"num_stages must be an integer >= 1, got {num_stages!r}")
    return int(num_stages)


def _check_prob(name: str, value: float) -> float:
    value = float(value)
    if not 0.0 <= value <= 1.0 or math.isnan(value):
        raise ValueError(f"{name} must lie in [0, 1], got {value!r}")
    return value


def _check_alpha(alpha: float) -> float:
    """A drop ratio in [0, 1]; 1 drops every draft, so SP runs like PP (a request advances a
    token every N iterations, B/N rows per iteration)."""
    alpha = float(alpha)
    if not 0.0 <= alpha <= 1.0 or math.isnan(alpha):
        raise ValueError(f"alpha (drop ratio) must lie in [0, 1], got {alpha!r}")
    return alpha


# --------------------------------------------------------------------------------------
# Eq. 1 and Eq. 2: plain speculative parallelism
# --------------------------------------------------------------------------------------


def b_eff_star(batch: float, num_stages: int, theta: float) -> float:
    """Steady-state effective batch of SP, Eq. 2: ``B / (N - Theta (N - 1))``.

    It is the limit of the Eq. 1 recurrence started from ``n_0 = B`` (appendix A.1). For
    ``Theta = 0`` the recurrence has no limit (it cycles with period ``N``); the value
    ``B / N`` is then its time average, which is what a throughput estimate needs.
    """
    n = _check_stages(num_stages)
    theta = _check_prob("theta", theta)
    return float(batch) / (n - theta * (n - 1))


@dataclass(frozen=True)
class Eq1Trace:
    """Trajectory of the Eq. 1 recurrence for ``t = 1 .. steps``.

    ``s_a``, ``s_r`` and ``n`` are the accepted-speculative, rejected-speculative and
    normal row counts at each iteration; ``b_eff = s_a + n``. ``s_a + s_r + n`` is constant
    (the batch, appendix A.1) when the start state is consistent.
    """

    s_a: np.ndarray
    s_r: np.ndarray
    n: np.ndarray

    @property
    def b_eff(self) -> np.ndarray:
        return self.s_a + self.n

    @property
    def total(self) -> np.ndarray:
        return self.s_a + self.s_r + self.n


def _theta_at(theta: float | Sequence[float], steps: int, lag: int) -> np.ndarray:
    """Theta_t for t = 1-lag .. steps-1 (Eq. 1 reads Theta at t-1 .. t-N)."""
    arr = np.asarray(theta, dtype=float)
    if arr.ndim == 0:
        _check_prob("theta", float(arr))
        return np.full(steps + lag, float(arr))
    if arr.shape != (steps + lag,):
        raise ValueError(
            f"a time-varying theta needs steps + num_stages = {steps + lag} values "
            f"(Theta_t for t = {1 - lag} .. {steps - 1}), got shape {arr.shape}"
        )
    if np.any((arr < 0) | (arr > 1)) or np.any(np.isnan(arr)):
        raise ValueError("every Theta_t must lie in [0, 1]")
    return arr


def simulate_eq1(
    num_stages: int,
    theta: float | Sequence[float],
    steps: int,
    batch: float | None = None,
    start: Sequence[float] | None = None,
) -> Eq1Trace:
    """Run the Eq. 1 recurrence for ``steps`` iterations.

    Eq. 1 says that an effective row (accepted or normal) at ``t-1`` is followed by an
    accepted speculative row at ``t`` with probability ``Theta_{t-1}``; otherwise its draft
    is wrong, the next ``N-1`` rows of that request are rejected speculation, and a normal
    row follows ``N`` iterations later. With ``e_t = s^a_t + n_t`` this is
    ``e_t = Theta_{t-1} e_{t-1} + (1 - Theta_{t-N}) e_{t-N}``.

    Args:
        num_stages: ``N`` (>= 1).
        theta: scalar ``Theta`` or a sequence of ``steps + N`` values ``Theta_t`` for
            ``t = 1-N .. steps-1``.
        steps: number of iterations to produce (``t = 1 .. steps``).
        batch: ``B``; with the default start state this is ``n_0``.
        start: the effective counts ``e_t`` for ``t = 1-N .. 0`` (oldest first). Defaults
            to the paper's initial condition (appendix A.1): ``n_0 = B``, zero before.

    Returns:
        An :class:`Eq1Trace`.
    """
    n_st = _check_stages(num_stages)
    steps = int(steps)
    if steps < 0:
        raise ValueError("steps must be >= 0")
    if start is None:
        if batch is None:
            raise ValueError("give batch (B) or an explicit start state")
        hist = [0.0] * (n_st - 1) + [float(batch)]
    else:
        hist = [float(x) for x in start]
        if len(hist) != n_st:
            raise ValueError(f"start must hold N = {n_st} values, got {len(hist)}")
    th = _theta_at(theta, steps, n_st).tolist()
    # th[j] is Theta at t = j + 1 - N; e history e[j] is e at t = j + 1 - N.
    e = hist
    s_a = np.empty(steps)
    s_r = np.empty(steps)
    n_arr = np.empty(steps)
    for t in range(1, steps + 1):
        j = t + n_st - 1  # index of time t in e / th
        sa = e[j - 1] * th[j - 1]
        nn = e[j - n_st] * (1.0 - th[j - n_st])
        sr = 0.0
        for i in range(1, n_st):
            sr += e[j - i] * (1.0 - th[j - i])
        s_a[t - 1] = sa
        s_r[t - 1] = sr
        n_arr[t - 1] = nn
        e.append(sa + nn)
    return Eq1Trace(s_a=s_a, s_r=s_r, n=n_arr)


def eq1_invariant(num_stages: int, theta: float, start: Sequence[float]) -> float:
    """The conserved batch of Eq. 1 for a start state: ``e_0 + (1-Theta) sum_{i=1}^{N-1} e_{-i}``.

    Appendix A.1 uses ``s^a_t + s^r_t + n_t = B``; in terms of the effective counts this is
    the quantity above, which the recurrence preserves for any start state.
    """
    n_st = _check_stages(num_stages)
    theta = _check_prob("theta", theta)
    hist = [float(x) for x in start]
    if len(hist) != n_st:
        raise ValueError(f"start must hold N = {n_st} values, got {len(hist)}")
    return hist[-1] + (1.0 - theta) * sum(hist[:-1])


def eq1_limit(num_stages: int, theta: float, start: Sequence[float]) -> float:
    """Limit of Eq. 1 from an arbitrary start state (Eq. 2 with ``B`` = the invariant).

    For ``0 < Theta < 1`` the recurrence converges (the lags 1 and N are coprime); for
    ``Theta = 1`` it is constant; for ``Theta = 0`` it cycles and this is the period mean.
    """
    return b_eff_star(eq1_invariant(num_stages, theta, start), num_stages, theta)


# --------------------------------------------------------------------------------------
# Eq. 3 and Eq. 4: selective speculation
# --------------------------------------------------------------------------------------


def b_alpha_star(batch: float, num_stages: int, alpha: float) -> float:
    """Steady-state rows per iteration under selective speculation, Eq. 3:
    ``B / (1 + alpha (N-1))``.

    Eq. 3 models a drop as a request that sits out ``N - 1`` iterations (it waits for
    verification) and returns with a normal row: ``B_{t+1} = alpha B_{t+1-N} + (1-alpha) B_t``
    (limit derived in appendix A.2).
    """
    n = _check_stages(num_stages)
    alpha = _check_alpha(alpha)
    return float(batch) / (1.0 + alpha * (n - 1))


def simulate_eq3(num_stages: int, alpha: float, batch: float, steps: int) -> np.ndarray:
    """The Eq. 3 recurrence ``B_{t+1} = alpha B_{t+1-N} + (1-alpha) B_t`` for ``t = 0 .. steps-1``.

    Initial condition as in appendix A.2: ``B_i = B (1-alpha)^i`` for ``0 <= i <= N-1``.
    Returns ``B_0 .. B_{steps}`` (``steps + 1`` values; ``steps >= N - 1``).
    """
    n = _check_stages(num_stages)
    alpha = _check_alpha(alpha)
    steps = int(steps)
    if steps < n - 1:
        raise ValueError(f"steps must be >= N-1 = {n - 1}")
    b = [float(batch) * (1.0 - alpha) ** i for i in range(n)]
    for t in range(n - 1, steps):
        b.append(alpha * b[t + 1 - n] + (1.0 - alpha) * b[t])
    return np.asarray(b[: steps + 1])


def b_eff_alpha_star(batch: float, num_stages: int, theta_alpha: float, alpha: float) -> float:
    """Effective batch of selective speculation, Eq. 4 (as printed in the paper).

    ``B*_eff,alpha = alpha B*_alpha + (1 - alpha) B*_alpha / (N - Theta_alpha (N - 1))``:
    the ``alpha`` share of rows returning from a drop are normal (all effective); the rest
    behave like SP with acceptance ``Theta_alpha``. This rests on the paper's simplifying
    assumption that drops affect only speculative execution; :func:`sp_alpha_exact` gives
    the exact steady state of the mechanics and quantifies the error.
    """
    n = _check_stages(num_stages)
    theta_alpha = _check_prob("theta_alpha", theta_alpha)
    rows = b_alpha_star(batch, n, alpha)
    return alpha * rows + (1.0 - alpha) * rows / (n - theta_alpha * (n - 1))


@dataclass(frozen=True)
class SPAlphaSteadyState:
    """Steady state of SP with drop ratio ``alpha``: rows launched and effective rows per
    iteration."""

    rows: float
    effective: float


def sp_alpha_paper(
    batch: float, num_stages: int, theta_alpha: float, alpha: float
) -> SPAlphaSteadyState:
    """Eq. 3 rows and Eq. 4 effective batch as a pair (the paper's SP_alpha model)."""
    return SPAlphaSteadyState(
        rows=b_alpha_star(batch, num_stages, alpha),
        effective=b_eff_alpha_star(batch, num_stages, theta_alpha, alpha),
    )


def sp_alpha_exact(
    batch: float, num_stages: int, theta_alpha: float, alpha: float
) -> SPAlphaSteadyState:
    """Exact steady state of selective speculation for the per-request mechanics.

    Mechanics (those of ``docs/design.md`` §2 and of :func:`simulation.simulate_sp`): each of
    ``B`` requests has at most one row per iteration. After an effective row, the request's
    new draft is dropped with probability ``alpha`` (the request then waits for verification
    and returns ``N`` iterations later with a normal row), otherwise it is launched and is
    right with probability ``Theta_alpha`` (an effective row at the next iteration) or wrong
    (the next ``N - 1`` rows are stale and a normal row follows ``N`` iterations later).
    Drafts of stale rows may be dropped too; a dropped stale request simply idles until the
    rejection is detected, which is when it would have resumed anyway.

    Between two effective rows of a request there is therefore 1 iteration with probability
    ``p = (1 - alpha) Theta_alpha`` and ``N`` iterations otherwise, so per request::

        effective per iteration = 1 / (N - (1 - alpha) Theta_alpha (N - 1))
        rows per iteration      = (1 + (1-alpha)(1-Theta_alpha) S)
                                  / (N - (1-alpha) Theta_alpha (N-1))
        S = sum_{j=0}^{N-2} (1 - alpha)^j   (expected stale rows after a wrong draft)

    Both reduce to Eq. 2 at ``alpha = 0`` and agree with Eq. 3-4 at ``Theta_alpha`` in
    {0, 1}. In between, Eq. 3 *underestimates* the rows, because it lets every drop cost
    ``N - 1`` idle iterations, also when the dropped draft belongs to an already-doomed
    (stale) chain, whose request would resume at the rejection anyway; and Eq. 4
    *underestimates* the effective batch, because it applies plain-SP efficiency
    ``1 / (N - Theta (N-1))`` to the kept share as if drops and rejections did not
    interact. Per request, a drop after an effective row costs the same time as a rejection
    (``N`` iterations for the token) but wastes no row, which gives the token rate above.
    Relative error of Eq. 4's effective batch against this formula (and against the Monte-
    Carlo simulation, see tests/core/test_sp_simulation.py):

    ==  ============  ======  ===================  =================
    N   Theta_alpha   alpha   Eq. 4 / exact (eff)  Eq. 3 / exact rows
    ==  ============  ======  ===================  =================
    2   0.70          0.20    0.9785 (-2.2 %)      0.9677
    2   0.80          0.15    0.9852 (-1.5 %)      0.9810
    4   0.70          0.20    0.9005 (-10.0 %)     0.9145
    4   0.60          0.30    0.8915 (-10.9 %)     0.8939
    8   0.70          0.20    0.7787 (-22.1 %)     0.8725
    ==  ============  ======  ===================  =================

    The throughput that picks alpha is ``effective / T(rows)``; both terms move, and on the
    example 8-GPU profile (``benchmark/profiles/example_8gpu.json``) the exact model picks a
    different alpha and predicts more: PP2xTP4 alpha 0.20 -> 0.25 (+0.4 % tok/s), PP4xTP2
    0.25 -> 0.35 (+8.4 %), PP8xTP1 0.40 -> 0.38 (+22 %). ``--alpha-model exact`` of the
    planner uses it.
    """
    n = _check_stages(num_stages)
    theta_alpha = _check_prob("theta_alpha", theta_alpha)
    alpha = _check_alpha(alpha)
    p_fast = (1.0 - alpha) * theta_alpha
    cycle = n - p_fast * (n - 1)
    stale = sum((1.0 - alpha) ** j for j in range(n - 1))
    rows_per_req = (1.0 + (1.0 - alpha) * (1.0 - theta_alpha) * stale) / cycle
    return SPAlphaSteadyState(rows=float(batch) * rows_per_req, effective=float(batch) / cycle)


def lookahead_theta(theta_alpha: float, alpha: float = 0.0) -> float:
    """Per-token probability of the 1-iteration path for the lookahead model (Algorithm 1).

    In the renewal view of :func:`sp_alpha_exact` a token costs 1 iteration with probability
    ``(1 - alpha) Theta_alpha`` and ``N`` iterations otherwise, which is exactly Algorithm
    1's binomial model with ``theta = (1 - alpha) Theta_alpha``. Pass this to
    :class:`lookahead.LookaheadModel` when selective speculation is on.
    """
    return (1.0 - _check_alpha(alpha)) * _check_prob("theta_alpha", theta_alpha)


# --------------------------------------------------------------------------------------
# Latency functions and Table 1
# --------------------------------------------------------------------------------------


class LatencyTable:
    """A latency function ``T(batch)`` given as profiled ``(batch, seconds)`` points.

    Between points: linear interpolation. Below the first point: the first latency (decode
    latency does not fall below its small-batch, weight-bound floor). Above the last point:
    linear extrapolation along the last segment (decode cost grows about linearly once
    compute-bound); :meth:`extrapolates` tells the planner to flag such estimates.

    Batches must be strictly increasing and positive, latencies positive and non-decreasing.
    """

    __slots__ = ("batches", "seconds", "name")

    def __init__(self, points: Iterable[Sequence[float]], name: str = "latency") -> None:
        pts = [tuple(p) for p in points]
        if not pts:
            raise ValueError(f"{name}: the latency table is empty")
        for i, p in enumerate(pts):
            if len(p) != 2:
                raise ValueError(f"{name}[{i}]: expected [batch, seconds], got {list(p)!r}")
        b = np.asarray([float(p[0]) for p in pts])
        s = np.asarray([float(p[1]) for p in pts])
        if np.any(~np.isfinite(b)) or np.any(b <= 0):
            raise ValueError(f"{name}: batch sizes must be finite and > 0")
        if np.any(~np.isfinite(s)) or np.any(s <= 0):
            raise ValueError(f"{name}: latencies must be finite and > 0 seconds")
        if np.any(np.diff(b) <= 0):
            i = int(np.flatnonzero(np.diff(b) <= 0)[0]) + 1
            raise ValueError(
                f"{name}[{i}]: batch {b[i]:g} is not greater than the previous batch "
                f"{b[i - 1]:g} (batches must be strictly increasing)"
            )
        if np.any(np.diff(s) < 0):
            i = int(np.flatnonzero(np.diff(s) < 0)[0]) + 1
            raise ValueError(
                f"{name}[{i}]: latency {s[i]:g} s at batch {b[i]:g} is below "
                f"{s[i - 1]:g} s at batch {b[i - 1]:g} (latency must not decrease with batch)"
            )
        self.batches = b
        self.seconds = s
        self.name = name

    def __call__(self, batch: float | np.ndarray) -> float | np.ndarray:
        x = np.asarray(batch, dtype=float)
        out = np.interp(x, self.batches, self.seconds)
        if self.batches.size >= 2:
            slope = (self.seconds[-1] - self.seconds[-2]) / (self.batches[-1] - self.batches[-2])
            hi = x > self.batches[-1]
            out = np.where(hi, self.seconds[-1] + slope * (x - self.batches[-1]), out)
        return float(out) if out.ndim == 0 else out

    def extrapolates(self, batch: float) -> bool:
        """True when ``batch`` lies above the largest profiled batch."""
        return float(batch) > float(self.batches[-1]) * (1.0 + 1e-12)

    def __repr__(self) -> str:
        return f"LatencyTable({self.name}, {self.batches.size} points)"


def throughput_tp(batch: float, latency: LatencyTable) -> float:
    """Table 1, TP: ``B / T_tp(B)`` tokens per second."""
    return float(batch) / latency(batch)


def throughput_pp(batch: float, num_stages: int, latency: LatencyTable) -> float:
    """Table 1, PP with ``N`` micro-batches of ``B/N``: ``(B/N) / T_pp(B/N)``."""
    mb = float(batch) / _check_stages(num_stages)
    return mb / latency(mb)


def throughput_sp(batch: float, num_stages: int, theta: float, latency: LatencyTable) -> float:
    """Table 1, SP: ``B*_eff / T_sp(B)`` with ``B*_eff`` from Eq. 2."""
    return b_eff_star(batch, num_stages, theta) / latency(batch)


def throughput_sp_alpha(
    batch: float,
    num_stages: int,
    theta_alpha: float,
    alpha: float,
    latency: LatencyTable,
    model: str = "paper",
) -> float:
    """Table 1, SP_alpha: ``B*_eff,alpha / T_sp(B*_alpha)``.

    ``model="paper"`` uses Eq. 3-4; ``model="exact"`` uses :func:`sp_alpha_exact`.
    """
    ss = _sp_alpha_state(batch, num_stages, theta_alpha, alpha, model)
    return ss.effective / latency(ss.rows)


def _sp_alpha_state(
    batch: float, num_stages: int, theta_alpha: float, alpha: float, model: str
) -> SPAlphaSteadyState:
    if model == "paper":
        return sp_alpha_paper(batch, num_stages, theta_alpha, alpha)
    if model == "exact":
        return sp_alpha_exact(batch, num_stages, theta_alpha, alpha)
    raise ValueError(f"model must be 'paper' or 'exact', got {model!r}")
