"""Eq. 1-4 and Table 1: recurrences against closed forms, edge cases, latency tables."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from spexis_sglang.core.cost_model import (
    LatencyTable,
    b_alpha_star,
    b_eff_alpha_star,
    b_eff_star,
    eq1_invariant,
    eq1_limit,
    lookahead_theta,
    simulate_eq1,
    simulate_eq3,
    sp_alpha_exact,
    sp_alpha_paper,
    throughput_pp,
    throughput_sp,
    throughput_sp_alpha,
    throughput_tp,
)

STAGES = (2, 3, 4, 8)
THETAS = (0.05, 0.1, 0.25, 0.4, 0.5, 0.6, 0.75, 0.9, 0.95, 0.99)
ALPHAS = (0.0, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5)


def _steps_to_converge(n: int, theta: float, tol: float = 1e-10) -> int:
    """Iterations for the slowest transient of e_t = th e_{t-1} + (1-th) e_{t-N} to decay."""
    coeffs = np.zeros(n + 1)
    coeffs[0], coeffs[1], coeffs[n] = 1.0, -theta, -(1.0 - theta)
    mods = sorted(abs(np.roots(coeffs)))
    second = mods[-2]
    return int(math.log(tol) / math.log(second)) + 10 * n


@pytest.mark.parametrize("n", STAGES)
@pytest.mark.parametrize("theta", THETAS)
def test_eq1_recurrence_converges_to_eq2(n: int, theta: float) -> None:
    batch = 256.0
    steps = _steps_to_converge(n, theta)
    tr = simulate_eq1(n, theta, steps, batch=batch)
    assert np.allclose(tr.total, batch, rtol=0, atol=1e-9)  # appendix A.1 conservation
    assert tr.b_eff[-1] == pytest.approx(b_eff_star(batch, n, theta), rel=1e-8)
    assert tr.s_r[-1] == pytest.approx(batch - b_eff_star(batch, n, theta), rel=1e-7)


@pytest.mark.parametrize("n", STAGES)
def test_eq1_theta_one_keeps_full_batch(n: int) -> None:
    tr = simulate_eq1(n, 1.0, 50, batch=100.0)
    assert np.all(tr.b_eff == 100.0) and np.all(tr.s_r == 0.0)
    assert b_eff_star(100.0, n, 1.0) == 100.0


@pytest.mark.parametrize("n", STAGES)
def test_eq1_theta_zero_cycles_with_mean_b_over_n(n: int) -> None:
    """Theta = 0 has no limit: one normal row then N-1 wasted rows; the mean is Eq. 2's B/N."""
    tr = simulate_eq1(n, 0.0, 10 * n, batch=60.0)
    expect = np.zeros(10 * n)
    expect[n - 1 :: n] = 60.0  # t = N, 2N, ... (index t - 1)
    assert np.array_equal(tr.b_eff, expect)
    assert tr.b_eff.mean() == pytest.approx(b_eff_star(60.0, n, 0.0))
    assert np.allclose(tr.total, 60.0)


@settings(max_examples=60, deadline=None)
@given(
    n=st.sampled_from(STAGES),
    theta=st.floats(0.2, 0.95),
    start=st.lists(st.floats(0.0, 100.0), min_size=8, max_size=8),
)
def test_eq1_any_start_state_converges_to_invariant_over_eq2(
    n: int, theta: float, start: list[float]
) -> None:
    hist = start[:n]
    inv = eq1_invariant(n, theta, hist)
    steps = _steps_to_converge(n, theta)
    tr = simulate_eq1(n, theta, steps, start=hist)
    assert np.allclose(tr.total, inv, atol=1e-7 * max(1.0, inv))
    assert tr.b_eff[-1] == pytest.approx(eq1_limit(n, theta, hist), rel=1e-7, abs=1e-7)


def test_eq1_time_varying_theta_conserves_batch() -> None:
    rng = np.random.default_rng(0)
    n, steps = 4, 300
    th = rng.uniform(0.3, 0.9, steps + n)
    tr = simulate_eq1(n, th, steps, batch=128.0)
    assert np.allclose(tr.total, 128.0)


