"""Stage 0's alpha controller driven by SlotState through a simulated pipeline (no SGLang).

The loop below mirrors ``SpexisScheduler``'s order on stage 0: apply the drafts of the batch
launched last, build the next rows, select, launch (``AlphaController.on_launch``), and once
``N`` batches are in flight take the oldest one's true tokens (``on_result``).
"""

from __future__ import annotations

from collections import deque

import numpy as np
import pytest

from spexis_sglang.core.online_alpha import rank_bins
from spexis_sglang.core.slot_state import SlotState, Verdict
from spexis_sglang.srt.sp_alpha import AlphaController
from spexis_sglang.srt.stats import SpexisStats


def true_token(slot: int, position: int) -> int:
    return (slot * 1_000_003 + position * 7_919) % 50_000 + 1


class Pipeline:
    """B requests decoding forever on an N-stage pipeline; a draft of confidence c is right
    with probability c (a calibrated head); one iteration takes ``a + b * rows`` seconds,
    rows being the mean over the batches in the pipe."""

    def __init__(self, ctrl: AlphaController, n: int, b: int, seed: int, a=2.0, slope=0.1):
        self.ctrl, self.n = ctrl, n
        self.st = SlotState(capacity=b + 3, depth=n)
        slots = np.arange(b, dtype=np.int64)
        self.st.admit(slots, 5, [true_token(s, 4) for s in slots])
        self.running = slots
        self.rng = np.random.default_rng(seed)
        self.inflight: deque = deque()
        self.last = None
        self.now, self.a, self.slope = 0.0, a, slope
        ctrl._clock = lambda: self.now
        self.pipe_rows: deque = deque(maxlen=n)
        self.expected_bin: dict = {}  # (slot, position, epoch) of a launched spec row -> bin
        self.checked = 0
        self.iteration = 0
        self.verdicts = {"accepted": 0, "rejected": 0}
        real = ctrl.online.record_verdicts

        def check(bins, accepted):
            assert np.array_equal(bins, self._expect), (bins, self._expect)
            self.checked += len(bins)
            real(bins, accepted)

        ctrl.online.record_verdicts = check

    def step(self) -> None:
        st, ctrl = self.st, self.ctrl
        if self.last is not None:
            r = self.last
            conf = self.rng.random(len(r))
            right = self.rng.random(len(r)) < conf
            truth = np.array([true_token(s, p + 1) for s, p in zip(r.slot, r.position)])
            st.on_draft(r.slot, r.position, r.epoch, np.where(right, truth, truth + 1), conf)
        rows = st.next_rows(self.running)
        spec = rows.is_spec
        cand_bins = rank_bins(st.candidate_confidence(rows.slot[spec])) if spec.any() else []
        bin_of = dict(zip(rows.slot[spec].tolist(), np.asarray(cand_bins).tolist()))
        rows, _ = ctrl.select(st, rows, len(self.running))
        st.on_launch(rows)
        # the time since the previous launch is the previous iteration's: rows then in the pipe
        if self.pipe_rows:
            self.now += self.a + self.slope * np.mean(self.pipe_rows)
        self.iteration += 1
        ctrl.on_launch(rows, self.iteration)
        self.pipe_rows.append(len(rows))
        for s, p, e, sp in zip(rows.slot, rows.position, rows.epoch, rows.is_spec):
            if sp:
                self.expected_bin[(int(s), int(p), int(e))] = bin_of[int(s)]
        self.inflight.append(rows)
        self.last = rows
        if len(self.inflight) == self.n:
            old = self.inflight.popleft()
            verdicts_before = st.verifies_draft(old)
            truth = [true_token(s, p + 1) for s, p in zip(old.slot, old.position)]
            m = verdicts_before
            self._expect = np.array(
                [
                    self.expected_bin[(int(s), int(p) + 1, int(e))]
                    for s, p, e in zip(old.slot[m], old.position[m], old.epoch[m])
                ],
                dtype=np.int64,
            )
            res = st.on_result(truth)
            assert np.array_equal(
                (res.verdict == Verdict.ACCEPTED) | (res.verdict == Verdict.REJECTED), m
            )
            ctrl.on_result(old, res.verdict)
            self.verdicts["accepted"] += int(np.count_nonzero(res.verdict == Verdict.ACCEPTED))
            self.verdicts["rejected"] += int(np.count_nonzero(res.verdict == Verdict.REJECTED))


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("auto", [False, True])
def test_each_verdict_is_credited_to_the_bin_its_draft_was_launched_in(n, auto) -> None:
    ctrl = AlphaController(64, depth=n, num_stages=n, alpha=0.25, auto=auto, interval=20)
    pipe = Pipeline(ctrl, n, b=24, seed=n)
    for _ in range(600):
        pipe.step()
    assert pipe.checked == pipe.verdicts["accepted"] + pipe.verdicts["rejected"] > 1000
    # a calibrated head: the most confident ranks are accepted more often than the least
    acc = ctrl.online.acceptance_by_bin()
    assert acc[0] > acc[-1] + 0.2 if auto else acc[0] > acc[6]


