"""Look-ahead KV memory estimate (paper §5.2, Algorithm 1) as an exact expectation.

Stochastic model (Algorithm 1 lines 6-9, appendix A.1's rate model)
--------------------------------------------------------------------
Per running request, independently:

* **Tokens.** Each token the request generates costs 1 iteration with probability
  ``theta`` (its speculation is accepted) and ``N`` iterations otherwise (a rejection:
  the ``N - 1`` speculative rows behind the wrong draft are wasted and the corrected token
  comes ``N`` iterations after the last good one). Token costs are i.i.d. A token counts as
  generated at the end of its last iteration, so ``G_i``, the number of tokens generated
  by iteration ``i``, satisfies ``G_i >= k  <=>  k + (N-1) W_k <= i`` with
  ``W_k ~ Binomial(k, 1 - theta)`` the number of rejections among the first ``k`` tokens.
  With selective speculation pass ``theta = (1 - alpha) Theta_alpha``
  (:func:`cost_model.lookahead_theta`): a dropped draft also costs ``N`` iterations.
* **Finishing.** A request predicted in bucket ``k`` ("remaining length below
  ``thresholds[k]``") is right with probability ``precision[k]`` (the predictor's measured
  precision, paper Table 4). We take its remaining length to be ``tau_k = thresholds[k]``
  tokens — the largest value consistent with a correct prediction under either reading
  (``remaining < tau`` or ``remaining <= tau``), so the estimate never frees memory early.
  A correctly predicted request finishes at the first iteration with ``G_i >= tau_k`` and
  frees all its memory. A wrongly predicted request and one without a prediction do not
  finish within the horizon (their remaining length exceeds 64 >= horizon).
* **Memory.** An unfinished request holds ``length + G_i`` tokens, where ``length`` is its
  current KV footprint (verified tokens plus in-flight positions,
  ``sp_state.SPState.kv_len``).

Expectation (``formula="exact"``, the default). For a request with length ``l`` in bucket
``k`` (precision ``p``, ``tau``)::

    E[mem_i] = l (1 - p P(G_i >= tau)) + p E[G_i 1{G_i < tau}] + (1 - p) E[G_i]

    E[G_i] = sum_{k>=1} P(G_i >= k),
    E[G_i 1{G_i < tau}] = sum_{k=1}^{tau-1} P(G_i >= k) - (tau - 1) P(G_i >= tau).

Algorithm 1 as printed (``formula="paper"``) differs in two places, both kept available for
comparison:

1. its ``p_{i,w} = C(k, t) theta^t (1-theta)^w`` with ``t = i - N w`` only counts token
   sequences whose last token ends exactly at iteration ``i``; sequences with a rejection
   still in progress at ``i`` are missing, so ``sum_w p_{i,w} < 1`` and ``E[L_gen]`` is too
   small (e.g. ``N = 2, theta = 0.7, i = 64``: 38.0 instead of 49.2 tokens, because the
   missing mass is the ~23 % chance that iteration ``i`` falls inside a rejection);
2. it charges unfinished requests the *unconditional* ``E[L_gen]``
   (``(|B| - E[N_fin]) E[L_gen]``) although a request that has not finished has, on
   average, generated fewer tokens.

Cost. Everything that depends only on ``(N, theta, thresholds, precision, horizon)`` is
computed once and cached (:func:`_tables`); a projection is two ``bincount`` passes over the
running requests and a ``(K+1) x H`` product: O(B + K H).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

__all__ = [
    "DEFAULT_THRESHOLDS",
    "NO_BUCKET",
    "LookaheadModel",
    "expected_kv_tokens",
    "generated_tokens_survival",
]

#: Remaining-length thresholds of the predictor (paper §5.2): remaining < 4, 8, 16, 32, 64.
DEFAULT_THRESHOLDS: tuple[int, ...] = (4, 8, 16, 32, 64)
#: Bucket index meaning "no prediction" (remaining length not below any threshold).
NO_BUCKET = -1


@functools.lru_cache(maxsize=64)
def generated_tokens_survival(num_stages: int, theta: float, horizon: int) -> np.ndarray:
    """``S[i, k] = P(G_i >= k)`` for ``i = 0 .. horizon`` and ``k = 0 .. horizon + 1``.

    Exact under the model of the module docstring (read-only, cached).
    """
    n, h = int(num_stages), int(horizon)
    q = 1.0 - float(theta)
    surv = np.zeros((h + 1, h + 2))
    surv[:, 0] = 1.0
    if n == 1:
        for i in range(h + 1):
            surv[i, 1 : i + 1] = 1.0
    else:
        # pmf[k, w] = P(Binomial(k, q) = w), built row by row; cdf[k, w] = P(... <= w)
        pmf = np.zeros((h + 1, h + 1))
        pmf[0, 0] = 1.0
        for k in range(1, h + 1):
            pmf[k, : k + 1] = pmf[k - 1, : k + 1] * (1.0 - q)
            pmf[k, 1 : k + 1] += pmf[k - 1, :k] * q
        cdf = np.minimum(np.cumsum(pmf, axis=1), 1.0)
        # P(G_i >= k) = P(W_k <= floor((i - k) / (N - 1))) for 1 <= k <= i
        i_idx, k_idx = np.meshgrid(np.arange(h + 1), np.arange(h + 1), indexing="ij")
        valid = (k_idx >= 1) & (k_idx <= i_idx)
        w_idx = np.minimum(np.maximum(i_idx - k_idx, 0) // (n - 1), k_idx)
        surv[:, : h + 1] = np.where(valid, cdf[k_idx, w_idx], 0.0)
        surv[:, 0] = 1.0
    surv.setflags(write=False)
    return surv


def _paper_terms(num_stages: int, theta: float, horizon: int, taus: np.ndarray):
    """Algorithm 1 as printed: E[L_gen](i) and sum_w 1[k >= tau] p_{i,w} per tau."""
    n, h = int(num_stages), int(horizon)
    eg = np.zeros(h + 1)
    reach = np.zeros((taus.size, h + 1))
    for i in range(1, h + 1):
        for w in range(i // n + 1):
            t = i - n * w
            k = t + w
            p = math.comb(k, t) * theta**t * (1.0 - theta) ** w
            eg[i] += k * p
            reach[:, i] += np.where(k >= taus, p, 0.0)
    return eg, reach


@dataclass(frozen=True)
class _Tables:
    eg: np.ndarray  # (H+1,) expected generated tokens E[G_i]
    pfin: np.ndarray  # (K+1, H+1) probability of having finished by i, per bucket
    ret: np.ndarray  # (K+1, H+1) expected generated tokens still held, per bucket
    growth: np.ndarray  # (H, H) growth[d-1, i-1] = E[G_{i-d+1}] for i >= d, -inf before


@functools.lru_cache(maxsize=64)
def _tables(
    num_stages: int,
    theta: float,
    horizon: int,
    thresholds: tuple[int, ...],
    precision: tuple[float, ...],
    formula: str,
) -> _Tables:
    h = horizon
    k_n = len(thresholds)
    prec = np.asarray(precision, dtype=float)
    taus = np.asarray(thresholds, dtype=np.int64)
    pfin = np.zeros((k_n + 1, h + 1))
    ret = np.zeros((k_n + 1, h + 1))
    if formula == "exact":
        surv = generated_tokens_survival(num_stages, theta, horizon)
        cs = np.cumsum(surv[:, 1:], axis=1)  # cs[i, m-1] = sum_{k=1}^{m} S[i, k]
        eg = cs[:, h - 1].copy() if h >= 1 else np.zeros(h + 1)
        for b in range(k_n):
            tau = int(taus[b])
            s_tau = surv[:, min(tau, h + 1)]
            below = (cs[:, min(tau - 2, h)] if tau >= 2 else 0.0) - (tau - 1) * s_tau
            pfin[b] = prec[b] * s_tau
            ret[b] = prec[b] * below + (1.0 - prec[b]) * eg
    elif formula == "paper":
        eg, reach = _paper_terms(num_stages, theta, horizon, taus)
        for b in range(k_n):
            pfin[b] = prec[b] * reach[b]
            ret[b] = (1.0 - pfin[b]) * eg
    else:
        raise ValueError(f"formula must be 'exact' or 'paper', got {formula!r}")
    ret[k_n] = eg
    d = np.arange(1, h + 1)[:, None]
    i = np.arange(1, h + 1)[None, :]
    lag = i - d + 1
    growth = np.where(lag >= 1, eg[np.clip(lag, 0, h)], -np.inf)
    for arr in (eg, pfin, ret, growth):
        arr.setflags(write=False)
    return _Tables(eg=eg, pfin=pfin, ret=ret, growth=growth)


class LookaheadModel:
    """Expected KV tokens of the running requests over the next ``horizon`` iterations.

    Args:
        num_stages: pipeline depth ``N`` (1 = no speculation in flight).
        theta: probability that a token costs one iteration (see module docstring).
        precision: predictor precision per bucket, same length as ``thresholds``.
        thresholds: bucket thresholds in tokens (default 4, 8, 16, 32, 64).
        horizon: iterations to look ahead (default 64, as in the paper).
        formula: ``"exact"`` (default) or ``"paper"`` (Algorithm 1 as printed).
    """

    def __init__(
        self,
        num_stages: int,
        theta: float,
        precision: Sequence[float],
        thresholds: Sequence[int] = DEFAULT_THRESHOLDS,
        horizon: int = 64,
        formula: str = "exact",
    ) -> None:
        if isinstance(num_stages, bool) or int(num_stages) != num_stages or num_stages < 1:
            raise ValueError(f"num_stages must be an integer >= 1, got {num_stages!r}")
        theta = float(theta)
        if not 0.0 <= theta <= 1.0:
            raise ValueError(f"theta must lie in [0, 1], got {theta!r}")
        thr = tuple(int(t) for t in thresholds)
        if not thr or any(t < 1 for t in thr) or any(b <= a for a, b in zip(thr, thr[1:])):
            raise ValueError(f"thresholds must be positive and strictly increasing, got {thr}")
        prec = tuple(float(p) for p in precision)
        if len(prec) != len(thr):
            raise ValueError(
                f"precision has {len(prec)} entries but there are {len(thr)} thresholds"
            )
        if any(not 0.0 <= p <= 1.0 for p in prec):
            raise ValueError(f"precision values must lie in [0, 1], got {prec}")
        if int(horizon) != horizon or horizon < 1:
            raise ValueError(f"horizon must be an integer >= 1, got {horizon!r}")
        self.num_stages = int(num_stages)
        self.theta = theta
        self.thresholds = thr
        self.precision = prec
        self.horizon = int(horizon)
        self.formula = formula
        self._t = _tables(self.num_stages, theta, self.horizon, thr, prec, formula)
        self._none = len(thr)

    # ------------------------------------------------------------------ tables
    @property
    def expected_generated(self) -> np.ndarray:
        """``E[G_i]`` for ``i = 0 .. horizon`` (growth of a request that never finishes)."""
        return self._t.eg

    @property
    def growth_matrix(self) -> np.ndarray:
        """``growth[d-1, i-1] = E[G_{i-d+1}]`` for a request admitted at iteration ``d``."""
        return self._t.growth

    def bucket_index(self, buckets: Sequence[int | None] | np.ndarray) -> np.ndarray:
        """Map buckets (``-1`` / ``None`` = no prediction) to table rows ``0 .. K``."""
        arr = np.asarray(buckets)
        if arr.dtype == object:
            arr = np.asarray([NO_BUCKET if b is None else b for b in arr.tolist()])
        if arr.size == 0:
            return np.zeros(0, dtype=np.int64)
        if arr.dtype.kind not in "iu":
            if not np.all(np.equal(np.mod(arr, 1), 0)):
                raise ValueError("buckets must be integers (-1 or None for no prediction)")
            arr = arr.astype(np.int64)
        lo, hi = int(arr.min()), int(arr.max())
        if lo < -1 or hi >= self._none:
            raise ValueError(
                f"bucket indices must lie in [-1, {self._none - 1}], got range [{lo}, {hi}]"
            )
        # -1 (no prediction) maps to the last row, K
        return np.mod(arr, self._none + 1, dtype=np.int64)

    # ------------------------------------------------------------------ projections
    def project_full(
        self, lengths: Sequence[float] | np.ndarray, buckets: Sequence[int | None] | np.ndarray
    ) -> np.ndarray:
        """Expected KV tokens after iterations ``0 .. horizon`` (index 0 = now)."""
        return self.project_rows(np.asarray(lengths, dtype=float), self.bucket_index(buckets))

    def project_rows(self, lengths: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """:meth:`project_full` for buckets already mapped by :meth:`bucket_index`."""
        ln = lengths
        if ln.shape != rows.shape or ln.ndim != 1:
            raise ValueError(
                f"lengths and buckets must be 1-D of equal length, got {ln.shape} and "
                f"{rows.shape}"
            )
        k1 = self._none + 1
        len_by_bucket = np.bincount(rows, weights=ln, minlength=k1)
        total = len_by_bucket.sum()
        if ln.size and (not np.isfinite(total) or ln.min() < 0):
            raise ValueError("lengths must be finite and >= 0")
        cnt_by_bucket = np.bincount(rows, minlength=k1)
        return total - len_by_bucket @ self._t.pfin + cnt_by_bucket @ self._t.ret

    def project(
        self,
        lengths: Sequence[float] | np.ndarray,
        buckets: Sequence[int | None] | np.ndarray,
    ) -> np.ndarray:
        """Expected KV tokens at each of the next ``1 .. horizon`` iterations (Algorithm 1's M)."""
        return self.project_full(lengths, buckets)[1:]

    def trajectories(
        self,
        lengths: Sequence[float] | np.ndarray,
        buckets: Sequence[int | None] | np.ndarray,
    ) -> np.ndarray:
        """Per-request expected KV tokens, shape ``(len(lengths), horizon + 1)``."""
        ln = np.asarray(lengths, dtype=float)
        b = self.bucket_index(buckets)
        return ln[:, None] * (1.0 - self._t.pfin[b]) + self._t.ret[b]

    def trajectory_of_row(self, length: float, row: int) -> np.ndarray:
        """Expected KV tokens (``horizon + 1`` values) of one request whose bucket was
        already mapped by :meth:`bucket_index` to table row ``row``."""
        return length * (1.0 - self._t.pfin[row]) + self._t.ret[row]

    def expected_finished(self, buckets: Sequence[int | None] | np.ndarray) -> np.ndarray:
        """Expected number of requests finished by iterations ``0 .. horizon``."""
        return self.expected_finished_rows(self.bucket_index(buckets))

    def expected_finished_rows(self, rows: np.ndarray) -> np.ndarray:
        """:meth:`expected_finished` for buckets already mapped by :meth:`bucket_index`."""
        cnt = np.bincount(rows, minlength=self._none + 1).astype(float)
        return cnt @ self._t.pfin


@functools.lru_cache(maxsize=64)
def _cached_model(
    num_stages: int,
    theta: float,
    precision: tuple[float, ...],
    thresholds: tuple[int, ...],
    horizon: int,
    formula: str,
) -> LookaheadModel:
    return LookaheadModel(num_stages, theta, precision, thresholds, horizon, formula)


def expected_kv_tokens(
    lengths: Sequence[float] | np.ndarray,
    buckets: Sequence[int | None] | np.ndarray,
    num_stages: int,
    theta: float,
    precision: Sequence[float],
    thresholds: Sequence[int] = DEFAULT_THRESHOLDS,
    horizon: int = 64,
    formula: str = "exact",
) -> np.ndarray:
    """Algorithm 1 in one call: expected KV tokens at iterations ``1 .. horizon``.

    The model (and its tables) is cached per argument set. A ``theta`` measured online
    should be rounded (e.g. to 0.01) so that successive calls hit the cache; building the
    tables costs about a millisecond.
    """
    model = _cached_model(
        int(num_stages),
        float(theta),
        tuple(float(p) for p in precision),
        tuple(int(t) for t in thresholds),
        int(horizon),
        formula,
    )
    return model.project(lengths, buckets)
