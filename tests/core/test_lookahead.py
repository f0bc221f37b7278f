"""Algorithm 1: exact expectation vs hand computation, enumeration and seeded Monte-Carlo."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from spexis_sglang.core.cost_model import b_eff_star, lookahead_theta
from spexis_sglang.core.lookahead import (
    LookaheadModel,
    _tables,
    generated_tokens_survival,
)
from spexis_sglang.core.simulation import simulate_lookahead


def enumerate_memory(lengths, buckets, n, theta, precision, thresholds, horizon):
    """Exact expectation by enumerating every sequence of token costs (1 or N iterations)."""
    mem = np.zeros(horizon)
    iters = np.arange(1, horizon + 1)
    for fast in itertools.product((True, False), repeat=horizon):
        k_fast = sum(fast)
        p = theta**k_fast * (1 - theta) ** (horizon - k_fast)
        if p == 0.0:
            continue
        done = np.cumsum([1 if f else n for f in fast])
        g = np.searchsorted(done, iters, side="right")
        for ln, b in zip(lengths, buckets):
            held = ln + g
            if b is not None and b >= 0:
                fin = g >= thresholds[b]
                held = precision[b] * np.where(fin, 0.0, held) + (1 - precision[b]) * held
            mem += p * held
    return mem


def test_expected_generated_by_hand() -> None:
    """N = 2, theta = 0.5: E[G_1] = 0.5, E[G_2] = 1 + 0.25, E[G_3] = 1 + 0.75 + 0.125."""
    m = LookaheadModel(2, 0.5, precision=[1.0], thresholds=[64], horizon=3)
    assert np.allclose(m.expected_generated, [0.0, 0.5, 1.25, 1.875])
    # theta = 1: one token per iteration; theta = 0: one token per N iterations
    assert np.allclose(LookaheadModel(3, 1.0, [1.0], [64], 6).expected_generated, range(7))
    assert np.allclose(
        LookaheadModel(3, 0.0, [1.0], [64], 6).expected_generated, [0, 0, 0, 1, 1, 1, 2]
    )


def test_small_case_by_hand() -> None:
    """N = 2, theta = 0.5, thresholds (1, 2), precision (1, 0.5), two requests of length 10.

    Request A (bucket 0, tau = 1, surely right) finishes when its first token is out:
    P = 0.5 at i = 1, certain at i = 2. Request B (bucket 1, tau = 2, right half the time):
    at i = 2, P(G >= 2) = 0.25, so E = 0.25 (0.5 * 0 + 0.5 * 12) + 0.75 * 11 = 9.75.
    """
    m = LookaheadModel(2, 0.5, precision=[1.0, 0.5], thresholds=[1, 2], horizon=2)
    a = m.project([10], [0])
    assert a == pytest.approx([5.0, 0.0])
    b = m.project([10], [1])
    assert b[1] == pytest.approx(9.75)
    # i = 1: G is 1 (p 0.5) or 0: never >= 2, so E = 10 + 0.5
    assert b[0] == pytest.approx(10.5)
    assert m.project([10, 10], [0, 1]) == pytest.approx(a + b)


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(1, 4),
    theta=st.sampled_from([0.0, 0.3, 0.5, 0.77, 1.0]),
    reqs=st.lists(st.tuples(st.integers(0, 50), st.integers(-1, 2)), min_size=1, max_size=4),
    precision=st.tuples(st.floats(0, 1), st.floats(0, 1), st.floats(0, 1)),
    horizon=st.integers(1, 8),
)
def test_exact_matches_enumeration(n, theta, reqs, precision, horizon) -> None:
    thresholds = (1, 3, 5)
    lengths = [r[0] for r in reqs]
    buckets = [r[1] for r in reqs]
    m = LookaheadModel(n, theta, precision, thresholds, horizon)
    ref = enumerate_memory(lengths, buckets, n, theta, precision, thresholds, horizon)
    assert np.allclose(m.project(lengths, buckets), ref, rtol=1e-10, atol=1e-9)


@pytest.mark.parametrize("n,theta", [(2, 0.7), (4, 0.634), (8, 0.5)])
def test_exact_matches_seeded_monte_carlo(n: int, theta: float) -> None:
    lengths = [120, 300, 50, 10, 700, 64]
    buckets = [0, 1, 2, 3, 4, -1]
    prec = (0.79, 0.786, 0.812, 0.835, 0.852)  # paper Table 4, L70 ShareGPT
    thr = (4, 8, 16, 32, 64)
    m = LookaheadModel(n, theta, prec, thr, 64)
    mean, se = simulate_lookahead(lengths, buckets, n, theta, prec, thr, 64, 6000, seed=n)
    exact = m.project(lengths, buckets)
    z = np.abs(mean - exact) / np.maximum(se, 1e-9)
    assert z.max() < 5.0
    assert np.allclose(mean, exact, rtol=0.01)


def test_long_run_rate_matches_eq2() -> None:
    """E[G_i] / i tends to 1 / (N - theta (N-1)): the per-request form of Eq. 2."""
    for n, theta in [(2, 0.7), (4, 0.6), (8, 0.9)]:
        eg = LookaheadModel(n, theta, [1.0], [64], 64).expected_generated
        rate = b_eff_star(1.0, n, theta)
        assert (eg[64] - eg[32]) / 32 == pytest.approx(rate, rel=0.02)


def _algorithm1_literal(lengths, buckets, n, theta, precision, thresholds, horizon):
    """Algorithm 1 exactly as printed, with explicit loops."""
    out = []
    for i in range(1, horizon + 1):
        terms = []
        for w in range(i // n + 1):
            t = i - n * w
            k = t + w
            terms.append((k, math.comb(k, t) * theta**t * (1 - theta) ** w))
        e_gen = sum(k * p for k, p in terms)
        p_fin = []
        for b in buckets:
            if b < 0:
                p_fin.append(0.0)
            else:
                p_fin.append(precision[b] * sum(p for k, p in terms if k >= thresholds[b]))
        l_total = sum(lengths)
        n_fin = sum(p_fin)
        l_fin = sum(ln * p for ln, p in zip(lengths, p_fin))
        out.append(l_total + (len(lengths) - n_fin) * e_gen - l_fin)
    return np.asarray(out)


def test_paper_formula_reproduces_algorithm1_and_differs_from_exact() -> None:
    lengths, buckets = [100, 40, 500, 8], [0, 2, -1, 4]
    prec, thr = (0.8, 0.8, 0.85, 0.88, 0.9), (4, 8, 16, 32, 64)
    paper = LookaheadModel(2, 0.7, prec, thr, 64, formula="paper")
    exact = LookaheadModel(2, 0.7, prec, thr, 64)
    lit = _algorithm1_literal(lengths, buckets, 2, 0.7, prec, thr, 64)
    assert np.allclose(paper.project(lengths, buckets), lit, rtol=1e-12)
    # Algorithm 1's p_{i,w} is a sub-probability: E[L_gen] falls short by ~23 % at i = 64.
    assert paper.expected_generated[64] == pytest.approx(37.97, abs=0.01)
    assert exact.expected_generated[64] == pytest.approx(49.18, abs=0.01)
    # With theta = 1 or N = 1 there is no rejection in progress and the two agree.
    for n, th in [(2, 1.0), (1, 0.6)]:
        a = LookaheadModel(n, th, prec, thr, 64, formula="paper").project(lengths, [-1] * 4)
        b = LookaheadModel(n, th, prec, thr, 64).project(lengths, [-1] * 4)
        assert np.allclose(a, b)


def test_survival_table_properties() -> None:
    s = generated_tokens_survival(3, 0.6, 64)
    assert not s.flags.writeable
    assert np.all(s[:, 0] == 1.0)
    assert np.all(np.diff(s, axis=1) <= 1e-15)  # P(G >= k) falls with k
    assert np.all(np.diff(s, axis=0) >= -1e-15)  # and grows with i
    assert np.all(s[np.arange(65), np.arange(65) + 1] == 0.0)  # G_i <= i


def test_tables_are_cached() -> None:
    _tables.cache_clear()
    LookaheadModel(4, 0.61, [0.8] * 5)
    LookaheadModel(4, 0.61, [0.8] * 5)
    info = _tables.cache_info()
    assert info.misses == 1 and info.hits == 1


def test_vectorised_projection_is_sum_of_trajectories() -> None:
    rng = np.random.default_rng(1)
    lengths = rng.integers(1, 2000, 300)
    buckets = rng.integers(-1, 5, 300)
    m = LookaheadModel(4, 0.63, [0.79, 0.79, 0.81, 0.84, 0.85])
    full = m.project_full(lengths, buckets)
    assert np.allclose(full, m.trajectories(lengths, buckets).sum(axis=0))
    assert full[0] == pytest.approx(lengths.sum())
    assert np.allclose(m.project(lengths, buckets), full[1:])
    assert m.project(lengths, buckets).shape == (64,)
    nones = [None if b < 0 else int(b) for b in buckets]
    assert np.allclose(m.project(lengths, nones), full[1:])
    assert np.array_equal(m.project(lengths, buckets), m.project(lengths, buckets))


def test_selective_speculation_theta() -> None:
    """With drops, a token costs 1 iteration with probability (1 - alpha) Theta_alpha."""
    th = lookahead_theta(0.85, 0.2)
    m = LookaheadModel(2, th, [1.0], [64], 64)
    assert (m.expected_generated[64] - m.expected_generated[32]) / 32 == pytest.approx(
        1 / (2 - th), rel=0.02
    )


@pytest.mark.parametrize(
    "kwargs,needle",
    [
        (dict(num_stages=0, theta=0.5, precision=[1.0] * 5), "num_stages"),
        (dict(num_stages=2, theta=1.5, precision=[1.0] * 5), "theta"),
        (dict(num_stages=2, theta=0.5, precision=[1.0] * 4), "precision"),
        (dict(num_stages=2, theta=0.5, precision=[1.2] * 5), "precision"),
        (dict(num_stages=2, theta=0.5, precision=[1.0] * 2, thresholds=[8, 4]), "thresholds"),
        (dict(num_stages=2, theta=0.5, precision=[1.0] * 5, horizon=0), "horizon"),
        (dict(num_stages=2, theta=0.5, precision=[1.0] * 5, formula="x"), "formula"),
    ],
)
def test_model_validation(kwargs, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        LookaheadModel(**kwargs)


def test_projection_validation() -> None:
    m = LookaheadModel(2, 0.5, [1.0] * 5)
    with pytest.raises(ValueError, match="bucket"):
        m.project([1, 2], [0, 5])
    with pytest.raises(ValueError, match="bucket"):
        m.project([1, 2], [0, -2])
    with pytest.raises(ValueError, match="equal length"):
        m.project([1, 2, 3], [0, 1])
    with pytest.raises(ValueError, match="lengths"):
        m.project([1, -2], [0, 1])
    with pytest.raises(ValueError, match="integers"):
        m.project([1, 2], [0.5, 1])
    assert np.all(m.project([], []) == 0.0)


def test_expected_kv_tokens_convenience() -> None:
    from spexis_sglang.core.lookahead import expected_kv_tokens

    lengths, buckets = [100, 50, 7], [0, None, 3]
    prec = [0.8, 0.8, 0.82, 0.85, 0.86]
    got = expected_kv_tokens(lengths, buckets, 3, 0.7, prec)
    assert np.allclose(got, LookaheadModel(3, 0.7, prec).project(lengths, buckets))
