"""Selective speculation: exact floor(alpha B) drops, deterministic ties, the alpha chooser."""

from __future__ import annotations

import time
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from spexis_sglang.core.cost_model import LatencyTable, throughput_sp_alpha
from spexis_sglang.core.selection import (
    RankAcceptanceProfile,
    choose_alpha,
    keep_mask,
    num_dropped,
    select_drops,
    select_drops_reference,
)


@settings(max_examples=300, deadline=None)
@given(percent=st.integers(0, 100), batch=st.integers(0, 5000))
def test_num_dropped_is_exact_floor(percent: int, batch: int) -> None:
    alpha = percent / 100  # binary float; floor must still be the decimal one
    assert num_dropped(batch, alpha) == (Fraction(percent, 100) * batch).__floor__()


def test_num_dropped_rounding_trap() -> None:
    assert 0.29 * 100 < 29  # the float product is 28.999999999999996
    assert num_dropped(100, 0.29) == 29
    assert num_dropped(10, 0.3) == 3
    assert num_dropped(3, 0.5) == 1
    with pytest.raises(ValueError):
        num_dropped(10, 1.5)


conf_values = st.sampled_from([0.0, 0.1, 0.25, 0.5, 0.5, 0.9, 1.0, float("nan")])


@settings(max_examples=300, deadline=None)
@given(
    conf=st.lists(st.one_of(conf_values, st.floats(0, 1)), min_size=0, max_size=60),
    percent=st.integers(0, 100),
    keyed=st.booleans(),
    data=st.data(),
)
def test_select_drops_matches_full_sort(conf, percent, keyed, data) -> None:
    alpha = percent / 100
    key = None
    if keyed:
        key = data.draw(st.permutations(list(range(len(conf)))))
    got = select_drops(conf, alpha, key)
    ref = select_drops_reference(conf, alpha, key)
    assert np.array_equal(got, ref)
    assert got.size == num_dropped(len(conf), alpha)
    arr = np.nan_to_num(np.asarray(conf, dtype=float), nan=-np.inf)
    if 0 < got.size < len(conf):
        kept = np.setdiff1d(np.arange(len(conf)), got)
        assert arr[got].max() <= arr[kept].min()  # every dropped row ranks at or below kept


def test_ties_drop_later_rows_or_larger_keys() -> None:
    conf = [0.5, 0.2, 0.5, 0.5, 0.9]
    assert select_drops(conf, 0.4).tolist() == [1, 3]  # 0.2, then the last 0.5
    assert select_drops(conf, 0.4, tie_key=[30, 0, 10, 20, 40]).tolist() == [0, 1]
    assert keep_mask(conf, 0.4).tolist() == [True, False, True, False, True]
    assert select_drops([float("nan"), 0.0, 0.1], 0.34).tolist() == [0]  # NaN is lowest


def test_select_drops_is_fast_at_large_batch() -> None:
    rng = np.random.default_rng(0)
    conf = rng.random(1_000_000)
    t0 = time.perf_counter()
    out = select_drops(conf, 0.2)
    assert time.perf_counter() - t0 < 1.0
    assert out.size == 200_000


def test_select_drops_validates() -> None:
    with pytest.raises(ValueError):
        select_drops(np.zeros((2, 2)), 0.5)
    with pytest.raises(ValueError):
        select_drops([0.1, 0.2, 0.2], 0.7, tie_key=[1, 2])


# ----------------------------------------------------------------------------- alpha


def test_theta_alpha_by_hand() -> None:
    prof = RankAcceptanceProfile((1.0, 0.8, 0.6, 0.2))  # rank 0 = most confident
    assert prof.theta == pytest.approx(0.65)
    assert prof.theta_alpha(0.25) == pytest.approx(0.8)  # keep the top 3 bins
    assert prof.theta_alpha(0.5) == pytest.approx(0.9)
    # keep 0.625 of the mass: bins 1, 0.8 fully plus half of the 0.6 bin
    assert prof.theta_alpha(0.375) == pytest.approx((1.0 + 0.8 + 0.5 * 0.6) / 2.5)
    with pytest.raises(ValueError):
        RankAcceptanceProfile((0.5, 1.5))
    with pytest.raises(ValueError):
        RankAcceptanceProfile(())


@settings(max_examples=100, deadline=None)
@given(acc=st.lists(st.floats(0, 1), min_size=1, max_size=30), alpha=st.floats(0, 0.95))
def test_theta_alpha_non_decreasing_for_sorted_profiles(acc, alpha) -> None:
    prof = RankAcceptanceProfile(tuple(sorted(acc, reverse=True)))
    assert prof.theta_alpha(alpha) >= prof.theta - 1e-12
    assert prof.theta_alpha(min(alpha + 0.04, 0.99)) >= prof.theta_alpha(alpha) - 1e-12


def _profile_with_bad_tail(theta_top: float, bad_frac: float, k: int = 20):
    n_bad = int(round(bad_frac * k))
    return RankAcceptanceProfile(tuple([theta_top] * (k - n_bad) + [0.02] * n_bad))


@pytest.mark.parametrize("model", ["paper", "exact"])
def test_choose_alpha_is_the_argmax_of_table1(model: str) -> None:
    lat = LatencyTable([[1, 0.010], [64, 0.011], [256, 0.016], [512, 0.024]])
    prof = _profile_with_bad_tail(0.85, 0.2)
    best, evaluated = choose_alpha(4, 400, prof, lat, model=model)
    brute = {
        a.alpha: throughput_sp_alpha(400, 4, prof.theta_alpha(a.alpha), a.alpha, lat, model)
        for a in evaluated
    }
    assert best.throughput == pytest.approx(max(brute.values()))
    assert best.alpha == max(brute, key=lambda a: (brute[a], -a))
    # dropping the hopeless fifth of the drafts is worthwhile here
    assert 0.1 <= best.alpha <= 0.3
    assert best.theta_alpha > prof.theta


def test_choose_alpha_keeps_everything_when_drops_cannot_help() -> None:
    flat_latency = LatencyTable([[1, 0.02], [1024, 0.02]])
    flat_profile = RankAcceptanceProfile((0.7,) * 10)  # confidence says nothing
    best, _ = choose_alpha(2, 256, flat_profile, flat_latency)
    assert best.alpha == 0.0


def test_choose_alpha_validates() -> None:
    with pytest.raises(ValueError):
        choose_alpha(2, 10, RankAcceptanceProfile((0.5,)), lambda b: 1.0, alphas=())