def test_eq1_hand_computed_first_steps() -> None:
    """N = 2, Theta = 0.5, B = 8: e = 8, 4, 6, 5, 5.5 (e_t = e_{t-1}/2 + e_{t-2}/2)."""
    tr = simulate_eq1(2, 0.5, 4, batch=8.0)
    assert np.allclose(tr.b_eff, [4.0, 6.0, 5.0, 5.5])
    assert np.allclose(tr.s_a, [4.0, 2.0, 3.0, 2.5])
    assert np.allclose(tr.n, [0.0, 4.0, 2.0, 3.0])
    assert b_eff_star(8.0, 2, 0.5) == pytest.approx(8 / 1.5)


def test_single_stage_is_plain_decoding() -> None:
    assert b_eff_star(50.0, 1, 0.3) == 50.0
    assert np.allclose(simulate_eq1(1, 0.3, 10, batch=50.0).b_eff, 50.0)
    assert sp_alpha_exact(50.0, 1, 0.3, 0.2).effective == pytest.approx(50.0)


@pytest.mark.parametrize("n", STAGES)
@pytest.mark.parametrize("alpha", ALPHAS)
def test_eq3_recurrence_converges(n: int, alpha: float) -> None:
    b = simulate_eq3(n, alpha, 100.0, 20000)
    assert b[-1] == pytest.approx(b_alpha_star(100.0, n, alpha), rel=1e-9)


@pytest.mark.parametrize("n", STAGES)
@pytest.mark.parametrize("theta", (0.0, 0.3, 0.634, 0.785, 1.0))
def test_eq4_and_exact_reduce_to_eq2_without_drops(n: int, theta: float) -> None:
    ref = b_eff_star(300.0, n, theta)
    assert b_eff_alpha_star(300.0, n, theta, 0.0) == pytest.approx(ref)
    ex = sp_alpha_exact(300.0, n, theta, 0.0)
    assert ex.effective == pytest.approx(ref) and ex.rows == pytest.approx(300.0)


@pytest.mark.parametrize("n", STAGES)
@pytest.mark.parametrize("alpha", ALPHAS)
@pytest.mark.parametrize("theta", (0.0, 1.0))
def test_eq4_is_exact_at_theta_edges(n: int, alpha: float, theta: float) -> None:
    """At Theta in {0, 1} drops and rejections cannot interact, so Eq. 4 is exact."""
    ex = sp_alpha_exact(100.0, n, theta, alpha)
    assert b_eff_alpha_star(100.0, n, theta, alpha) == pytest.approx(ex.effective, rel=1e-12)
    if theta == 1.0:
        assert b_alpha_star(100.0, n, alpha) == pytest.approx(ex.rows, rel=1e-12)


@pytest.mark.parametrize("n", STAGES)
@pytest.mark.parametrize("alpha", (0.1, 0.2, 0.3, 0.5))
@pytest.mark.parametrize("theta", (0.3, 0.6, 0.8))
def test_eq4_underestimates_the_exact_steady_state(n: int, alpha: float, theta: float) -> None:
    """The simplifying assumption of §5.1 always errs low in the interior (documented)."""
    ex = sp_alpha_exact(100.0, n, theta, alpha)
    pa = sp_alpha_paper(100.0, n, theta, alpha)
    assert pa.effective < ex.effective
    assert pa.rows < ex.rows


@pytest.mark.parametrize(
    "n,theta,alpha,eff_ratio,rows_ratio",
    [
        (2, 0.70, 0.20, 0.9785, 0.9677),
        (2, 0.80, 0.15, 0.9852, 0.9810),
        (4, 0.70, 0.20, 0.9005, 0.9145),
        (4, 0.60, 0.30, 0.8915, 0.8939),
        (8, 0.70, 0.20, 0.7787, 0.8725),
    ],
)
def test_documented_eq4_error_table(
    n: int, theta: float, alpha: float, eff_ratio: float, rows_ratio: float
) -> None:
    """The table in ``sp_alpha_exact``'s docstring matches the formulas (4 decimals)."""
    ex = sp_alpha_exact(1.0, n, theta, alpha)
    pa = sp_alpha_paper(1.0, n, theta, alpha)
    assert pa.effective / ex.effective == pytest.approx(eff_ratio, abs=6e-5)
    assert pa.rows / ex.rows == pytest.approx(rows_ratio, abs=6e-5)


