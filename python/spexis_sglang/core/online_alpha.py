"""Selective speculation's drop ratio chosen online (``--spexis-alpha auto``).

The paper (§5.1) profiles acceptance against confidence rank offline and picks a fixed
``alpha`` with the cost model. :class:`OnlineAlpha` keeps the chooser's two inputs live on
stage 0 and re-runs the core's chooser (:func:`~.selection.choose_alpha`) every ``interval``
iterations, so ``alpha`` reaches the offline optimum on a steady workload and follows a shift
(a math-heavy load wants fewer drops than a translation-heavy one).

What is measured
----------------
* **Acceptance by confidence rank** (Figure 9). The caller tags every *launched* speculative
  row with the bin of its candidate's confidence rank among *all* candidates of its iteration,
  before drops (:meth:`OnlineAlpha.rank_bins`: rank 0 = most confident, ties broken as
  :func:`~.selection.select_drops` breaks them, rank ``r`` of ``C`` in bin
  ``floor(r * bins / C)`` as ``train.report.rank_profile`` bins the offline profile). When the
  row's draft is verified (ACCEPTED or REJECTED: the verdict of the row one position before
  it), the caller reports the bin and the verdict (:meth:`OnlineAlpha.record_verdicts`).
  Drafts that are never verified (their row went stale behind an earlier rejection) add
  nothing, as in the offline profile, and the cost model's ``Theta`` is exactly the
  acceptance of a verified draft.
* **Iteration time against rows** (the chooser's ``T_sp(rows)``): one sample per iteration
  (:meth:`OnlineAlpha.record_iteration`), fitted by weighted least squares as
  ``T(rows) = a + b * rows``, plus a wait on iterations whose drops waited for the drafts'
  confidences (see *Latency* below).
* **Batch** ``B``: the running requests (candidates plus normal rows), averaged over the
  iterations since the previous choice (the batch the next interval will most likely carry).

Every other count is exponentially decayed per iteration with half-life ``half_life`` iterations
(by default four choice intervals, 200 iterations at the default ``interval`` of 50), so old
data fades and a workload shift is followed in a few half-lives (the count of reversals, see
*Decision*, fades slower); nothing else ages.

Exploration
-----------
Dropped drafts are never verified, so under ``alpha`` the lowest ``alpha`` fraction of ranks
gets no new verdicts, and a shift that made those drafts better would go unseen (the estimate
would keep its pre-shift value forever, or its prior). Every ``explore``-th iteration
therefore runs with ``alpha = 0``: all candidates are launched, every bin gets verdicts, and
those iterations' larger batches give the latency fit the spread of rows it needs to see a
slope. The cost is a ``1/explore`` share of iterations at ``alpha = 0``. That is small against
an interior ``alpha``'s gain, but at ``alpha = 1`` (SP running like PP, where a stage's time
grows in proportion to its rows) an explore iteration carries every draft, ~B rows instead of
B/N, and at low acceptance most of them are wasted: one in 8 cost 12 % of the throughput at
B = 512 on an emulated two-GPU box. And in a pipe of B/N-row batches one of ~B rows paces
every launch until it leaves the pipe (the launch waits for the oldest batch's tokens): on the
box the three launches behind an explore took 12-16 ms where alpha 1 ran 10-11. So a choice of
``alpha = 1`` starts the period at the probes' base, ``max(explore, 4 * probe_length)`` (below),
and while ``alpha`` stays at 1 the period backs off: every choice that keeps it there doubles
the period, up to ``explore_max`` (64); any choice of another ``alpha`` resets it to
``explore``. (At ``alpha = 0`` an explore iteration is an ordinary one; inside (0, 1) the
bottom bins' verdicts come only from them.)

At ``alpha = 0`` with a steady batch every iteration carries the same rows, so the latency fit
sees no spread and cannot notice that a stage's time has turned proportional to its rows (the
batch grew into the compute-bound range): the last fit would stand for ever, and ``alpha``
would stay at 0 where 1 is worth more (seen on the emulated two-GPU box at B = 512). So while
``alpha`` is 0 a *probe* runs every ``probe_period`` iterations: ``probe_length`` consecutive
iterations at ``alpha = 1`` (about B/N rows each), so that for a moment every batch in the pipe
is small and the time between launches is what B/N rows cost. The caller sets a sample against
the batches in its pipe and leaves out those whose pipe held probe and other batches both (the
time between two launches is paced by the oldest batch in the pipe, whose true tokens the later
launch waited for, not by the largest one: set against the largest, the first samples after a
probe read B rows at B/N rows' time); so a probe is one iteration longer than the caller's
pipeline depth (``N + 1`` batches in flight in the SP loop), or no sample would see only probe
batches: with a probe of ``N`` iterations in a pipe three deep, on an emulated two-GPU box the
latency by rows put ~290 rows at 17 ms (B = 512, Llama-3.1-8B shape) where alpha 1's 256 took
12, and ``alpha`` stayed at 0 where a fixed alpha 1 ran 1.15-1.35x faster. The probe period
starts at ``max(explore, 4 * probe_length)`` and doubles at each choice that keeps ``alpha`` at
0, up to ``explore_max``; any other choice resets it. Where the measured fit prices alpha 1 at
least ``PROBE_FAR_MARGIN`` below alpha 0 (a stage far from proportional: small batches, where a
probe's B/N rows take nearly B rows' time), the period goes to ``explore_max`` at once: on the
emulated box at B <= 64 the doubling spent ~8 % of the iterations in probes, ~4 % of the rate.
While alpha 1 stays that far behind it doubles on, up to ``PROBE_FAR_PERIODS * explore_max``:
at one in 64 a probe (four iterations, N = 2) still took ~3 % of the rate on the box. A new load
(the batch more than 2x from the last choice's) brings it back to ``explore_max`` at most, so
the rows of a load the fit has not measured are probed as soon as before.
A due explore iteration waits for a probe to end. A probe launches no observed drafts (the
caller observes explore iterations only), and its drafts are held, not lost. Alternatives
considered: keeping a random share of the would-be drops in every iteration (spreads the same
cost but needs a random source and gives no row spread); extrapolating the profile below the
cut (unsafe exactly when the workload shifts).

Estimates
---------
* Per bin ``j``: ``(accepted_j + w0 * m) / (verified_j + w0)``, decayed counts plus ``w0``
  pseudo-drafts (``prior_weight``) at the pooled acceptance ``m`` of all bins; then made
  non-increasing in rank by weighted isotonic regression (pool adjacent violators), since a
  more confident draft is not less likely to be right. This keeps sparse bottom bins (seen in
  explore iterations only) from making the chooser jumpy.
* Latency: weighted least squares over the decayed samples. A sample above ``clip`` times the
  current fit is clipped to it (the machine is shared; one preempted iteration must not move
  the slope). ``a`` and ``b`` are clamped to ``>= 0`` (time never falls with rows). When the
  rows barely varied (weighted standard deviation below ``max(min_spread, 2 %)`` of the mean
  rows), the slope is not identified: the last identified fit is kept; if there never was
  one, the latency is taken as flat (``b = 0``), under which dropping never pays, so
  ``alpha`` goes to 0 until rows vary. Hence ``initial`` is above 0 (0.15, the low end of
  the paper's range): its drops plus the explore iterations make the rows vary from the
  start.
* The wait for confidences: where ``alpha`` lies strictly inside (0, 1) the drops depend on
  the drafts' confidences, so stage 0 waits for its own forward before it builds the next
  batch, and the GPU idles while it builds (on an emulated two-GPU H200 box that made an
  iteration 1.2-2.2x its GPU time at small batches). At ``alpha`` 0 or 1, and on explore
  iterations, it does not wait. The caller marks each sample (``waited``) and the fit is
  ``T(rows) + wait`` on waited samples: ``a + b * rows + wait * z`` by weighted least squares,
  the slope from the spread of rows within each kind of sample. Once both kinds have
  ``min_group`` (decayed) samples the wait is measured; it is kept when only one kind comes
  in afterwards (and taken out of waited samples then). Before it is first measured it is
  taken as 0, so an interior ``alpha`` is tried on its merits and then charged what it costs.
* The chooser's ``T_sp(rows)``: the same samples by rows (buckets half an octave wide, so
  that B and B/2 rows never share one), each bucket's mean time less the wait, piecewise
  linear between the buckets' means (non-decreasing), once two buckets hold samples and the
  affine fit misses one by more than ``curve_tolerance`` (5 %; :class:`LatencyCurve`); the
  affine fit otherwise. A stage's time is flat in rows and then turns proportional: a single
  line through both regimes overstates the time in between, where ``alpha = 1``'s B/N rows
  fall at large B (on an emulated two-GPU box it put 26.9 ms on 128 rows that took 22.4 and
  kept ``alpha`` at 0 at B = 256).

Decision
--------
Every ``interval`` iterations, and at once when the running batch moves more than 2x from
the last choice's (a new load: a batch of 512 arriving after a tail of 16 would otherwise run
up to ``interval`` iterations at the tail's ``alpha``; at least 5 iterations apart), once at
least ``min_verdicts`` (decayed) verdicts and ``min_samples`` latency samples are in:
``choose_alpha(num_stages, B, profile, T_sp, grid, model, interior_cost=wait)``. The new ``alpha`` replaces the current one only if its
predicted throughput beats the current ``alpha``'s by more than ``margin`` (relative), so
noise does not make ``alpha`` flap between near-equal choices. Leaving ``initial`` (a guess)
takes ``margin``, and so does a change at a batch more than 2x from the one the current
``alpha`` was chosen at (it was chosen for another load: on the box a run of 512 requests
kept the alpha 0 of the previous run's drained tail for 50 more iterations, alpha 1 ahead by
1.5 %); once ``alpha`` has been chosen at this load, a change takes ``settled_margin`` (2 %):
each change resets the explore and probe periods, and on an emulated two-GPU box ``alpha``
went between 0 and 1 eight times during one measured point where its fit put the two
0.7-1.7 % apart (B = 512, Theta 0.6), while one in 8 explore iterations at ``alpha = 1`` had
cost 12 % there, more than such a gap can gain.

A change back (towards the ``alpha`` before the last change) needs that margin doubled for
each such reversal in the recent past (decayed over 32 half-lives, at most 8x): each
regime measures the other one's rows only in its probe or explore iterations, among batches of
its own size, and on an emulated two-GPU box (two stages sharing one GPU's memory) both
readings came out low, so each ``alpha`` looked worse than the other while in force and a
fixed margin let ``alpha`` go between 0 and 1 six times within one measured point
(Llama-3.1-8B shape, B = 512). In a synthetic load where each regime reads the other 12 %
low, the changes come half as often and further apart (``tests/core/test_online_alpha.py``).
Only a change back at about the same load is a reversal (a batch within 2x of the one the
last change was chosen at): a load that drains (a batch of 512 finishing down to 15 requests)
rightly takes ``alpha`` from 1 back to 0, and counted as flapping, every such tail doubled the
margin the next batch of 512 needed to return to 1 (on the box ``alpha`` stayed at 0 there,
1.03x stock PP2 where a fixed 1 ran 1.29x).

Everything is deterministic given the sequence of calls (no clock, no random source; the
caller passes the measured seconds).

Typical driving sequence (stage 0, per decode iteration)::

    oa = OnlineAlpha(num_stages=2)
    alpha = oa.next_iteration(running=len(running))   # 0 on explore, 1 on probe iterations
    conf = candidate_confidence(spec_rows)            # the selection key, before drops
    bins = oa.rank_bins(conf)
    rows, dropped = select(rows, alpha)               # launch; remember each launched
    ...                                               # speculative row's bin
    oa.record_iteration(rows=largest_batch_in_pipe, seconds=since_last_launch)
    oa.record_verdicts(bins_of_verified_drafts, accepted)   # when verdicts come back
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from .selection import (
    ONLINE_ALPHA_GRID,
    AlphaChoice,
    RankAcceptanceProfile,
    choose_alpha,
)

__all__ = [
    "AUTO_ALPHA_EXPLORE",
    "AUTO_ALPHA_EXPLORE_MAX",
    "AUTO_ALPHA_INITIAL",
    "AUTO_ALPHA_INTERVAL",
    "FIXED_ALPHA_OBSERVE_EVERY",
    "FIXED_ALPHA_ONE_OBSERVE_EVERY",
    "LatencyCurve",
    "LatencyFit",
    "OnlineAlpha",
    "isotonic_decreasing",
    "rank_bins",
]

#: the explore period doubles up to this many iterations while the choice stands
AUTO_ALPHA_EXPLORE_MAX = 64
#: re-choose alpha every this many iterations (``--spexis-alpha-interval``)
AUTO_ALPHA_INTERVAL = 50
#: every this-many-th iteration runs with alpha = 0 (``--spexis-alpha-explore``)
AUTO_ALPHA_EXPLORE = 8
#: alpha before the first choice (the low end of the paper's 0.15-0.3)
AUTO_ALPHA_INITIAL = 0.15
#: a fixed alpha's observer takes every this-many-th iteration (``--spexis-alpha-observe``)
FIXED_ALPHA_OBSERVE_EVERY = 8
#: the same at a fixed alpha of 1, where stage 0 makes drafts only within N + 1 iterations of an
#: observed one (every 8th made them on half the iterations: ~0.8 ms of LM head a 256-row
#: forward, 7 % of the iteration on an 8B shape, for the ``/server_info`` recommendation alone)
FIXED_ALPHA_ONE_OBSERVE_EVERY = 64
#: counts' half-life in choice intervals (``OnlineAlpha(half_life=None)``)
HALF_LIFE_INTERVALS = 4
#: buckets of rows, half an octave each, for :meth:`OnlineAlpha.latency_by_rows` and the
#: chooser's curve (the last: 4096 rows and more)
LATENCY_ROW_BUCKETS = 25
#: reversals of alpha are remembered over this many counts' half-lives
REVERSAL_MEMORY = 32
#: at most this many doublings of the margin for going back
MAX_REVERSAL_DOUBLINGS = 3
#: batches within this factor of each other are one load: a change back is a reversal, and a
#: change needs ``settled_margin``, only at the load of the last change; a running batch
#: further than this from the last choice's is a new load, chosen for at once
SAME_LOAD = 2.0
#: iterations at least between a choice and a choice for a moved load
LOAD_CHOICE_GAP = 5
#: alpha 0 standing with alpha 1 priced this far below it (an identified fit): the probes go
#: straight to one in ``explore_max`` iterations instead of doubling there, and double on from
#: there while it stays so, up to ``PROBE_FAR_PERIODS`` times ``explore_max``
PROBE_FAR_MARGIN = 0.25
PROBE_FAR_PERIODS = 4
#: confidence-rank bins (tenths, as the offline Figure 9 profile)
RANK_BINS = 10


def rank_bins(confidences: Sequence[float] | np.ndarray, bins: int = RANK_BINS) -> np.ndarray:
    """Confidence-rank bin of every candidate (int64; bin 0 holds the most confident).

    Ranks follow :func:`~.selection.select_drops`'s order exactly: NaN is the lowest
    confidence, and among equal confidences the later row ranks lower (is dropped first), so
    the ``floor(alpha * C)`` rows that selection drops are the ``floor(alpha * C)`` lowest
    ranks. Rank ``r`` of ``C`` falls in bin ``floor(r * bins / C)``.
    """
    conf = np.asarray(confidences, dtype=np.float64)
    c = conf.shape[0]
    out = np.empty(c, dtype=np.int64)
    if c == 0:
        return out
    conf = np.where(np.isnan(conf), -np.inf, conf)
    idx = np.arange(c)
    drop_order = np.lexsort((-idx, conf))  # first = dropped first = lowest rank
    rank = np.empty(c, dtype=np.int64)
    rank[drop_order] = np.arange(c - 1, -1, -1)
    return (rank * bins) // c


def one_load(a: float, b: float) -> bool:
    """Two batches are one load: both positive, within :data:`SAME_LOAD` of each other."""
    lo, hi = sorted((float(a), float(b)))
    return lo > 0 and hi <= SAME_LOAD * lo


def isotonic_decreasing(values: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """Weighted least-squares fit of a non-increasing sequence (pool adjacent violators)."""
    v = [float(x) for x in values]
    w = [float(x) for x in weights]
    # blocks of (mean, weight, length), merged while a later block's mean exceeds an earlier's
    means: list[float] = []
    wts: list[float] = []
    lens: list[int] = []
    for x, wx in zip(v, w):
        means.append(x)
        wts.append(wx)
        lens.append(1)
        while len(means) > 1 and means[-1] > means[-2]:
            m2, w2, l2 = means.pop(), wts.pop(), lens.pop()
            m1, w1, l1 = means.pop(), wts.pop(), lens.pop()
            wsum = w1 + w2
            means.append((m1 * w1 + m2 * w2) / wsum if wsum > 0 else (m1 + m2) / 2)
            wts.append(wsum)
            lens.append(l1 + l2)
    out: list[float] = []
    for m, n in zip(means, lens):
        out.extend([m] * n)
    return np.asarray(out, dtype=np.float64)


@dataclass(frozen=True)
class LatencyFit:
    """``T(rows) = intercept + slope * rows`` seconds per iteration, plus ``wait`` on an
    iteration whose drops depend on the drafts' confidences (``alpha`` strictly inside
    (0, 1): stage 0 waits for its own forward before it builds the next batch)."""

    intercept: float
    slope: float
    #: the slope was measured (False: flat fallback, no spread of rows seen yet)
    identified: bool
    wait: float = 0.0
    #: the wait was measured (False: 0, or the last measured one)
    wait_identified: bool = False

    def __post_init__(self) -> None:  # plain Python numbers: the fit goes into JSON
        for name, kind in (
            ("intercept", float),
            ("slope", float),
            ("identified", bool),
            ("wait", float),
            ("wait_identified", bool),
        ):
            object.__setattr__(self, name, kind(getattr(self, name)))

    def __call__(self, rows: float) -> float:
        return self.intercept + self.slope * float(rows)


@dataclass(frozen=True)
class LatencyCurve:
    """Seconds per iteration against rows, piecewise linear through ``knots`` (mean rows,
    mean seconds of a bucket of samples, non-decreasing), the end segments continued beyond
    the end knots; with fewer than two knots, ``fit`` (the affine fit). Below the first knot
    a steep first segment would reach zero time at some rows: there the time falls at most in
    proportion to the rows (a stage's time never shrinks faster than its rows do).

    A stage's time is flat in rows while weights dominate and turns proportional once
    compute does: one line through samples from both regimes overstates the time at the
    rows in between (on an emulated two-GPU box, 26.9 ms for a 128-row stage that took 22.4,
    from samples at 16 ... 256 rows), which is where ``alpha = 1`` runs at large B.
    """

    knots: tuple[tuple[float, float], ...]
    fit: LatencyFit

    def __call__(self, rows: float) -> float:
        k = self.knots
        if len(k) < 2:
            return self.fit(rows)
        x = float(rows)
        i = 1
        while i < len(k) - 1 and x > k[i][0]:
            i += 1
        (x0, y0), (x1, y1) = k[i - 1], k[i]
        y = y0 + (y1 - y0) * (x - x0) / (x1 - x0)
        if x < x0:
            y = max(y, y0 * max(x, 0.0) / x0)
        return max(y, 0.0)


class OnlineAlpha:
    """Live acceptance-by-rank profile and latency fit; ``alpha`` re-chosen every ``interval``.

    Args:
        num_stages: pipeline stages ``N``.
        interval: iterations between choices.
        explore: every ``explore``-th iteration runs with ``alpha = 0`` (0 or 1: never; the
            bottom bins then keep their prior; used for observation-only trackers); the
            period doubles, up to ``explore_max``, each time a choice keeps ``alpha`` at 1,
            and falls back to its base on any other choice: ``explore``, or at ``alpha`` 1 the
            probes' base (an explore there disturbs the launches behind it as a probe does at
            0). At alpha 0 the probes' base period, backing off while alpha 0 stands, times
            the probe iterations at alpha 1.
        explore_max: the longest explore (and probe) period.
        initial: ``alpha`` until the first choice.
        half_life: iterations after which a count weighs half (default: ``4 * interval``,
            so a choice rests mostly on the last few intervals).
        alphas: the grid the chooser evaluates (by default up to 1: every draft dropped, SP
            running like PP, where speculation cannot pay).
        model: the chooser's steady-state model (``"exact"``: :func:`cost_model.sp_alpha_exact`,
            the mechanics the scheduler runs; ``"paper"``: Eq. 3-4).
        bins: confidence-rank bins.
        prior_weight: pseudo-drafts per bin at the pooled acceptance.
        min_verdicts: decayed verdicts needed before the first choice.
        min_samples: decayed latency samples needed before the first choice.
        min_spread: rows; below this weighted standard deviation the slope is not identified.
        clip: a latency sample above ``clip`` times the current fit is clipped to it.
        min_group: decayed samples of each kind (waited for confidences or not) needed
            before the wait is fitted apart.
        min_knot: decayed samples a bucket of rows needs to be a knot of the chooser's
            latency curve (:meth:`latency_curve`).
        merge_ratio: adjacent buckets whose mean rows are closer than this ratio form one
            knot.
        curve_tolerance: relative distance of the affine fit from a knot beyond which the
            chooser takes the curve instead of the fit.
        margin: relative throughput gain a new ``alpha`` must predict over ``initial``.
        settled_margin: the gain any later change must predict (hysteresis against flapping
            between near-equal choices).
        reversal_backoff: a change back towards the alpha before the last change needs
            ``settled_margin`` times this to the power of the (decayed) reversals so far
            (1: no backoff).
        history: choices kept for :meth:`as_dict` (iteration, alpha).
    """

    def __init__(
        self,
        num_stages: int,
        interval: int = AUTO_ALPHA_INTERVAL,
        explore: int = AUTO_ALPHA_EXPLORE,
        explore_max: int = AUTO_ALPHA_EXPLORE_MAX,
        initial: float = AUTO_ALPHA_INITIAL,
        half_life: float | None = None,
        alphas: Sequence[float] = ONLINE_ALPHA_GRID,
        model: str = "exact",
        bins: int = RANK_BINS,
        prior_weight: float = 2.0,
        min_verdicts: float = 100.0,
        min_samples: float = 20.0,
        min_spread: float = 0.5,
        clip: float = 2.0,
        min_group: float = 2.0,
        min_knot: float = 1.0,
        merge_ratio: float = 1.2,
        curve_tolerance: float = 0.05,
        margin: float = 0.005,
        settled_margin: float = 0.02,
        reversal_backoff: float = 2.0,
        history: int = 1000,
        probe_length: int | None = None,
    ) -> None:
        if num_stages < 1:
            raise ValueError(f"num_stages must be >= 1, got {num_stages}")
        if interval < 1:
            raise ValueError(f"interval must be >= 1, got {interval}")
        if explore < 0:
            raise ValueError(f"explore must be >= 0, got {explore}")
        if half_life is None:
            half_life = HALF_LIFE_INTERVALS * interval
        if not half_life > 0:
            raise ValueError(f"half_life must be > 0, got {half_life}")
        if bins < 1:
            raise ValueError(f"bins must be >= 1, got {bins}")
        if model not in ("exact", "paper"):
            raise ValueError(f"model must be 'exact' or 'paper', got {model!r}")
        self.alphas = tuple(sorted(set(float(a) for a in alphas)))
        if not self.alphas or not all(0.0 <= a <= 1.0 for a in self.alphas):
            raise ValueError("alphas must be a non-empty grid in [0, 1]")
        if not 0.0 <= initial <= 1.0:
            raise ValueError(f"initial alpha must lie in [0, 1], got {initial}")
        self.num_stages = int(num_stages)
        self.interval = int(interval)
        self.explore = int(explore)
        self.explore_max = max(int(explore_max), self.explore)
        #: iterations of one probe: the caller's pipeline depth and one more, so that some
        #: latency samples see nothing but probe batches in the pipe (default ``num_stages``)
        self.probe_length = max(1, int(probe_length or num_stages))
        # the probe period's start (and reset) value: a probe takes a quarter of it at most
        self._probe_base = max(self.explore, 4 * self.probe_length)
        #: iterations between explore iterations now (see ``explore``)
        self.explore_period = self._explore_base(initial)
        self._next_explore = self.explore_period  # the iteration of the next explore
        self._last_explore = 0
        #: this iteration explores (alpha 0), and how many iterations its observation stands
        #: for (those since the previous explore iteration)
        self.exploring = False
        self.explore_gap = max(self.explore, 1)
        #: this iteration is a latency probe at alpha 1 (alpha 0 only; see the module docstring)
        self.probing = False
        self.probe_period = self._probe_base
        # a probe falls half an explore period after an explore (the first one, or the choice
        # that resets the period), so the two seldom meet
        self._probe_offset = max(self.explore // 2, 1)
        self._next_probe = self._probe_base + self._probe_offset
        self.probe_iterations = 0
        self._probe_left = 0  # iterations of the running probe still to come
        self.half_life = float(half_life)
        self.decay = 0.5 ** (1.0 / self.half_life)
        self.model = model
        self.bins = int(bins)
        self.prior_weight = float(prior_weight)
        self.min_verdicts = float(min_verdicts)
        self.min_samples = float(min_samples)
        self.min_spread = float(min_spread)
        self.clip = float(clip)
        self.min_group = float(min_group)
        self.min_knot = float(min_knot)
        self.merge_ratio = float(merge_ratio)
        self.curve_tolerance = float(curve_tolerance)
        self.margin = float(margin)
        self.settled_margin = max(float(settled_margin), self.margin)
        self.reversal_backoff = max(float(reversal_backoff), 1.0)

        self.alpha = float(initial)
        self.iteration = 0
        self.explore_iterations = 0
        self.choices = 0
        self.changes = 0
        self.last_choice: AlphaChoice | None = None
        self.history: deque[tuple[int, float]] = deque(maxlen=history)
        # decayed counts
        self._verified = np.zeros(self.bins)
        self._accepted = np.zeros(self.bins)
        self._lat = np.zeros(5)  # W, Sx, Sy, Sxx, Sxy
        self._lat_waited = np.zeros(3)  # W, Sx, Sy of the samples that waited
        # W, Sx, Sy, W of waited samples, by rows (half-octave buckets): the chooser's curve,
        # and for a reader of as_dict what the fit was made from
        self._lat_by_rows = np.zeros((LATENCY_ROW_BUCKETS, 4))
        self._wait: float | None = None  # the last identified wait
        self._window = np.zeros(2)  # n, S(running) since the last choice
        self._last_batch = 0.0  # the window's mean at the last choice
        self._last_choice_iteration = 0
        self._fit: LatencyFit | None = None  # the last identified fit
        self._last_step = 0.0  # the last change of alpha (its sign: the direction)
        self._last_change_batch = 0.0  # the batch the last change was chosen at
        self._reversals = 0.0  # changes that went back, decayed (see choose)
        #: the last choice's inputs and outcome (for the caller's log): see :meth:`choose`
        self.last_decision: dict | None = None

    # ------------------------------------------------------------------ per iteration
    def next_iteration(self, running: int) -> float:
        """Start an iteration with ``running`` requests; return its ``alpha``.

        Ages every count by one iteration, re-chooses ``alpha`` every ``interval`` iterations,
        and returns 0 on explore iterations, 1 on probe iterations (the current ``alpha``
        otherwise).
        """
        self.iteration += 1
        d = self.decay
        self._verified *= d
        self._accepted *= d
        self._lat *= d
        self._lat_waited *= d
        self._lat_by_rows *= d
        if self._load_moved(running):
            # the batch is another load now: choose for it at once, from it alone
            self._window[:] = (1.0, float(running))
            self.choose(periodic=False)
        else:
            self._window += (1.0, float(running))
            if self.iteration % self.interval == 0:
                self.choose()
        self.exploring = False
        self.probing = self._probe_continues()
        if not self.probing:  # a running probe goes first; a due explore waits for its end
            self._probe_left = 0
            self.exploring = self.explore > 1 and self.iteration >= self._next_explore
            if self.exploring:
                self.explore_iterations += 1
                self.explore_gap = self.iteration - self._last_explore
                self._last_explore = self.iteration
                self._next_explore = self.iteration + self.explore_period
                return 0.0
            self.probing = self._probe_due(self.iteration)
            if not self.probing:
                return self.alpha
            self._probe_left = self.probe_length
            self._next_probe = self.iteration + self.probe_period
        self._probe_left -= 1
        self.probe_iterations += 1
        return 1.0

    def _explore_base(self, alpha: float) -> int:
        """The explore period a choice of ``alpha`` starts from: at 1 the probes' base (an
        explore there paces the launches behind it as a probe does at 0; module docstring),
        elsewhere ``explore``."""
        return self._probe_base if alpha >= 1.0 else self.explore

    def _probe_continues(self) -> bool:
        return self._probe_left > 0 and self.alpha == 0.0

    def _probe_due(self, iteration: int) -> bool:
        return self.explore > 1 and self.alpha == 0.0 and iteration >= self._next_probe

    def next_explores(self) -> bool:
        """The next :meth:`next_iteration` is an explore iteration (unless a choice there
        moves ``alpha`` and brings the next explore forward)."""
        return (
            self.explore > 1
            and not self._probe_continues()
            and self.iteration + 1 >= self._next_explore
        )

    def settled_at_one(self, iterations: int) -> bool:
        """``alpha`` is 1 and, as things stand, the next ``iterations`` iterations run at 1
        too: none of them explores or re-chooses (probes run at ``alpha`` 0 only)."""
        if self.alpha < 1.0:
            return False
        i = self.iteration
        if self.explore > 1 and self._next_explore <= i + iterations:
            return False
        return self.interval - i % self.interval > iterations

    def peek_alpha(self) -> float | None:
        """The ``alpha`` :meth:`next_iteration` will return, or None where it may re-choose
        (a choice iteration that is not an explore one): a caller that needs confidences
        only for drops strictly inside (0, 1) asks this before reading them."""
        i = self.iteration + 1
        if i % self.interval == 0:
            return None
        if self._probe_continues():
            return 1.0
        if self.next_explores():
            return 0.0
        if self._probe_due(i):
            return 1.0
        return self.alpha

    def rank_bins(self, confidences: Sequence[float] | np.ndarray) -> np.ndarray:
        """Bin of every candidate of this iteration (see :func:`rank_bins`)."""
        return rank_bins(confidences, self.bins)

    def record_verdicts(
        self, bins: np.ndarray, accepted: np.ndarray, weight: float | np.ndarray = 1.0
    ) -> None:
        """Verified drafts: the rank bin each was launched in and whether it was accepted.

        ``weight``: how many drafts each one stands for (a caller that observes a sample of
        the iterations weighs them by the inverse of the sampling rate), one for all or one
        per draft."""
        b = np.asarray(bins, dtype=np.int64)
        if b.size == 0:
            return
        if b.min() < 0 or b.max() >= self.bins:
            raise ValueError(f"rank bins must lie in [0, {self.bins}), got {b}")
        acc = np.asarray(accepted, dtype=bool)
        if isinstance(weight, np.ndarray):
            w = weight.astype(np.float64)
            self._verified += np.bincount(b, weights=w, minlength=self.bins)
            self._accepted += np.bincount(b, weights=w * acc, minlength=self.bins)
        elif weight == 1.0:
            self._verified += np.bincount(b, minlength=self.bins)
            self._accepted += np.bincount(b, weights=acc.astype(np.float64), minlength=self.bins)
        else:
            w = float(weight)
            self._verified += w * np.bincount(b, minlength=self.bins)
            self._accepted += w * np.bincount(
                b, weights=acc.astype(np.float64), minlength=self.bins
            )

    def record_iteration(
        self, rows: float, seconds: float, weight: float = 1.0, waited: bool = False
    ) -> None:
        """One iteration's wall time against the rows it carried (``weight``: how many
        iterations the sample stands for, as in :meth:`record_verdicts`; ``waited``: its
        drops depended on the drafts' confidences, so stage 0 waited for them)."""
        x, y = float(rows), float(seconds)
        if not (math.isfinite(x) and math.isfinite(y)) or y <= 0 or x <= 0:
            return
        cur = self.latency()
        if cur is not None and cur.identified:
            bound = cur(x) + (cur.wait if waited else 0.0)
            y = min(y, self.clip * max(bound, 1e-12))
        w = float(weight)
        self._lat += (w, w * x, w * y, w * x * x, w * x * y)
        bucket = min(int(2.0 * math.log2(max(x, 1.0))), LATENCY_ROW_BUCKETS - 1)
        self._lat_by_rows[bucket] += (w, w * x, w * y, w if waited else 0.0)
        if waited:
            self._lat_waited += (w, w * x, w * y)

    # ------------------------------------------------------------------ estimates
    @property
    def batch(self) -> float:
        """Mean running requests since the last choice (the chooser's ``B``: the batch the
        next interval will most likely carry; a mean over the counts' half-life would lag a
        change of load by hundreds of iterations)."""
        n, s = self._window
        return float(s / n) if n > 0 else self._last_batch

    @property
    def verdicts(self) -> float:
        """Decayed number of verified drafts."""
        return float(self._verified.sum())

    @property
    def samples(self) -> float:
        """Decayed number of latency samples."""
        return float(self._lat[0])

    def latency_by_rows(self, min_weight: float = 0.01) -> list[list[float]]:
        """The latency samples by rows (half-octave buckets): ``[mean rows, mean seconds, decayed
        weight]`` per bucket that holds any, fewest rows first."""
        return [
            [float(sx / w), float(sy / w), float(w)]
            for w, sx, sy, _ in self._lat_by_rows
            if w >= min_weight
        ]

    def latency_curve(self, fit: LatencyFit | None = None) -> LatencyCurve | None:
        """The chooser's latency: a :class:`LatencyCurve` through the buckets of rows that
        hold at least ``min_knot`` (decayed) samples, each bucket's mean time less the wait
        on its waited samples; adjacent buckets whose mean rows lie within ``merge_ratio`` of
        each other are merged (two close knots would give a slope from noise), and the times
        are made non-decreasing in rows (weighted isotonic regression). Where the affine fit
        lies within ``curve_tolerance`` of every knot the fit stands (it averages every sample:
        the steadier choice). None before any sample."""
        fit = self.latency() if fit is None else fit
        if fit is None:
            return None
        knots: list[list[float]] = []  # W, Sx, Sy (waits out)
        for w, sx, sy, ww in self._lat_by_rows:
            if w < self.min_knot:
                continue
            sy -= fit.wait * ww
            if knots and sx / w < self.merge_ratio * knots[-1][1] / knots[-1][0]:
                knots[-1] = [knots[-1][0] + w, knots[-1][1] + sx, knots[-1][2] + sy]
            else:
                knots.append([w, sx, sy])
        if len(knots) < 2:
            return LatencyCurve((), fit)
        w = np.array([k[0] for k in knots])
        rows = [k[1] / k[0] for k in knots]
        seconds = -isotonic_decreasing(-np.array([k[2] / k[0] for k in knots]), w)
        if all(abs(fit(x) - y) <= self.curve_tolerance * y for x, y in zip(rows, seconds)):
            return LatencyCurve((), fit)  # the line explains every bucket: less noise
        return LatencyCurve(tuple((float(x), float(y)) for x, y in zip(rows, seconds)), fit)

    def acceptance_by_bin(self) -> np.ndarray:
        """Raw decayed acceptance per bin (NaN where nothing was verified)."""
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(self._verified > 0, self._accepted / self._verified, np.nan)

    def profile(self) -> RankAcceptanceProfile | None:
        """The smoothed, monotone acceptance-by-rank profile (None before any verdict)."""
        n = self._verified.sum()
        if n <= 0:
            return None
        pooled = float(self._accepted.sum() / n)
        w = self._verified + self.prior_weight
        est = (self._accepted + self.prior_weight * pooled) / w
        est = np.clip(isotonic_decreasing(est, w), 0.0, 1.0)
        return RankAcceptanceProfile(tuple(est.tolist()))

    def latency(self) -> LatencyFit | None:
        """The latency fit (None before any sample). See the module docstring."""
        w, sx, sy, sxx, sxy = self._lat
        if w <= 0:
            return None
        w1, sx1, sy1 = self._lat_waited
        w0, sx0, sy0 = w - w1, sx - sx1, sy - sy1
        if min(w0, w1) >= self.min_group:
            return self._fit_with_wait(w, sxx, sxy, (w0, sx0, sy0), (w1, sx1, sy1))
        # (nearly) one kind of sample: the slope as before, the waited samples' time less the
        # wait as last measured
        wait = self._wait if self._wait is not None else 0.0
        sy, sxy = sy - wait * w1, sxy - wait * sx1
        mx, my = sx / w, sy / w
        var = max(sxx / w - mx * mx, 0.0)
        spread = max(self.min_spread, 0.02 * mx)
        if var >= spread * spread:
            slope = max((sxy / w - mx * my) / var, 0.0)
            intercept = my - slope * mx
            if intercept < 0:  # time would vanish before zero rows: proportional instead
                intercept, slope = 0.0, max(my, 0.0) / mx
            self._fit = LatencyFit(intercept, slope, True)
            return LatencyFit(intercept, slope, True, wait, self._wait is not None)
        if self._fit is not None:
            f = self._fit
            return LatencyFit(f.intercept, f.slope, True, wait, self._wait is not None)
        return LatencyFit(max(my, 0.0), 0.0, False, wait, self._wait is not None)

    def _fit_with_wait(self, w, sxx, sxy, g0, g1) -> LatencyFit:
        """``y = a + b x + wait z`` by weighted least squares (``z``: the sample waited).
        The slope comes from the spread of rows within each kind of sample (with the two
        kinds' means apart, a wait and a slope would explain the same difference)."""
        (w0, sx0, sy0), (w1, sx1, sy1) = g0, g1
        mx0, my0, mx1, my1 = sx0 / w0, sy0 / w0, sx1 / w1, sy1 / w1
        vxx = (sxx - w0 * mx0 * mx0 - w1 * mx1 * mx1) / w  # within-kind variance of rows
        cxy = (sxy - w0 * mx0 * my0 - w1 * mx1 * my1) / w
        mx = (sx0 + sx1) / w
        spread = max(self.min_spread, 0.02 * mx)
        identified = vxx >= spread * spread
        if identified:
            slope = max(cxy / vxx, 0.0)
        else:
            slope = self._fit.slope if self._fit is not None else 0.0
        intercept = my0 - slope * mx0
        if intercept < 0:  # time would vanish before zero rows: proportional instead
            intercept, slope = 0.0, max(my0, 0.0) / mx0
        wait = max(my1 - slope * mx1 - intercept, 0.0)
        self._wait = wait
        if identified:
            self._fit = LatencyFit(intercept, slope, True)
        return LatencyFit(
            intercept, slope, identified or self._fit is not None, wait, wait_identified=True
        )

    # ------------------------------------------------------------------ choice
    def ready(self) -> bool:
        return self.verdicts >= self.min_verdicts and self.samples >= self.min_samples

    def choose(self, periodic: bool = True) -> float:
        """Re-run the chooser now (done every ``interval`` iterations, and when the load moves:
        ``periodic`` False, which leaves the explore and probe periods' back-off alone unless
        ``alpha`` changes); returns ``alpha``."""
        batch = self._last_batch = self.batch
        self._window[:] = 0.0
        self._last_choice_iteration = self.iteration
        if not self.ready():
            return self.alpha
        profile, latency = self.profile(), self.latency()
        if profile is None or latency is None or batch <= 0:
            return self.alpha
        best, evaluated = choose_alpha(
            self.num_stages,
            batch,
            profile,
            self.latency_curve(latency),
            self.alphas,
            self.model,
            interior_cost=latency.wait,
        )
        self.choices += 1
        current = min(evaluated, key=lambda c: abs(c.alpha - self.alpha))
        self._reversals *= self.decay ** (self.interval / REVERSAL_MEMORY)
        # the current alpha is an incumbent only at the load it was chosen at; a change at
        # another load follows the load (a batch of 512 that drained to 15 wants alpha 0
        # where it wanted 1): not flapping, so it needs only ``margin`` and neither pays nor
        # adds to the reversal backoff
        same_load = one_load(batch, self._last_change_batch)
        margin = self.settled_margin if self.changes > 0 and same_load else self.margin
        step = best.alpha - self.alpha
        reverses = step * self._last_step < 0 and same_load
        if reverses:  # back towards where alpha came from: each recent reversal doubles it
            margin *= self.reversal_backoff ** min(self._reversals, MAX_REVERSAL_DOUBLINGS)
        before = self.alpha
        if step != 0 and best.throughput > current.throughput * (1 + margin):
            self.alpha = best.alpha
            self.changes += 1
            self._reversals += 1.0 if reverses else 0.0
            # leaving the initial guess sets no direction to reverse
            self._last_step = step if self.changes > 1 else 0.0
            self._last_change_batch = batch
            self.last_choice = best
            moved = True
        else:
            self.last_choice = current
            moved = False
        self.last_decision = {
            "iteration": self.iteration,
            "batch": batch,
            "alpha_before": before,
            "alpha": self.alpha,
            "margin": margin,
            "reverses": bool(reverses),
            "reversals": self._reversals,
            "evaluated": [
                {
                    "alpha": c.alpha,
                    "rows": c.rows,
                    "effective": c.effective,
                    "latency_s": c.latency_s,
                    "throughput": c.throughput,
                }
                for c in evaluated
            ],
        }
        if self.alpha >= 1.0 and not moved:
            # alpha 1 stands: explore half as often (an explore iteration there runs every
            # draft, ~B rows instead of B/N, and at low acceptance most are wasted)
            if periodic:
                self.explore_period = min(2 * self.explore_period, self.explore_max)
        else:
            self.explore_period = self._explore_base(self.alpha)
            self._next_explore = min(self._next_explore, self.iteration + self.explore_period)
        if self.alpha == 0.0 and not moved:
            # alpha 0 stands: probe the latency at alpha 1 half as often; where alpha 1 is far
            # behind on a measured fit, at explore_max at once and less often still after
            if periodic and latency.identified and self._one_far_behind(current, evaluated):
                far_max = PROBE_FAR_PERIODS * self.explore_max
                self.probe_period = min(max(2 * self.probe_period, self.explore_max), far_max)
            elif periodic:
                self.probe_period = min(2 * self.probe_period, self.explore_max)
            else:
                # a new load: probe it within explore_max iterations (the long periods are
                # for a load whose rows the fit has measured)
                self.probe_period = min(self.probe_period, self.explore_max)
                self._next_probe = min(self._next_probe, self.iteration + self.probe_period)
        else:
            self.probe_period = self._probe_base
            self._next_probe = self.iteration + self._probe_offset
        self.history.append((self.iteration, self.alpha))
        return self.alpha

    @staticmethod
    def _one_far_behind(current, evaluated) -> bool:
        """Alpha 1 priced at least ``PROBE_FAR_MARGIN`` below the ``current`` choice."""
        one = [c for c in evaluated if c.alpha >= 1.0]
        return bool(one) and one[0].throughput * (1 + PROBE_FAR_MARGIN) <= current.throughput

    def _load_moved(self, running: int) -> bool:
        """The running batch is another load than the last choice's (:func:`one_load`), and
        that choice is :data:`LOAD_CHOICE_GAP` iterations old or more."""
        if self.iteration - self._last_choice_iteration < LOAD_CHOICE_GAP:
            return False
        return min(running, self._last_batch) > 0 and not one_load(running, self._last_batch)

    def as_dict(self) -> dict:
        """Plain-JSON state for ``/server_info`` and benchmarks."""
        prof = self.profile()
        lat = self.latency()
        curve = self.latency_curve(lat)
        last = self.last_choice
        return {
            "alpha": self.alpha,
            "iteration": self.iteration,
            "interval": self.interval,
            "explore": self.explore,
            "explore_period": self.explore_period,
            "probe_period": self.probe_period,
            "probe_iterations": self.probe_iterations,
            "half_life": self.half_life,
            "model": self.model,
            "choices": self.choices,
            "changes": self.changes,
            "reversals": self._reversals,
            "explore_iterations": self.explore_iterations,
            "batch": self.batch,
            "verdicts": self.verdicts,
            "samples": self.samples,
            "profile": list(prof.acceptance) if prof is not None else None,
            "acceptance_by_bin": [None if math.isnan(a) else a for a in self.acceptance_by_bin()],
            "verified_by_bin": self._verified.tolist(),
            "accepted_by_bin": self._accepted.tolist(),
            "decay": self.decay,
            "latency": (
                None
                if lat is None
                else {
                    "intercept_s": lat.intercept,
                    "slope_s": lat.slope,
                    "identified": lat.identified,
                    "wait_s": lat.wait,
                    "wait_identified": lat.wait_identified,
                }
            ),
            "latency_by_rows": self.latency_by_rows(),
            "latency_curve": None if curve is None else [list(k) for k in curve.knots],
            "last_choice": None if last is None else last.__dict__.copy(),
            "history": [list(h) for h in self.history],
        }
