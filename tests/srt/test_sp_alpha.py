"""Stage 0's alpha controller driven by SlotState through a simulated pipeline (no SGLang).

The loop below mirrors ``SpexisScheduler``'s order on stage 0: apply the drafts of the batch
launched last, build the next rows, select, launch (``AlphaController.on_launch``), and once
``N`` batches are in flight take the oldest one's true tokens (``on_result``). With ``lag``
the drafts' copy to the host lands ``lag`` iterations after their batch's launch, and the
pipeline reads them as the SP loop does: only where a drop depends on them, otherwise it
records placeholders and hands the copy over for a later ranking.
"""

from __future__ import annotations

import io
import json
from collections import deque

import numpy as np
import pytest

from spexis_sglang.core.online_alpha import AUTO_ALPHA_INITIAL, rank_bins
from spexis_sglang.core.slot_state import Rows, SlotState, Verdict
from spexis_sglang.core.sp_stats import SPStats
from spexis_sglang.srt.sp_alpha import AlphaController


def true_token(slot: int, position: int) -> int:
    return (slot * 1_000_003 + position * 7_919) % 50_000 + 1


class DraftCopy:
    """A batch's drafts on their way to the host: landed ``lag`` iterations after launch."""

    def __init__(self, pipe: "Pipeline", rows, conf: np.ndarray, lag: int):
        self.pipe, self.rows, self.conf, self.lands = pipe, rows, conf, pipe.iteration + lag

    def ready(self) -> bool:
        return self.pipe.iteration >= self.lands

    def read(self):
        if not self.ready():  # the SP loop would wait for the copy here
            self.pipe.early_reads.append("result" if self.pipe.in_result else "build")
        return np.zeros(len(self.conf), dtype=np.int64), self.conf, None


