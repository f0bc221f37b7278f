"""The server's look-ahead admission gate (srt/admission_gate.py) on plain numbers."""

from __future__ import annotations

import pytest

from spexis_sglang.srt.admission_gate import PRIOR_THETA, AdmissionGate

THRESHOLDS = (4, 8, 16, 32, 64)


def _gate(capacity=1000, precision=(1.0,) * 5, stages=2):
    return AdmissionGate(stages, capacity, THRESHOLDS, precision, pdr=2.0)


def test_everything_is_admitted_when_nothing_runs_or_it_all_fits():
    gate = _gate()
    assert gate.admit_count([], [], [400, 400, 400], theta=0.7) == 3
    assert gate.admit_count([100, 100], [-1, -1], [50, 50], theta=0.7) == 2
    assert gate.admit_count([100], [-1], [], theta=0.7) == 0


def test_a_request_waits_when_admitting_it_now_costs_an_eviction_that_delay_avoids():
    """Two running requests predicted to end within 16 tokens hold 800 of 1000 slots: a
    300-token prompt now would force an eviction, waiting ~16 iterations would not, and the
    gain G says waiting is faster. With twice the capacity it is admitted at once."""
    plan = _gate(capacity=1000).planner(0.9).decide([400, 400], [2, 2], [300])
    assert not plan[0].admit_now and plan[0].reason == "gain" and plan[0].gain > 1
    assert _gate(capacity=1000).admit_count([400, 400], [2, 2], [300], theta=0.9) == 0
    assert _gate(capacity=2000).admit_count([400, 400], [2, 2], [300], theta=0.9) == 1


def test_a_prefix_of_the_queue_is_admitted_and_later_ones_wait_behind_it():
    # the 100-token prompt fits; the 300-token one would evict; the 10-token one queues
    # behind it (first come, first served)
    assert _gate(capacity=1000).admit_count([300, 300], [2, 2], [100, 300, 10], theta=0.9) == 1


def test_the_count_is_the_core_planners_at_the_rounded_theta():
    gate = _gate(capacity=1000, precision=(0.8, 0.8, 0.85, 0.9, 0.75))
    cases = [
        ([300, 300], [2, -1], [100, 300, 10]),
        ([450, 200, 100], [0, 4, -1], [50, 50, 400]),
        ([900], [-1], [10, 10]),
    ]
    for lengths, buckets, waiting in cases:
        for theta in (0.52, 0.76, 0.93):
            want = gate.planner(theta).decide(lengths, buckets, waiting).num_admit_now
            assert gate.admit_count(lengths, buckets, waiting, theta) == want


def test_theta_is_measured_acceptance_with_a_prior_and_dropped_drafts_count_as_misses():
    assert AdmissionGate.theta(0, 0, 0) == PRIOR_THETA
    assert AdmissionGate.theta(10_000, 0, 0) == pytest.approx(1.0, abs=0.002)
    assert AdmissionGate.theta(5_000, 0, 5_000) == pytest.approx(0.5, abs=0.002)
    assert AdmissionGate.theta(7_000, 3_000, 0) == pytest.approx(0.7, abs=0.002)


def test_planners_are_reused_across_nearby_thetas():
    gate = _gate()
    assert gate.planner(0.701) is gate.planner(0.69)
    assert gate.planner(0.70) is not gate.planner(0.80)


def test_uncalibrated_thresholds_and_bad_inputs():
    gate = _gate(precision=(None, float("nan"), 0.8, 0.8, 0.8))
    assert gate.precision == (0.0, 0.0, 0.8, 0.8, 0.8)
    with pytest.raises(ValueError, match="4 precision values for 5 thresholds"):
        _gate(precision=(0.8,) * 4)
    with pytest.raises(ValueError, match="capacity must be > 0"):
        _gate(capacity=0)


