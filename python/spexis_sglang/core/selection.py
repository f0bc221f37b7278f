"""Selective speculation (paper §5.1, Eq. 3-4, Figure 9).

Each iteration, stage 0 proposes one draft per request. Spexis ranks these candidates by
confidence and drops exactly ``floor(alpha * B)`` of the lowest, where ``B`` is the number of
candidates; a dropped request waits for verification and comes back with a normal row.

The ranking key is the *chain* confidence of the candidate: the product of the confidences
of the request's drafts that are still unverified (in flight) and of the new draft, i.e. the
model's estimate that every token the new row depends on is right (see
``sp_state.SPState.candidate_confidence``).

Selection is deterministic: NaN confidences count as the lowest; among equal confidences the
row with the larger tie key (by default the later row) is dropped first, so with request
order as the tie key older requests keep speculating. It costs O(B) (``np.partition``) plus
O(t log t) for the t rows tied at the cut.

The alpha chooser evaluates SP_alpha throughput (Table 1, Eq. 3-4) from a profile of
acceptance against confidence rank (Figure 9) and the SP latency function.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from .cost_model import _sp_alpha_state

__all__ = [
    "num_dropped",
    "select_drops",
    "select_drops_reference",
    "keep_mask",
    "RankAcceptanceProfile",
    "AlphaChoice",
    "choose_alpha",
    "DEFAULT_ALPHA_GRID",
    "ONLINE_ALPHA_GRID",
]

#: Candidate drop ratios for :func:`choose_alpha` (the paper used 0.15-0.3).
DEFAULT_ALPHA_GRID: tuple[float, ...] = tuple(round(0.01 * i, 2) for i in range(51))
#: The online chooser's grid (``--spexis-alpha auto``): the default one up to 1, where a
#: stage's time grows in proportion to its rows and speculation cannot pay, so alpha must be
#: able to drop every draft and run SP like PP.
ONLINE_ALPHA_GRID: tuple[float, ...] = DEFAULT_ALPHA_GRID + tuple(
    round(0.05 * i, 2) for i in range(11, 21)
)

_EPS = 1e-9


def num_dropped(batch: int, alpha: float) -> int:
    """``floor(alpha * batch)``, robust to binary rounding (``0.29 * 100`` gives 29, not 28)."""
    if batch < 0:
        raise ValueError(f"batch must be >= 0, got {batch}")
    alpha = float(alpha)
    if not 0.0 <= alpha <= 1.0 or math.isnan(alpha):
        raise ValueError(f"alpha must lie in [0, 1], got {alpha!r}")
    return min(int(batch), int(math.floor(alpha * batch + _EPS * max(1, batch))))


def _prepare(confidences: Sequence[float] | np.ndarray) -> np.ndarray:
    conf = np.asarray(confidences, dtype=float)
    if conf.ndim != 1:
        raise ValueError(f"confidences must be one-dimensional, got shape {conf.shape}")
    nan = np.isnan(conf)
    if nan.any():
        conf = np.where(nan, -np.inf, conf)
    return conf


def select_drops(
    confidences: Sequence[float] | np.ndarray,
    alpha: float,
    tie_key: Sequence[float] | np.ndarray | None = None,
) -> np.ndarray:
    """Indices (ascending) of the ``floor(alpha * B)`` rows to drop.

    Args:
        confidences: chain confidence per candidate row (NaN = lowest).
        alpha: drop ratio in [0, 1].
        tie_key: per-row key; among equal confidences, larger keys are dropped first.
            Defaults to the row index. Keys should be distinct for a total order.

    Returns:
        ``np.ndarray`` of int64 row indices, sorted ascending.
    """
    conf = _prepare(confidences)
    b = conf.size
    k = num_dropped(b, alpha)
    if k == 0:
        return np.empty(0, dtype=np.int64)
    if k >= b:
        return np.arange(b, dtype=np.int64)
    cut = np.partition(conf, k - 1)[k - 1]
    below = np.flatnonzero(conf < cut)
    need = k - below.size
    at = np.flatnonzero(conf == cut)
    if need < at.size:
        if tie_key is None:
            at = at[at.size - need :]  # largest row indices
        else:
            key = np.asarray(tie_key, dtype=float)
            if key.shape != conf.shape:
                raise ValueError("tie_key must have one entry per confidence")
            order = np.lexsort((at, key[at]))  # ascending key, then index
            at = np.sort(at[order[order.size - need :]])
    out = np.concatenate((below, at))
    out.sort()
    return out


def select_drops_reference(
    confidences: Sequence[float] | np.ndarray,
    alpha: float,
    tie_key: Sequence[float] | np.ndarray | None = None,
) -> np.ndarray:
    """Same contract as :func:`select_drops` by a full O(B log B) lexsort (used in tests)."""
    conf = _prepare(confidences)
    b = conf.size
    k = num_dropped(b, alpha)
    idx = np.arange(b)
    key = idx.astype(float) if tie_key is None else np.asarray(tie_key, dtype=float)
    # Primary: confidence ascending; secondary: tie key descending; tertiary: index descending.
    order = np.lexsort((-idx, -key, conf))
    return np.sort(order[:k]).astype(np.int64)


def keep_mask(
    confidences: Sequence[float] | np.ndarray,
    alpha: float,
    tie_key: Sequence[float] | np.ndarray | None = None,
) -> np.ndarray:
    """Boolean mask, True for rows that keep speculating."""
    conf = np.asarray(confidences)
    mask = np.ones(conf.shape[0], dtype=bool)
    mask[select_drops(conf, alpha, tie_key)] = False
    return mask


@dataclass(frozen=True)
class RankAcceptanceProfile:
    """Acceptance rate against confidence rank within a batch (paper Figure 9).

    ``acceptance[j]`` is the measured acceptance of drafts whose confidence rank in their
    batch falls in the quantile ``[j/K, (j+1)/K)``, **rank 0 = highest confidence**. The
    acceptance of the drafts kept at drop ratio ``alpha`` is the mean over the top
    ``1 - alpha`` quantile (piecewise constant within a bin)::

        Theta_alpha = (1 / (1 - alpha)) * integral_0^{1-alpha} a(q) dq
    """

    acceptance: tuple[float, ...]

    def __post_init__(self) -> None:
        acc = tuple(float(a) for a in self.acceptance)
        if not acc:
            raise ValueError("acceptance profile is empty")
        for j, a in enumerate(acc):
            if not 0.0 <= a <= 1.0 or math.isnan(a):
                raise ValueError(f"acceptance[{j}] = {a!r} is outside [0, 1]")
        object.__setattr__(self, "acceptance", acc)
        object.__setattr__(self, "_cum", np.concatenate(([0.0], np.cumsum(acc))))

    @property
    def theta(self) -> float:
        """Acceptance with no drops (``Theta_0 = Theta``)."""
        return self.theta_alpha(0.0)

    def theta_alpha(self, alpha: float) -> float:
        """Acceptance of the kept drafts at drop ratio ``alpha`` (``Theta_alpha`` of Eq. 4);
        at ``alpha = 1`` nothing is kept and the limit (the most confident rank's) is taken."""
        alpha = float(alpha)
        if not 0.0 <= alpha <= 1.0:
            raise ValueError(f"alpha must lie in [0, 1], got {alpha!r}")
        if alpha == 1.0:
            return float(self.acceptance[0])
        k = len(self.acceptance)
        x = (1.0 - alpha) * k
        full = min(int(math.floor(x + _EPS)), k)
        if full > x:  # x sat within _EPS below a bin edge: snapped up, so divide by the edge
            x = float(full)
        part = max(0.0, x - full)
        cum = self._cum  # type: ignore[attr-defined]
        area = cum[full] + (part * self.acceptance[full] if full < k else 0.0)
        return float(area / x)


@dataclass(frozen=True)
class AlphaChoice:
    """Result of :func:`choose_alpha` (one evaluated alpha)."""

    alpha: float
    theta_alpha: float
    rows: float
    effective: float
    latency_s: float
    throughput: float


def choose_alpha(
    num_stages: int,
    batch: float,
    profile: RankAcceptanceProfile,
    latency: Callable[[float], float],
    alphas: Sequence[float] = DEFAULT_ALPHA_GRID,
    model: str = "paper",
    interior_cost: float = 0.0,
) -> tuple[AlphaChoice, list[AlphaChoice]]:
    """Pick the drop ratio that maximises SP_alpha throughput (Table 1).

    For every candidate ``alpha``: ``Theta_alpha`` from the rank profile, rows and effective
    batch from Eq. 3-4 (``model="paper"``) or :func:`cost_model.sp_alpha_exact`
    (``model="exact"``), throughput ``effective / latency(rows)``, plus ``interior_cost``
    seconds per iteration for an ``alpha`` strictly inside (0, 1), whose drops wait for the
    drafts' confidences. Ties go to the smaller alpha (less speculation withheld).

    Returns:
        ``(best, all_evaluated)``.
    """
    if not alphas:
        raise ValueError("alphas is empty")
    evaluated: list[AlphaChoice] = []
    for a in sorted(set(float(x) for x in alphas)):
        th = profile.theta_alpha(a)
        ss = _sp_alpha_state(batch, num_stages, th, a, model)
        lat = float(latency(ss.rows)) + (interior_cost if 0.0 < a < 1.0 else 0.0)
        # a curve may say 0 s (no rows): no time, and no tokens, so no throughput either
        lat = max(lat, 1e-12)
        evaluated.append(
            AlphaChoice(
                alpha=a,
                theta_alpha=th,
                rows=ss.rows,
                effective=ss.effective,
                latency_s=lat,
                throughput=ss.effective / lat,
            )
        )
    best = evaluated[0]
    for c in evaluated[1:]:
        if c.throughput > best.throughput * (1.0 + 1e-12):
            best = c
    return best, evaluated