class Pipeline:
    """B requests decoding forever on an N-stage pipeline; a draft of confidence c is right
    with probability c (a calibrated head); one iteration takes ``a + b * rows`` seconds,
    rows being the largest batch in the pipe (the stages run theirs at once: the slowest sets
    the pace). ``lag``: see the module docstring (None: every copy has landed at once)."""

    def __init__(
        self, ctrl: AlphaController, n: int, b: int, seed: int, a=2.0, slope=0.1, lag=None
    ):
        self.ctrl, self.n, self.lag = ctrl, n, lag
        self.wait = 0.0  # seconds an iteration waits where its drops depend on confidences
        # reads of a copy before it landed: while building a batch, or while crediting a
        # result's verdicts (whose batch came back from the last stage: its successor's
        # drafts, queued right behind it on stage 0, have landed on a device)
        self.early_reads: list = []
        self.in_result = False
        self.st = SlotState(capacity=b + 3, depth=n)
        slots = np.arange(b, dtype=np.int64)
        self.st.admit(slots, 5, [true_token(s, 4) for s in slots])
        self.running = slots
        self.rng = np.random.default_rng(seed)
        self.inflight: deque = deque()
        self.last = None
        self.now, self.a, self.slope = 0.0, a, slope
        # which batch in the pipe sets the time between two launches: the largest, or the
        # oldest (the SP loop's launch waits for the true tokens of the oldest one)
        self.pace = max
        ctrl._clock = lambda: self.now
        self.pipe_rows: deque = deque(maxlen=n)
        self.expected_bin: dict = {}  # (slot, position, epoch) of a launched spec row -> bin
        self.checked = 0
        self.iteration = 0
        self.verdicts = {"accepted": 0, "rejected": 0}
        self.unobserved = 0  # verdicts of drafts launched on iterations not observed
        self.dropped: list = []  # each iteration's dropped slots
        real = ctrl.online.record_verdicts

        self.weights: set = set()

        def check(bins, accepted, weight=1.0):
            self._recorded = True
            assert np.array_equal(bins, self._expect), (bins, self._expect)
            self.checked += len(bins)
            self.weights.update(np.unique(np.atleast_1d(weight)).tolist())
            real(bins, accepted, weight)

        ctrl.online.record_verdicts = check

    def step(self) -> None:
        st, ctrl = self.st, self.ctrl
        own = np.ones(st.capacity)  # a draft's confidence not recorded in SlotState yet
        ctrl.land_deferred(st)  # as the SP loop, before it records new drafts
        if self.last is not None:
            r = self.last
            conf = self.rng.random(len(r))
            right = self.rng.random(len(r)) < conf
            truth = np.array([true_token(s, p + 1) for s, p in zip(r.slot, r.position)])
            drafts = np.where(right, truth, truth + 1)
            if self.lag is None or ctrl.needs_confidences():
                ctrl.confidences_real = True
                st.on_draft(r.slot, r.position, r.epoch, drafts, conf)
            else:  # placeholders, as the SP loop records without reading
                ctrl.confidences_real = False
                ok = st.on_draft(r.slot, r.position, r.epoch, drafts, np.ones(len(r)))
                if ctrl.wants_confidences():
                    copy = DraftCopy(self, r, conf, self.lag)
                    ctrl.defer_confidences(copy, r.slot[ok], np.flatnonzero(ok))
                    own[r.slot[ok]] = conf[ok]
        rows = st.next_rows(self.running)
        spec = rows.is_spec
        cs = rows.slot[spec]
        cand_bins = rank_bins(st.candidate_confidence(cs) * own[cs]) if spec.any() else []
        bin_of = dict(zip(rows.slot[spec].tolist(), np.asarray(cand_bins).tolist()))
        rows, dropped, _ = ctrl.select(st, rows, len(self.running))
        self.dropped.append(dropped.tolist())
        observed = ctrl._observed
        st.on_launch(rows)
        # the time since the previous launch is the previous iteration's: rows then in the pipe,
        # and this iteration's wait for the confidences where its drops depended on them
        if self.pipe_rows:
            self.now += self.a + self.slope * self.pace(self.pipe_rows)
            if 0.0 < ctrl.iteration_alpha < 1.0:
                self.now += self.wait
        self.iteration += 1
        ctrl.on_launch(rows, self.iteration)
        self.pipe_rows.append(len(rows))
        for s, p, e, sp in zip(rows.slot, rows.position, rows.epoch, rows.is_spec):
            if sp:
                # -1: launched on an iteration the controller did not observe
                self.expected_bin[(int(s), int(p), int(e))] = bin_of[int(s)] if observed else -1
        self.inflight.append(rows)
        self.last = rows
        if len(self.inflight) == self.n:
            old = self.inflight.popleft()
            verdicts_before = st.verifies_draft(old)
            truth = [true_token(s, p + 1) for s, p in zip(old.slot, old.position)]
            m = verdicts_before
            expect = np.array(
                [
                    self.expected_bin[(int(s), int(p) + 1, int(e))]
                    for s, p, e in zip(old.slot[m], old.position[m], old.epoch[m])
                ],
                dtype=np.int64,
            )
            self.unobserved += int(np.count_nonzero(expect < 0))
            self._expect = expect[expect >= 0]
            res = st.on_result(truth)
            assert np.array_equal(
                (res.verdict == Verdict.ACCEPTED) | (res.verdict == Verdict.REJECTED), m
            )
            self._recorded = False
            self.in_result = True
            ctrl.on_result(old, res.verdict)
            self.in_result = False
            # a result the controller skipped holds no verdict it should have credited
            assert self._recorded or self._expect.size == 0
            self.verdicts["accepted"] += int(np.count_nonzero(res.verdict == Verdict.ACCEPTED))
            self.verdicts["rejected"] += int(np.count_nonzero(res.verdict == Verdict.REJECTED))


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("auto", [False, True])
def test_each_verdict_is_credited_to_the_bin_its_draft_was_launched_in(n, auto) -> None:
    ctrl = AlphaController(64, depth=n, num_stages=n, alpha=0.25, auto=auto, interval=20)
    pipe = Pipeline(ctrl, n, b=24, seed=n)
    for _ in range(600):
        pipe.step()
    # alpha inside (0, 1): the confidences are read for the drops, every iteration observed
    assert pipe.checked == pipe.verdicts["accepted"] + pipe.verdicts["rejected"] > 1000
    assert pipe.unobserved == 0 and pipe.weights == {1.0}
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