@pytest.mark.parametrize("n", [2, 3, 4])
def test_dropping_every_draft_runs_like_pp(n) -> None:
    """alpha = 1: a request advances one token every N iterations with one row each time."""
    for state in (sp_alpha_exact(12, n, 0.7, 1.0), sp_alpha_paper(12, n, 0.7, 1.0)):
        assert state.rows == pytest.approx(12 / n)
        assert state.effective == pytest.approx(12 / n)
    assert lookahead_theta(0.7, 1.0) == 0.0


def test_lookahead_theta() -> None:
    assert lookahead_theta(0.8, 0.25) == pytest.approx(0.6)
    assert lookahead_theta(0.8) == pytest.approx(0.8)


@pytest.mark.parametrize(
    "call",
    [
        lambda: b_eff_star(10, 0, 0.5),
        lambda: b_eff_star(10, 2, 1.5),
        lambda: b_eff_star(10, 2, float("nan")),
        lambda: b_alpha_star(10, 2, 1.5),
        lambda: b_alpha_star(10, 2, -0.1),
        lambda: simulate_eq1(2, 0.5, 10),
        lambda: simulate_eq1(2, 0.5, 10, start=[1.0, 2.0, 3.0]),
        lambda: simulate_eq1(2, [0.5] * 3, 10, batch=1.0),
        lambda: simulate_eq3(4, 0.2, 1.0, 2),
    ],
)
def test_invalid_arguments_raise(call) -> None:
    with pytest.raises(ValueError):
        call()


# ----------------------------------------------------------------------------- Table 1


def test_latency_table_interpolates_and_extrapolates() -> None:
    t = LatencyTable([[1, 0.010], [64, 0.012], [128, 0.016]])
    assert t(1) == pytest.approx(0.010)
    assert t(32.5) == pytest.approx(0.011)
    assert t(96) == pytest.approx(0.014)
    assert t(0.5) == pytest.approx(0.010)  # floor below the first point
    assert t(192) == pytest.approx(0.020)  # last-segment slope 1/16000 s per sequence
    assert t.extrapolates(129) and not t.extrapolates(128)
    assert np.allclose(t(np.array([1.0, 96.0])), [0.010, 0.014])
    assert LatencyTable([[8, 0.5]])(100) == 0.5


@pytest.mark.parametrize(
    "points,needle",
    [
        ([], "empty"),
        ([[1, 0.1], [1, 0.2]], "strictly increasing"),
        ([[1, 0.2], [2, 0.1]], "must not decrease"),
        ([[0, 0.1]], "> 0"),
        ([[1, -0.1]], "> 0"),
        ([[1, 0.1, 3]], "expected [batch, seconds]"),
    ],
)
def test_latency_table_validation(points, needle: str) -> None:
    with pytest.raises(ValueError, match=None) as e:
        LatencyTable(points, name="cfg.latency")
    assert needle in str(e.value) and "cfg.latency" in str(e.value)


def test_table1_formulas() -> None:
    lat = LatencyTable([[1, 0.01], [100, 0.02], [400, 0.05]])
    assert throughput_tp(400, lat) == pytest.approx(400 / 0.05)
    assert throughput_pp(400, 4, lat) == pytest.approx(100 / 0.02)
    assert throughput_sp(400, 4, 0.6, lat) == pytest.approx(400 / (4 - 0.6 * 3) / 0.05)
    rows = 400 / (1 + 0.2 * 3)
    eff = 0.2 * rows + 0.8 * rows / (4 - 0.7 * 3)
    assert throughput_sp_alpha(400, 4, 0.7, 0.2, lat) == pytest.approx(eff / lat(rows))
    ex = sp_alpha_exact(400, 4, 0.7, 0.2)
    assert throughput_sp_alpha(400, 4, 0.7, 0.2, lat, model="exact") == pytest.approx(
        ex.effective / lat(ex.rows)
    )
    with pytest.raises(ValueError):
        throughput_sp_alpha(400, 4, 0.7, 0.2, lat, model="nope")
