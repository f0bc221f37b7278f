"""Look-ahead admission in the server (paper §5.2): how many waiting requests stage 0 admits.

Stage 0's scheduler asks :class:`AdmissionGate` once per iteration, while requests wait and
others run. The gate feeds :class:`spexis_sglang.core.admission.AdmissionPlanner` with

* each running request's KV footprint (verified tokens plus in-flight positions) and its
  latest remaining-length bucket from the predictor on stage 0 (-1 = no prediction: the
  request is taken to outlive the 64-iteration horizon);
* each waiting request's tokens to prefill (prompt, plus the output of a retracted request);
* the acceptance measured so far, as the look-ahead's ``theta``;
* the KV pool's size, the predictor's calibrated precision per threshold and ``pdr``;

and gets back the number of requests (from the head of the queue) to admit now. The answer
travels to the later stages in the iteration's plan, so every rank admits the same requests.

How many the KV pool allows is the gate's too (:meth:`AdmissionGate.reservation_count`):
SGLang's admission reserves each running request's future tokens (``new_token_ratio``
times what ``max_new_tokens`` leaves) and a new request's whole ``max_new_tokens`` as if
nothing ever finished, so memory that finishing requests are about to free stays idle. The gate
plays the demand forward (:func:`~spexis_sglang.core.admission.reservation_admit_count`) with
each running request's release bounded in time: it has at most ``max_new_tokens - generated``
tokens left (certain), or fewer than its predicted bucket's threshold (when the predictor is
trusted), while a new request grows from its prompt towards its ``max_new_tokens``; time is
counted in tokens per request, since every running request advances at about one rate. The
count it allows is never below SGLang's; Algorithm 1 and ``G`` may still lower it.
Retraction stays the safety net.

No SGLang import: the scheduler passes plain numbers, so the gate is tested without a server.
"""

from __future__ import annotations

import math
from typing import Dict, Optional, Sequence, Tuple

import numpy as np

from spexis_sglang.core.admission import AdmissionPlanner, reservation_admit_count
from spexis_sglang.core.lookahead import LookaheadModel

#: Verdicts worth of the prior acceptance (0.5) blended into the measured one, so the first
#: iterations do not swing between theta = 0 and 1.
PRIOR_VERDICTS = 16
PRIOR_THETA = 0.5
#: theta is rounded to this step so that the look-ahead tables are built a few times, not
#: every iteration.
THETA_STEP = 0.05
#: a remaining-length bucket is taken to bound the request's remaining tokens only if the
#: predictor's calibrated precision for it reaches this (the rest fall back to max_new_tokens)
TRUST_PRECISION = 0.75
#: time is counted in tokens per request: every running request rides every iteration with
#: the same acceptance, so all advance at about one rate, and a request's release (after at
#: most ``bound`` more tokens) is stretched by this factor, plus a token, for the spread
#: between requests and the in-flight rows that drain before its memory is freed
RELEASE_SLACK = 1.25