def test_the_launch_log_says_what_each_sample_was_set_against() -> None:
    ctrl = AlphaController(8, depth=2, num_stages=2, auto=True)
    ctrl.sample_log = io.StringIO()
    t = iter([0.0, 1.0, 3.0, 50.0])
    ctrl._clock = lambda: next(t)
    st = SlotState(8, depth=2)
    st.admit(np.arange(4), 5, 7)
    rows = st.next_rows()
    ctrl.select(st, rows, 4)
    for it in (1, 2, 3, 7):
        ctrl.on_launch(rows, it)
    lines = [json.loads(x) for x in ctrl.sample_log.getvalue().splitlines()]
    assert [x["iteration"] for x in lines] == [1, 2, 3, 7]
    assert [x["sampled"] for x in lines] == [False, False, True, False]
    assert lines[2]["seconds"] == pytest.approx(2.0) and lines[2]["pipe_rows"] == [4, 4]
    assert lines[0]["seconds"] is None and lines[3]["pipe_rows"] == []
    assert all(x["rows"] == 4 and x["alpha"] == ctrl.iteration_alpha for x in lines)
    assert ctrl.online.samples == 1.0


def test_auto_moves_alpha_and_fixed_only_observes() -> None:
    stats = SPStats()
    auto = AlphaController(64, depth=2, num_stages=2, auto=True, interval=25)
    fixed = AlphaController(64, depth=2, num_stages=2, alpha=0.0)
    for ctrl in (auto, fixed):
        pipe = Pipeline(ctrl, 2, b=32, seed=1, a=2.0, slope=0.1)
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
    # an interior optimum here (0.6): the grid goes on to 1, where time is proportional to rows
    assert auto.online.latency().identified and 0.15 < auto.alpha < 1.0
    auto.update_stats(stats)
    assert stats.alpha == auto.alpha and stats.alpha_changes == auto.online.changes
    assert stats.alpha_probe_iterations == auto.online.probe_iterations
    assert stats.as_dict()["alpha"] == auto.alpha


@pytest.mark.parametrize("wait, inside", [(0.1, True), (1.0, False)])
def test_auto_charges_an_interior_alpha_its_wait_for_confidences(wait, inside) -> None:
    """Where the drops depend on confidences (alpha inside (0, 1)) an iteration waits
    ``wait`` seconds for them; at alpha 0 or 1, and on explore iterations, it does not. The
    controller measures that wait apart from the cost of rows and keeps an interior alpha
    only while it pays for it: here a 0.6 optimum without the wait (the test above) still
    wins at 0.1 s, and at 1 s stock PP's schedule (alpha 1) does."""
    ctrl = AlphaController(64, depth=2, num_stages=2, auto=True, interval=25)
    pipe = Pipeline(ctrl, 2, b=32, seed=1, a=2.0, slope=0.1)
    pipe.wait = wait
    for _ in range(1500):
        pipe.step()
    fit = ctrl.online.latency()
    assert fit.wait_identified and fit.wait == pytest.approx(wait, rel=1e-6)
    assert fit.intercept == pytest.approx(2.0, rel=1e-6)
    assert fit.slope == pytest.approx(0.1, rel=1e-6)
    assert (0.0 < ctrl.alpha < 1.0) == inside and (inside or ctrl.alpha == 1.0)
    assert ctrl.as_dict()["latency"]["wait_s"] == pytest.approx(wait, rel=1e-6)


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("alpha", [0.0, 0.25])
def test_fixed_alpha_observes_a_sample_and_drops_the_same_rows(n, alpha) -> None:
    """``observe_every``: the same drops; only the drafts launched on observed iterations are
    credited, each as ``observe_every`` drafts; the profile estimates the same acceptance."""
    every = 4
    full = AlphaController(64, depth=n, num_stages=n, alpha=alpha)
    sampled = AlphaController(64, depth=n, num_stages=n, alpha=alpha, observe_every=every)
    pipes = []
    for ctrl in (full, sampled):
        pipe = Pipeline(ctrl, n, b=24, seed=n)
        for _ in range(800):
            pipe.step()
        pipes.append(pipe)
    p_full, p_sampled = pipes
    assert p_sampled.dropped == p_full.dropped
    assert (alpha > 0) == any(p_full.dropped)
    total = p_sampled.verdicts["accepted"] + p_sampled.verdicts["rejected"]
    assert p_sampled.checked + p_sampled.unobserved == total
    assert 0.15 * total < p_sampled.checked < 0.35 * total  # ~1/4 of the drafts
    assert p_sampled.weights == {float(every)}
    # weighted, the decayed counts keep their scale
    assert sampled.online.verdicts == pytest.approx(full.online.verdicts, rel=0.3)
    assert sampled.online.samples == pytest.approx(full.online.samples, rel=0.3)
    assert np.allclose(sampled.as_dict()["profile"], full.as_dict()["profile"], atol=0.15)