def test_reservation_count_counts_on_certain_finishes_where_sglang_reserves():
    """100 free; one running request holds 150 with 4 tokens left of max_new_tokens (a
    certain finish within a few iterations) and SGLang's ratio 0.7: SGLang's reservation
    (2.8 + 60 + 1 + 96) refuses the 60-token prompt, the projection admits it."""
    gate = _gate(capacity=1000)
    n_proj, n_sglang = gate.reservation_count(100, [150], [4], [-1], 0.7, 0.7, [60], [96])
    assert (n_proj, n_sglang) == (1, 0)
    # with 200 tokens left the request may run far past the new one's growth: both refuse
    assert gate.reservation_count(100, [150], [200], [-1], 0.7, 0.7, [60], [96]) == (0, 0)
    # SGLang's own count: reservations + prompt + page + max_new strictly below free
    two = ([60, 60], [96, 96])
    assert gate.reservation_count(1000, [150], [200], [-1], 0.7, 0.7, *two) == (2, 2)
    assert gate.reservation_count(296, [150], [200], [-1], 0.7, 0.7, *two)[1] == 0


def test_a_trusted_prediction_bounds_the_release_an_untrusted_one_does_not():
    """200 tokens of max_new_tokens left, but predicted to end within 8 (bucket 1): with the
    predictor's precision trusted the memory is released in time for the new request."""
    trusted = _gate(precision=(0.8,) * 5)
    untrusted = _gate(precision=(0.5,) * 5)
    args = (100, [150], [200], [1], 0.7, 0.7, [60], [96])
    assert trusted.reservation_count(*args)[0] == 1
    assert untrusted.reservation_count(*args)[0] == 0


def test_the_projections_own_growth_ratio_answers_alone_even_below_sglangs():
    """SGLang's decayed ratio (0.1) admits the 60-token prompt beside a request with 200
    tokens left; the projection growing it by the initial 0.7 would hold it back."""
    gate = _gate(capacity=1000)
    assert gate.reservation_count(200, [150], [200], [-1], 0.1, 0.1, [60], [96]) == (1, 1)
    assert gate.reservation_count(200, [150], [200], [-1], 0.1, 0.7, [60], [96]) == (0, 1)
    # a certain finish within 4 tokens frees the memory in time: admitted either way
    assert gate.reservation_count(100, [150], [4], [-1], 0.1, 0.7, [60], [96])[0] == 1


@pytest.mark.parametrize("seed", range(40))
def test_when_the_head_does_not_fit_now_neither_count_admits_anything(seed):
    """``head_fits`` is exact where the scheduler uses it to skip the projection: whenever
    it is False, ``reservation_count`` answers (0, 0) whatever the running requests, their
    predictions, the ratios and the rest of the queue."""
    import numpy as np

    rng = np.random.default_rng(seed)
    gate = _gate(capacity=2000, precision=tuple(rng.uniform(0.5, 1.0, 5)))
    running = int(rng.integers(1, 8))
    held = rng.integers(10, 300, running).tolist()
    remaining = rng.integers(0, 300, running).tolist()
    buckets = rng.integers(-1, 5, running).tolist()
    waiting = rng.integers(1, 400, int(rng.integers(1, 6))).tolist()
    max_new = rng.integers(0, 300, len(waiting)).tolist()
    page = int(rng.choice([1, 4, 16]))
    refused = 0
    for free in range(0, 500, 7):
        ratio, growth = rng.uniform(0, 1), rng.uniform(0, 1)
        counts = gate.reservation_count(
            free, held, remaining, buckets, ratio, growth, waiting, max_new, page
        )
        if not AdmissionGate.head_fits(free, waiting[0], page):
            assert counts == (0, 0)
            refused += 1
    assert refused > 0  # free starts at 0: the check was exercised


@pytest.mark.parametrize("page", [1, 4])
def test_head_fits_is_exactly_where_the_projection_starts_admitting(page):
    """Nothing else competing (the running request ends, the new one takes no more than its
    prefill): the projection admits the 60-token head exactly when ``head_fits`` says so."""
    gate = _gate(capacity=1000)
    for free in range(50, 80):
        n_proj = gate.reservation_count(free, [150], [0], [-1], 0.7, 0.7, [60], [0], page)[0]
        assert (n_proj == 1) == AdmissionGate.head_fits(free, 60, page), free