class AdmissionGate:
    """Look-ahead admission decisions for one server (see the module docstring)."""

    def __init__(
        self,
        num_stages: int,
        capacity: int,
        thresholds: Sequence[int],
        precision: Sequence[Optional[float]],
        pdr: float,
        horizon: int = 64,
    ) -> None:
        if capacity <= 0:
            raise ValueError(f"KV capacity must be > 0 tokens, got {capacity}")
        self.num_stages = int(num_stages)
        self.capacity = int(capacity)
        self.thresholds = tuple(int(t) for t in thresholds)
        # a threshold the calibration could not make precise enough predicts nothing: its
        # precision never matters, 0 is as good as any
        self.precision = tuple(
            0.0 if p is None or not math.isfinite(float(p)) else min(1.0, max(0.0, float(p)))
            for p in precision
        )
        if len(self.precision) != len(self.thresholds):
            raise ValueError(
                f"{len(self.precision)} precision values for {len(self.thresholds)} thresholds"
            )
        self.pdr = float(pdr)
        self.horizon = int(horizon)
        self._planners: Dict[float, AdmissionPlanner] = {}

    @staticmethod
    def theta(accepted: int, rejected: int, dropped: int) -> float:
        """Probability that a token costs one iteration: accepted drafts over every verdict,
        a dropped draft counting as a miss (``(1 - alpha) Theta_alpha``), blended with a
        prior while there are few verdicts."""
        n = accepted + rejected + dropped
        return (accepted + PRIOR_THETA * PRIOR_VERDICTS) / (n + PRIOR_VERDICTS)

    def planner(self, theta: float) -> AdmissionPlanner:
        key = round(round(min(1.0, max(0.0, theta)) / THETA_STEP) * THETA_STEP, 4)
        planner = self._planners.get(key)
        if planner is None:
            model = LookaheadModel(
                self.num_stages, key, self.precision, self.thresholds, horizon=self.horizon
            )
            planner = AdmissionPlanner(model, self.capacity, self.pdr)
            self._planners[key] = planner
        return planner

    def admit_count(
        self,
        lengths: Sequence[int],
        buckets: Sequence[int],
        waiting_tokens: Sequence[int],
        theta: float,
    ) -> int:
        """How many requests from the head of the queue to admit now (all when nothing runs:
        with an empty pipeline there is nothing to evict)."""
        if not waiting_tokens:
            return 0
        if not lengths:
            return len(waiting_tokens)
        return self.planner(theta).decide(lengths, buckets, waiting_tokens).num_admit_now

    @staticmethod
    def head_fits(free: int, head_tokens: int, page: int = 1) -> bool:
        """Whether the queue's first request fits in the free KV memory now. When it does not,
        both counts of :meth:`reservation_count` are 0 whatever the rest (each needs the head's
        prefill plus a page within ``free`` at once), and so is the gate's: the scheduler then
        skips building the projection, which is most iterations of a memory-bound load."""
        return head_tokens + page <= free

    def reservation_count(
        self,
        free: int,
        held: Sequence[int],
        remaining: Sequence[int],
        buckets: Sequence[int],
        ratio: float,
        growth_ratio: float,
        waiting_tokens: Sequence[int],
        waiting_max_new: Sequence[int],
        page: int = 1,
    ) -> Tuple[int, int]:
        """How many requests from the head of the queue the KV pool allows now: the
        projection's count and SGLang's own, ``(n_projection, n_sglang)``.

        Args:
            free: KV tokens free now (available plus evictable).
            held: tokens each running request holds.
            remaining: tokens each running request may still generate (``max_new_tokens``
                minus its output, clipped as SGLang clips it): a certain bound.
            buckets: predicted remaining-length bucket per running request (-1: none).
            ratio: SGLang's ``new_token_ratio``: the share of ``remaining`` it reserves.
            growth_ratio: the share of ``remaining`` the projection expects a running
                request to grow by before its bounded release. SGLang decays its own ratio
                while nothing is retracted; a projection that followed it would admit on
                that optimism and retract (benchmark/README.md, the admission row), so the
                scheduler passes SGLang's initial ratio here. The projection's count is the
                answer on its own, even below SGLang's.
            waiting_tokens: tokens each waiting request prefills.
            waiting_max_new: tokens each waiting request may generate.
            page: KV page size (SGLang reserves one page per admitted request).
        """
        rem = np.asarray(remaining, dtype=float)
        grow = np.ceil(growth_ratio * rem)
        bound = rem.copy()
        b = np.asarray(buckets, dtype=np.int64)
        if b.size:
            taus = np.asarray(self.thresholds, dtype=float)
            trusted = np.asarray(self.precision, dtype=float) >= TRUST_PRECISION
            k = np.clip(b, 0, len(taus) - 1)
            use = (b >= 0) & trusted[k]
            bound = np.where(use, np.minimum(bound, taus[k]), bound)
            grow = np.minimum(grow, bound)
        # in steps of one token per request: released within `bound` tokens, with slack
        finish = np.ceil(RELEASE_SLACK * (bound + 1))
        prompts = np.asarray(waiting_tokens, dtype=float) + page
        grow_new = np.asarray(waiting_max_new, dtype=float)
        n_proj = reservation_admit_count(free, held, grow, finish, prompts, grow_new)
        # SGLang's PrefillAdder: admit while reservations + prompt + max_new + page < free
        cum = float((ratio * rem).sum()) + np.cumsum(prompts + grow_new)
        fits = cum < free
        n_sglang = int(fits.size if fits.all() else fits.argmin())
        return n_proj, n_sglang