@pytest.mark.parametrize("alpha", [0.0, 1.0])
def test_auto_at_zero_or_one_observes_its_explore_iterations(alpha) -> None:
    ctrl = AlphaController(64, depth=2, num_stages=2, auto=True, interval=10**9, observe_every=3)
    assert ctrl.observe_every == 8  # its explore period, whatever --spexis-alpha-observe says
    ctrl.online.alpha = alpha
    pipe = Pipeline(ctrl, 2, b=24, seed=3)
    for _ in range(400):
        pipe.step()
    total = pipe.verdicts["accepted"] + pipe.verdicts["rejected"]
    assert pipe.checked + pipe.unobserved == total and pipe.checked > 0
    assert pipe.weights == {8.0}
    if alpha == 0.0:  # at alpha 1 only the explore iterations launch drafts at all
        assert total > 1000 and 0.05 * total < pipe.checked < 0.25 * total
        # every rank launched on those iterations: a calibrated head's profile falls with rank
        acc = ctrl.online.acceptance_by_bin()
        assert acc[0] > acc[-1] + 0.2
    every = AlphaController(64, depth=2, num_stages=2, auto=True, interval=20, explore=0)
    assert every.observe_every == 1
    pipe = Pipeline(every, 2, b=24, seed=3)
    for _ in range(300):
        pipe.step()
    assert pipe.unobserved == 0 and pipe.weights == {1.0}
    with pytest.raises(ValueError):
        AlphaController(8, depth=2, num_stages=2, observe_every=0)


def _waits(ctrl: AlphaController, iterations: int) -> list:
    """The iterations (1-based) before which the loop must wait for the drafts' confidences."""
    waits = []
    for _ in range(iterations):
        if ctrl.needs_confidences():
            waits.append(ctrl.online.iteration + 1)
        ctrl.online.next_iteration(running=32)
    return waits


def _observes(ctrl: AlphaController, iterations: int) -> list:
    """The iterations (1-based) that observe without their drops needing the confidences."""
    observes = []
    for _ in range(iterations):
        if ctrl.wants_confidences() and not ctrl.needs_confidences():
            observes.append(ctrl.online.iteration + 1)
        ctrl.online.next_iteration(running=32)
    return observes


@pytest.mark.parametrize("alpha", [0.0, 1.0])
def test_auto_at_zero_or_one_never_waits_and_observes_its_explore_iterations(alpha) -> None:
    """At alpha 0 or 1 the drops do not depend on confidences: stage 0 never waits for them.
    Its explore iterations observe, ranking their candidates once the drafts have landed."""
    ctrl = AlphaController(64, depth=2, num_stages=2, auto=True, interval=20, explore=8)
    ctrl.online.alpha = alpha
    assert _waits(ctrl, 80) == []
    ctrl = AlphaController(64, depth=2, num_stages=2, auto=True, interval=20, explore=8)
    ctrl.online.alpha = alpha
    assert _observes(ctrl, 80) == [8, 16, 24, 32, 40, 48, 56, 64, 72, 80]
    assert ctrl.online.alpha == alpha  # nothing measured: the chooser kept it