def test_latency_samples_pair_each_period_with_the_rows_in_the_pipe() -> None:
    ctrl = AlphaController(64, depth=2, num_stages=2, auto=True, interval=10**9, explore=4)
    pipe = Pipeline(ctrl, 2, b=32, seed=0, a=2.0, slope=0.1)
    for _ in range(400):
        pipe.step()
    fit = ctrl.online.latency()
    assert fit.identified
    assert fit.intercept == pytest.approx(2.0, rel=1e-6) and fit.slope == pytest.approx(
        0.1, rel=1e-6
    )


def test_a_prefill_between_launches_discards_the_sample() -> None:
    ctrl = AlphaController(8, depth=2, num_stages=2, auto=True)
    t = iter([0.0, 1.0, 2.0, 50.0, 51.0, 52.0])
    ctrl._clock = lambda: next(t)
    st = SlotState(8, depth=2)
    st.admit(np.arange(4), 5, 7)
    rows = st.next_rows()
    ctrl.select(st, rows, 4)
    for it in (1, 2, 3, 7, 8, 9):  # iterations 4-6 were prefills or idle
        ctrl.on_launch(rows, it)
    # samples need depth consecutive launches before them: (2 -> 3) and (8 -> 9) only
    assert ctrl.online.samples == 2.0
    assert ctrl.online._lat[2] == 2.0  # two 1-second periods, not the 48 s gap


def test_auto_moves_alpha_and_fixed_only_observes() -> None:
    stats = SpexisStats()
    auto = AlphaController(64, depth=2, num_stages=2, auto=True, interval=25)
    fixed = AlphaController(64, depth=2, num_stages=2, alpha=0.0)
    for ctrl in (auto, fixed):
        pipe = Pipeline(ctrl, 2, b=32, seed=1, a=0.5, slope=0.1)
        for _ in range(1500):
            pipe.step()
    assert auto.online.choices > 0 and auto.alpha in auto.online.alphas
    assert auto.alpha != 0.15 or auto.online.changes == 0
    assert fixed.alpha == 0.0 and fixed.online.explore_iterations == 0
    d = fixed.as_dict()
    assert d["mode"] == "fixed" and "recommended_alpha" in d
    # the observer at alpha 0 sees every rank: its profile agrees with the explorer's ...
    assert np.allclose(d["profile"], auto.as_dict()["profile"], atol=0.1)
    # ... but at a constant batch its rows never vary: no slope, flat latency, alpha 0
    assert not fixed.online.latency().identified and d["recommended_alpha"] == 0.0
    assert auto.online.latency().identified and auto.alpha > 0.15
    auto.update_stats(stats)
    assert stats.alpha == auto.alpha and stats.alpha_changes == auto.online.changes
    assert stats.as_dict()["alpha"] == auto.alpha