@pytest.mark.parametrize("lag", [1, 2, 10**9])
@pytest.mark.parametrize("auto, alpha", [(True, 0.0), (True, 1.0), (False, 0.0)])
def test_observing_without_waiting_credits_the_ranks_an_immediate_read_gives(
    lag, auto, alpha
) -> None:
    """The drafts' copy lands ``lag`` iterations after their batch (never, with 10**9): an
    observed iteration at alpha 0 or 1 ranks its candidates later, and every verdict is
    credited to the bin an immediate read would have given (``Pipeline``'s check). A copy is
    read before it lands only when a verdict needs its rank, never while a batch is built."""
    n = 2
    ctrl = AlphaController(
        64, depth=n, num_stages=n, alpha=alpha, auto=auto, interval=10**9, observe_every=4
    )
    ctrl.online.alpha = alpha
    pipe = Pipeline(ctrl, n, b=24, seed=7, lag=lag)
    for _ in range(600):
        pipe.step()
    assert ctrl.online.alpha == alpha
    assert pipe.checked > 0 and ctrl.deferred_rankings > 0
    total = pipe.verdicts["accepted"] + pipe.verdicts["rejected"]
    assert pipe.checked + pipe.unobserved == total
    assert "build" not in pipe.early_reads
    if lag <= n - 1:  # landed before any verdict needs it: read at the next build
        assert ctrl.deferred_forced == 0 and pipe.early_reads == []
    else:
        assert ctrl.deferred_forced == len(pipe.early_reads) > 0
    if alpha == 0.0:  # every rank launched on the observed iterations: the profile falls
        acc = ctrl.online.acceptance_by_bin()
        assert acc[0] > acc[-1] + 0.2
    immediate = AlphaController(
        64, depth=n, num_stages=n, alpha=alpha, auto=auto, interval=10**9, observe_every=4
    )
    immediate.online.alpha = alpha
    ref = Pipeline(immediate, n, b=24, seed=7)
    for _ in range(600):
        ref.step()
    # the same drafts observed, the same verdicts credited
    assert ref.checked == pipe.checked and immediate.deferred_rankings == 0
    assert immediate.online.verdicts == pytest.approx(ctrl.online.verdicts)


@pytest.mark.parametrize("n", [2, 3])
def test_inside_zero_one_the_drops_are_those_of_immediate_reads(n) -> None:
    """Inside (0, 1) ``auto`` waits for the confidences except on its explore iterations,
    which rank their drafts once they land. The confidences that land are written back, so
    every later iteration drops the very drafts it would have dropped had the explore
    iteration waited for them."""
    dropped = []
    for lag in (None, 1):
        ctrl = AlphaController(64, depth=n, num_stages=n, auto=True, interval=10**9)
        ctrl.online.alpha = 0.3
        pipe = Pipeline(ctrl, n, b=24, seed=11, lag=lag)
        for _ in range(400):
            pipe.step()
        assert ctrl.alpha == 0.3 and ctrl.online.explore_iterations >= 40
        explores = ctrl.online.explore_iterations
        if lag is None:
            assert ctrl.deferred_rankings == 0
        else:  # each explore iteration's, but the last ones, whose copy may still be out
            assert explores - n <= ctrl.deferred_rankings <= explores
        dropped.append(pipe.dropped)
    assert sum(map(len, dropped[0])) > 1000
    assert dropped[1] == dropped[0]


def test_auto_at_alpha_one_observes_rarely_and_never_waits() -> None:
    """Where a stage's time is proportional to its rows alpha goes to 1; its explore period
    then backs off to 64, so stage 0 observes 1 iteration in 64, and never waits."""
    ctrl = AlphaController(64, depth=2, num_stages=2, auto=True, interval=20)
    pipe = Pipeline(ctrl, 2, b=32, seed=5, a=0.0, slope=0.1)
    for _ in range(3000):
        pipe.step()
    assert ctrl.alpha == 1.0 and ctrl.online.explore_period == 64
    waits = observes = 0
    for _ in range(640):
        waits += ctrl.needs_confidences()
        observes += ctrl.wants_confidences()
        pipe.step()
    assert waits == 0 and observes == 10 and ctrl.alpha == 1.0 and pipe.unobserved == 0


def test_auto_at_alpha_zero_probes_and_follows_a_stage_turned_proportional() -> None:
    """At alpha 0 a steady batch's rows do not vary; the controller's probe iterations (alpha
    1) let it see a stage's time turn proportional to its rows, and alpha goes to 1. A probe
    needs no confidences and observes no drafts."""
    ctrl = AlphaController(64, depth=2, num_stages=2, auto=True, interval=20)
    pipe = Pipeline(ctrl, 2, b=32, seed=5, a=2.0, slope=1e-4)
    for _ in range(2000):
        pipe.step()
    # a flat stage: alpha 1 far behind, the probes at their longest period
    assert ctrl.alpha == 0.0 and ctrl.online.probe_period == 256
    probes, waits, observes = ctrl.online.probe_iterations, 0, 0
    for _ in range(640):
        waits += ctrl.needs_confidences()
        observes += ctrl.wants_confidences()
        pipe.step()
    # two or three probes of depth + 1 iterations (so that some samples see only probe batches)
    probed = ctrl.online.probe_iterations - probes
    assert probed in (2 * (ctrl.depth + 1), 3 * (ctrl.depth + 1)) and waits == 0
    assert observes == 80  # its explore iterations
    pipe.a, pipe.slope = 0.0, 0.1
    for _ in range(3000):
        pipe.step()
    assert ctrl.alpha == 1.0


@pytest.mark.parametrize("probe_length", [None, 2])
def test_probes_in_a_deeper_pipe_paced_by_its_oldest_batch(probe_length) -> None:
    """Three batches in flight on two stages (the SP loop keeps N + 1), each launch
    waiting for the oldest one's tokens: samples around a probe, paced by a full batch and
    a probe batch both, are left out, and a probe one longer than the pipe gives samples of
    probe batches alone, so alpha follows a stage turned proportional to its rows. A probe
    of N = 2 iterations never fills the pipe: alpha stays at 0."""
    ctrl = AlphaController(64, depth=3, num_stages=2, auto=True, interval=20)
    if probe_length is not None:
        ctrl.online.probe_length = probe_length
    pipe = Pipeline(ctrl, 3, b=32, seed=5, a=2.0, slope=1e-4)  # flat: alpha 0
    pipe.pace = lambda rows: rows[0]
    for _ in range(2000):
        pipe.step()
    assert ctrl.alpha == 0.0
    probes = ctrl.online.probe_iterations
    pipe.a, pipe.slope = 0.0, 0.1
    for _ in range(3000):
        pipe.step()
    assert ctrl.online.probe_iterations > probes
    small = [x for x, _, w in ctrl.online.latency_by_rows() if x < 24 and w > 0.01]
    if probe_length is None:
        assert ctrl.online.probe_length == 4 and ctrl.alpha == 1.0
    else:  # no sample ever saw the probes' B/N rows alone
        assert ctrl.alpha == 0.0 and not small


def test_at_alpha_one_no_sample_mixes_an_explore_with_other_batches() -> None:
    """At alpha 1 an explore iteration runs alpha 0's B rows among B/N-row batches; a launch
    waits for the oldest batch's tokens, so a pipe holding both was paced by whichever came
    first (on the box two probe-sized batches and a full one took 11 ms where full ones took
    21). No such pipe becomes a latency sample; the pipes of B/N-row batches alone do."""
    ctrl = AlphaController(64, depth=2, num_stages=2, auto=True, interval=20)
    ctrl.sample_log = io.StringIO()
    pipe = Pipeline(ctrl, 2, b=32, seed=5, a=0.0, slope=0.1)
    for _ in range(600):
        pipe.step()
    assert ctrl.alpha == 1.0
    warm_up = len(ctrl.sample_log.getvalue().splitlines())
    for _ in range(1000):
        pipe.step()
    lines = [json.loads(x) for x in ctrl.sample_log.getvalue().splitlines()]
    # every choice is logged between the launches, with what the chooser compared
    decisions = [x["choice"] for x in lines if "choice" in x]
    assert len(decisions) == ctrl.online.choices > 0
    assert decisions[-1]["alpha"] == 1.0 and decisions[0]["alpha_before"] == AUTO_ALPHA_INITIAL
    assert [c["alpha"] for c in decisions[-1]["evaluated"]] == list(ctrl.online.alphas)
    assert decisions[-1]["batch"] == pytest.approx(32, abs=1)
    lines = [x for x in lines[warm_up:] if "choice" not in x]
    mixed = sampled = 0
    for i in range(2, len(lines)):
        pipe_explores = [lines[j]["explore"] for j in (i - 2, i - 1)]
        if any(pipe_explores) and not all(pipe_explores):
            mixed += 1
            assert not lines[i]["sampled"], lines[i - 2 : i + 1]
        elif lines[i]["alpha"] == 1.0:
            sampled += lines[i]["sampled"]
    assert ctrl.alpha == 1.0 and mixed >= 10 and sampled > 500


def test_auto_inside_zero_one_and_fixed_alpha_wait_where_drops_need_them() -> None:
    inside = AlphaController(64, depth=2, num_stages=2, auto=True, interval=20, explore=8)
    inside.online.alpha = 0.3
    # an explore iteration (every 8th) drops nothing and does not wait, unless the chooser
    # runs on it (every 20th: it may keep alpha inside)
    assert _waits(inside, 40) == [i for i in range(1, 41) if i not in (8, 16, 24, 32)]
    for alpha, waits in ((0.0, []), (0.3, list(range(1, 41))), (1.0, [])):
        fixed = AlphaController(64, depth=2, num_stages=2, alpha=alpha)
        assert _waits(fixed, 40) == waits, alpha


def test_weighted_records_count_as_repeated_ones() -> None:
    from spexis_sglang.core.online_alpha import OnlineAlpha

    a, b = OnlineAlpha(2, explore=0), OnlineAlpha(2, explore=0)
    bins, acc = np.array([0, 3, 3, 9]), np.array([True, False, True, True])
    a.record_verdicts(bins, acc, 3.0)
    for _ in range(3):
        b.record_verdicts(bins, acc)
    assert np.allclose(a._verified, b._verified) and np.allclose(a._accepted, b._accepted)
    for rows, sec in ((10.0, 1.0), (20.0, 1.5), (40.0, 2.2)):
        a.record_iteration(rows, sec, 2.0)
        b.record_iteration(rows, sec)
        b.record_iteration(rows, sec)
    assert np.allclose(a._lat, b._lat)


def _drafts_wanted(ctrl: AlphaController, iterations: int) -> list:
    """The iterations (1-based) whose batch makes its drafts."""
    st = SlotState(capacity=8, depth=ctrl.depth)
    wanted = []
    for _ in range(iterations):
        ctrl.select(st, Rows.empty(), running=4)
        if ctrl.drafts_wanted():
            wanted.append(ctrl.online.iteration)
    return wanted


def test_drafts_are_made_only_near_an_iteration_that_may_use_them() -> None:
    """At alpha 1 a batch makes its drafts only within ``depth + 1`` iterations of one that
    may launch rows on them unverified or credit their verdicts: an explore iteration, a
    choice (which may leave alpha 1) or, with a fixed alpha, an observed iteration.
    Elsewhere, and at any alpha below 1, every batch makes them."""
    auto = AlphaController(64, depth=2, num_stages=2, auto=True, interval=10**6, explore=16)
    auto.online.alpha = 1.0
    assert _drafts_wanted(auto, 50) == [13, 14, 15, 16, 29, 30, 31, 32, 45, 46, 47, 48]
    choosing = AlphaController(64, depth=2, num_stages=2, auto=True, interval=20, explore=64)
    choosing.online.alpha = 1.0
    assert _drafts_wanted(choosing, 60) == [17, 18, 19, 37, 38, 39, 57, 58, 59]
    fixed = AlphaController(64, depth=2, num_stages=2, alpha=1.0, observe_every=8)
    assert _drafts_wanted(fixed, 16) == [5, 6, 7, 8, 13, 14, 15, 16]
    every = AlphaController(64, depth=2, num_stages=2, alpha=1.0, observe_every=1)
    assert _drafts_wanted(every, 10) == list(range(1, 11))
    for ctrl in (
        AlphaController(64, depth=2, num_stages=2, alpha=0.3),
        AlphaController(64, depth=2, num_stages=2, auto=True, interval=20),  # starts inside
    ):
        assert _drafts_wanted(ctrl, 30) == list(range(1, 31))
