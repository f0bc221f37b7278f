"""Admission gain G (§5.2, A.3) and the admission policy against explicit simulation."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, event, given, settings
from hypothesis import strategies as st

from spexis_sglang.core.admission import AdmissionPlanner, gain, reservation_admit_count
from spexis_sglang.core.lookahead import DEFAULT_THRESHOLDS, LookaheadModel
from spexis_sglang.core.simulation import simulate_admission

THR = DEFAULT_THRESHOLDS


def paper_g(period, bs, pdr, i_delay, i_waits):
    """§5.2's closed form, typed in as printed."""
    n = len(i_waits)
    left = (period + (n + 1) * (pdr - 1)) / (period + pdr - 1)
    right = (bs + 1 - i_delay / period) / (bs + 1 - sum(w / period for w in i_waits))
    return left * right


def a3_g(period, bs, pdr, i_delay, i_waits):
    """Appendix A.3's token / time derivation, in seconds with t_d = 1 ms."""
    t_d = 1e-3
    t_p = pdr * t_d
    n = len(i_waits)
    tok_aggr = (bs + 1) * period - sum(i_waits)
    t_aggr = (period - (n + 1)) * t_d + (n + 1) * t_p
    tok_delay = (bs + 1) * period - i_delay
    t_delay = (period - 1) * t_d + t_p
    return (tok_delay / t_delay) / (tok_aggr / t_aggr)


@settings(max_examples=300, deadline=None)
@given(
    period=st.integers(8, 500),
    bs=st.integers(1, 512),
    pdr=st.floats(1.0, 40.0),
    i_delay=st.integers(0, 7),
    waits=st.lists(st.integers(0, 7), max_size=6),
)
def test_gain_equals_paper_closed_form_and_a3(period, bs, pdr, i_delay, waits) -> None:
    assume(sum(waits) <= bs * period)
    g = gain(period, bs, pdr, i_delay, waits)
    assert g == pytest.approx(paper_g(period, bs, pdr, i_delay, waits), rel=1e-12)
    assert g == pytest.approx(a3_g(period, bs, pdr, i_delay, waits), rel=1e-9)


def test_gain_qualitative_cases_of_section_5_2() -> None:
    # one eviction, short wait, long delay, small batch: evicting is cheaper -> G < 1
    assert gain(64, 4, 2.0, i_delay=40, i_waits=[2]) < 1.0
    # frequent evictions: the recompute overhead dominates -> G > 1
    assert gain(64, 32, 4.0, i_delay=10, i_waits=[5] * 8) > 1.3
    # large batch: the right-hand factor is ~1, the recompute term decides
    assert gain(64, 256, 4.0, i_delay=40, i_waits=[2]) > 1.0
    # no eviction at all: delaying can only lose
    assert gain(64, 8, 4.0, i_delay=5, i_waits=[]) < 1.0


def test_gain_refinements() -> None:
    base = gain(64, 10, 3.0, 12, [4, 6])
    # a victim still waiting at the end of the period is not charged a recompute
    assert gain(64, 10, 3.0, 12, [4, 6], n_recompute=1) < base
    # finished requests decode in neither policy; the paper's formula is finished_iters = 0
    f = 100.0
    tok_d, tok_a = 11 * 64 - 12 - f, 11 * 64 - 10 - f
    expect = (tok_d / (64 + 2.0)) / (tok_a / (64 + 3 * 2.0))
    assert gain(64, 10, 3.0, 12, [4, 6], finished_iters=f) == pytest.approx(expect)
    # a delay beyond the period: no prefill in the period, the wait is capped
    assert gain(64, 10, 3.0, 100, [4]) == pytest.approx(
        ((11 * 64 - 64) / 64) / ((11 * 64 - 4) / (64 + 2 * 2.0))
    )
    with pytest.raises(ValueError):
        gain(0, 1, 2.0, 1, [])
    with pytest.raises(ValueError):
        gain(10, 1, 0.0, 1, [])
    with pytest.raises(ValueError, match="exceeds"):
        gain(10, 1, 2.0, 1, [6, 6])
    # aggr decoding nothing at all (finished requests overlapping the waits)
    assert gain(10, 1, 2.0, 3, [10], finished_iters=10.0) == float("inf")


# ----------------------------------------------------------------- explicit simulation


def _deterministic_planner(capacity: float, pdr: float, horizon: int = 64) -> AdmissionPlanner:
    """theta = 1 and exact predictions: the projection is the future, not an estimate."""
    model = LookaheadModel(2, 1.0, [1.0] * 5, THR, horizon)
    return AdmissionPlanner(model, capacity, pdr, period=horizon)


def _simulate_both(lengths, buckets, capacity, prompt, pdr, order, horizon=64):
    rem = [None if b < 0 else THR[b] for b in buckets]
    aggr = simulate_admission(lengths, rem, capacity, prompt, 1, horizon, 1.0, pdr, order)
    for d in range(1, horizon + 2):
        delay = simulate_admission(lengths, rem, capacity, prompt, d, horizon, 1.0, pdr, order)
        if not delay.evictions:
            return aggr, delay, d
    raise AssertionError("unreachable: admitting after the period never evicts")


def _victim_order(lengths, buckets):
    """Requests without a finish prediction first (largest first), then by bucket."""
    idx = sorted(range(len(lengths)), key=lambda r: (buckets[r] >= 0, -buckets[r], -lengths[r]))
    return idx


@settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.filter_too_much, HealthCheck.too_slow],
)
@given(
    reqs=st.lists(st.tuples(st.integers(10, 400), st.integers(-1, 4)), min_size=2, max_size=8),
    slack=st.integers(0, 400),
    prompt=st.integers(1, 400),
    pdr=st.floats(1.0, 8.0),
)
def test_planner_matches_explicit_simulation_of_both_policies(reqs, slack, prompt, pdr) -> None:
    """In a deterministic world the policy's n, i_wait, i_delay and G equal the simulation's."""
    lengths = [r[0] for r in reqs]
    buckets = [r[1] for r in reqs]
    order = _victim_order(lengths, buckets)
    full = LookaheadModel(2, 1.0, [1.0] * 5, THR, 64).project_full(lengths, buckets)
    capacity = float(full.max() + slack)  # the running requests alone never overflow
    planner = _deterministic_planner(capacity, pdr)
    dec = planner.decide(lengths, buckets, [prompt], victim_order=order)[0]
    aggr, delay, d = _simulate_both(lengths, buckets, capacity, prompt, pdr, order)
    finishing = {r for r in range(len(reqs)) if buckets[r] >= 0}
    assume(not any(v in finishing for v, _ in aggr.evictions))  # F equal in both policies
    event(f"reason={dec.reason} evictions={min(dec.evictions, 3)}")
    if dec.reason == "fits":
        assert dec.admit_now and dec.delay_iters == 0 and not aggr.evictions and d == 1
        return
    assert dec.reason == "gain" and dec.forecast is not None
    assume(not dec.forecast.unresolvable)
    assert list(dec.forecast.evictions) == aggr.evictions
    assert list(dec.forecast.waits) == aggr.waits
    assert dec.forecast.recomputes == aggr.recomputes
    free = dec.eviction_free_delay
    assert (free if free is not None else 64) == d - 1
    assert dec.delay_iters == (0 if dec.admit_now else free)
    assert dec.gain == pytest.approx(delay.throughput / aggr.throughput, rel=1e-9)
    assert dec.admit_now == (dec.gain <= 1.0)


def test_rare_eviction_with_long_delay_admits_now() -> None:
    """§5.2: one eviction and i_delay >> i_wait can make G < 1: admit now.

    A big request finishes at iteration 32 (bucket 3) and nine small ones keep growing.
    Admitting now overflows only at iterations 30-31 (one small victim, back at 32);
    an eviction-free admission has to wait 21 iterations.
    """
    lengths, buckets = [600] + [20] * 9, [3] + [-1] * 9
    order = list(range(1, 10)) + [0]
    planner = _deterministic_planner(capacity=1200.0, pdr=1.2)
    dec = planner.decide(lengths, buckets, [100], victim_order=order)[0]
    aggr, delay, d = _simulate_both(lengths, buckets, 1200.0, 100, 1.2, order)
    assert dec.evictions == 1 == len(aggr.evictions)
    assert aggr.waits == [2] and dec.eviction_free_delay == d - 1 == 21
    assert dec.gain == pytest.approx(delay.throughput / aggr.throughput)
    assert dec.gain < 1.0 and dec.admit_now and dec.delay_iters == 0


def test_frequent_evictions_delay() -> None:
    """§5.2: when admitting now keeps evicting, G > 1: delay until the big request leaves."""
    lengths = [900] + [30] * 12
    buckets = [3] + [-1] * 12
    order = list(range(1, 13)) + [0]
    planner = _deterministic_planner(capacity=1700.0, pdr=4.0)
    dec = planner.decide(lengths, buckets, [300], victim_order=order)[0]
    aggr, delay, d = _simulate_both(lengths, buckets, 1700.0, 300, 4.0, order)
    assert dec.evictions >= 4 and len(aggr.evictions) == dec.evictions
    assert dec.gain == pytest.approx(delay.throughput / aggr.throughput)
    assert dec.gain > 1.0 and not dec.admit_now
    assert dec.delay_iters == d - 1 == 31


def test_fcfs_prefix_and_ordering() -> None:
    model = LookaheadModel(4, 0.65, [0.8, 0.8, 0.82, 0.85, 0.86])
    rng = np.random.default_rng(3)
    lengths = rng.integers(100, 1500, 200).astype(float)
    buckets = rng.integers(-1, 5, 200)
    full = model.project_full(lengths, buckets)
    planner = AdmissionPlanner(model, capacity=float(full.max()) + 6000, pdr=8.0)
    waiting = rng.integers(200, 2000, 40)
    plan = planner.decide(lengths, buckets, waiting)
    decs = list(plan)
    assert [x.index for x in decs] == list(range(40))
    assert plan.num_admit_now == sum(x.admit_now for x in decs)
    now = [x.admit_now for x in decs]
    k = now.index(False)
    assert all(now[:k]) and not any(now[k:])  # FCFS: admitted requests form a prefix
    # the admitted prefix really fits: projection + their prompts + growth <= capacity
    eg = model.expected_generated
    used = full[1:] + waiting[:k].sum() + k * eg[1:]
    assert used.max() <= planner.capacity + 1e-6
    used_next = used + waiting[k] + eg[1:]
    assert used_next.max() > planner.capacity  # the first refused one would not fit
    delays = [x.delay_iters for x in decs[k:] if x.delay_iters is not None]
    assert delays == sorted(delays)  # later arrivals are never scheduled earlier
    assert all(x.reason == "fcfs" for x in decs[k + 1 :])


def test_everything_fits_and_empty_queue() -> None:
    model = LookaheadModel(2, 0.8, [0.8] * 5)
    planner = AdmissionPlanner(model, capacity=1e9, pdr=5.0)
    decs = planner.decide([100, 200], [0, -1], [50, 60, 70])
    assert all(x.admit_now and x.delay_iters == 0 and x.reason == "fits" for x in decs)
    assert len(planner.decide([100], [0], [])) == 0


def test_prompt_larger_than_capacity_is_delayed_beyond_horizon() -> None:
    model = LookaheadModel(2, 0.8, [0.8] * 5)
    planner = AdmissionPlanner(model, capacity=1000.0, pdr=5.0)
    dec = planner.decide([100], [-1], [5000])[0]
    assert not dec.admit_now and dec.delay_iters is None and dec.gain == float("inf")


def test_planner_validation() -> None:
    model = LookaheadModel(2, 0.8, [0.8] * 5)
    with pytest.raises(ValueError, match="capacity"):
        AdmissionPlanner(model, 0.0, 2.0)
    with pytest.raises(ValueError, match="pdr"):
        AdmissionPlanner(model, 10.0, 0.0)
    with pytest.raises(ValueError, match="period"):
        AdmissionPlanner(model, 10.0, 2.0, period=0)
    with pytest.raises(ValueError, match="waiting_tokens"):
        AdmissionPlanner(model, 10.0, 2.0).decide([1], [0], [-5])


def _stepwise_forecast(planner, base, prompt, lengths, rows, order):
    """Reference: the eviction forecast one iteration at a time (no event jumping)."""
    cap, model = planner.capacity, planner.model
    others = base + prompt + planner._new_growth
    traj, clock, out, queue, events, waits, rec = {}, {}, {}, [], [], [], 0
    for i in range(1, planner._window + 1):
        demand = float(others[i])
        for v, tr in traj.items():
            demand -= tr[i]
            if v not in out:
                demand += tr[clock[v] + 1]
        if demand > cap:
            for v in order.tolist():
                if v in out:
                    continue
                if v not in traj:
                    traj[v] = model.trajectory_of_row(lengths[v], int(rows[v]))
                    clock[v] = i - 1
                need = traj[v][clock[v] + 1]
                if need <= 0.0:
                    continue
                out[v] = i
                queue.append(v)
                events.append((v, i))
                demand -= need
                if demand <= cap:
                    break
            else:
                return None  # unresolvable
        still = []
        for v in queue:
            need = traj[v][clock[v] + 1]
            if not still and out[v] < i and demand + need <= cap:
                waits.append(i - out.pop(v))
                rec += 1
                demand += need
            else:
                still.append(v)
        queue = still
        for v in traj:
            if v not in out:
                clock[v] += 1
    waits += [planner._window + 1 - out[v] for v in queue]
    return events, waits, rec


@settings(max_examples=120, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    n=st.sampled_from([2, 4]),
    theta=st.sampled_from([0.55, 0.8]),
    slack=st.floats(-200.0, 800.0),
    prompt=st.floats(50.0, 1500.0),
)
def test_event_driven_forecast_equals_stepwise(seed, n, theta, slack, prompt) -> None:
    """With fractional (expected) trajectories the event jumps change nothing."""
    rng = np.random.default_rng(seed)
    b = int(rng.integers(2, 40))
    lengths = rng.integers(20, 600, b).astype(float)
    buckets = rng.integers(-1, 5, b)
    model = LookaheadModel(n, theta, [0.7, 0.75, 0.8, 0.85, 0.9])
    full = model.project_full(lengths, buckets)
    planner = AdmissionPlanner(model, capacity=float(full.max() + slack), pdr=4.0)
    rows = model.bucket_index(buckets)
    order = planner.default_victim_order(lengths, rows)
    fc = planner.forecast_aggr(full, prompt, lengths, rows, order)
    ref = _stepwise_forecast(planner, full, prompt, lengths, rows, order)
    if ref is None:
        assert fc.unresolvable
        return
    assert not fc.unresolvable
    events, waits, rec = ref
    assert list(fc.evictions) == events
    assert list(fc.waits) == waits and fc.recomputes == rec


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), fcfs_room=st.floats(0.2, 3.0))
def test_fcfs_slots_are_the_earliest_eviction_free_iterations(seed, fcfs_room) -> None:
    """Behind a delayed request, each slot is found by brute force over (d, i)."""
    rng = np.random.default_rng(seed)
    model = LookaheadModel(2, 0.75, [0.8, 0.8, 0.82, 0.85, 0.86], horizon=32)
    b = int(rng.integers(20, 80))
    lengths = rng.integers(50, 800, b).astype(float)
    buckets = np.where(rng.random(b) < 0.5, -1, rng.integers(0, 5, b))
    waiting = rng.integers(50, 600, 30).astype(float)
    full = model.project_full(lengths, buckets)
    cap = float(full.max() + fcfs_room * waiting.mean())
    planner = AdmissionPlanner(model, capacity=cap, pdr=50.0)  # recompute is very costly
    decs = planner.decide(lengths, buckets, waiting)
    eg = model.expected_generated
    h = model.horizon
    reserved = full.copy()
    prev = 1
    for dec in decs:
        p = waiting[dec.index]
        if dec.admit_now:
            assert dec.reason in ("fits", "gain")
            reserved[1:] += p + eg[1:]
            continue
        slot = None
        for d in range(prev, h + 1):
            if all(reserved[i] + p + eg[i - d + 1] <= cap + 1e-9 for i in range(d, h + 1)):
                slot = d
                break
        assert dec.eviction_free_delay == (None if slot is None else slot - 1)
        assert dec.delay_iters == dec.eviction_free_delay
        if slot is None:
            break
        for i in range(slot, h + 1):
            reserved[i] += p + eg[i - slot + 1]
        prev = slot


def test_empty_running_set() -> None:
    model = LookaheadModel(2, 0.8, [0.8] * 5)
    planner = AdmissionPlanner(model, capacity=600.0, pdr=5.0)
    plan = planner.decide([], [], [100, 300, 1000])
    # 100 + 300 + 2 * E[G_64] (53.3 each) fit; 1000 never fits, even with nothing running
    assert plan.admit_now.tolist() == [True, True, False]
    assert plan[2].gain == float("inf") and plan[2].delay_iters is None
    # with 500 tokens the second request overflows late in the horizon with nobody to evict
    plan = AdmissionPlanner(model, capacity=500.0, pdr=5.0).decide([], [], [100, 300])
    assert plan[1].reason == "gain" and plan[1].forecast.unresolvable
    assert not plan[1].admit_now and plan[1].delay_iters > 0


@pytest.mark.parametrize("big_fits_later", [True, False])
def test_non_fcfs_lets_small_requests_pass(big_fits_later: bool) -> None:
    model = LookaheadModel(2, 1.0, [1.0] * 5, THR, 64)
    # one request finishing at iteration 16 frees 600 tokens
    lengths, buckets = [600, 100], [2, -1]
    big = 700.0 if big_fits_later else 5000.0
    kw = dict(capacity=1000.0, pdr=50.0)
    fcfs = AdmissionPlanner(model, **kw).decide(lengths, buckets, [big, 20])
    free = AdmissionPlanner(model, fcfs=False, **kw).decide(lengths, buckets, [big, 20])
    assert not fcfs.admit_now[0] and not fcfs.admit_now[1]  # FCFS: queued behind the big one
    assert not free.admit_now[0] and free.admit_now[1]  # the small one fits now
    assert free[1].reason == "fits"
    assert (free[0].delay_iters is not None) == big_fits_later


# ---------------------------------------------------------------- reservation over time


def brute_force_count(free, held, grow, finish, prompts, grow_new, t_max=400):
    """The demand D_n(t) of reservation_admit_count's docstring, iteration by iteration."""
    best = 0
    for n in range(len(prompts) + 1):
        ok = True
        for t in range(t_max + 1):
            d = sum(min(t, g) if f > t else -h for h, g, f in zip(held, grow, finish))
            d += sum(p + min(t, m) for p, m in zip(prompts[:n], grow_new[:n]))
            if d > free:
                ok = False
                break
        if not ok:
            break
        best = n
    return best


def test_with_no_release_counted_on_the_check_is_sglangs_reservation():
    """Nothing finishes: running requests' reservations plus each new prompt and max_new."""
    inf = float("inf")
    # 100 free; running reserve 30; new requests need 20 + 30 each: one fits (80), two do not
    assert reservation_admit_count(100, [200], [30], [inf], [20, 20], [30, 30]) == 1
    assert reservation_admit_count(130, [200], [30], [inf], [20, 20], [30, 30]) == 2
    assert reservation_admit_count(100, [], [], [], [], []) == 0


def test_a_request_about_to_finish_lends_its_memory_to_a_new_one():
    """100 free, a running request holding 150 has at most 5 tokens left (released by
    iteration 10): a 60-token prompt with 96 tokens to go fits over time though SGLang's
    reservation (5 + 60 + 96 > 100) refuses it; released only at iteration 60, it does not."""
    assert reservation_admit_count(100, [150], [5], [float("inf")], [60], [96]) == 0
    assert reservation_admit_count(100, [150], [5], [10], [60], [96]) == 1
    # by iteration 59 the new request holds 60 + 59 > 100 - 5
    assert reservation_admit_count(100, [150], [5], [60], [60], [96]) == 0
    # the prompt itself must fit now
    assert reservation_admit_count(100, [150], [5], [1], [101], [0]) == 0


@settings(max_examples=150, deadline=None)
@given(
    free=st.integers(0, 300),
    running=st.lists(
        st.tuples(st.integers(1, 200), st.integers(0, 80), st.integers(1, 300)), max_size=5
    ),
    waiting=st.lists(st.tuples(st.integers(1, 120), st.integers(0, 120)), max_size=5),
)
def test_reservation_count_matches_iteration_by_iteration_demand(free, running, waiting):
    held, grow, finish = (list(x) for x in zip(*running)) if running else ([], [], [])
    prompts, grow_new = (list(x) for x in zip(*waiting)) if waiting else ([], [])
    got = reservation_admit_count(free, held, grow, finish, prompts, grow_new)
    assert got == brute_force_count(free, held, grow, finish, prompts, grow_new)
    # counting on no release can only admit fewer
    never = [float("inf")] * len(held)
    assert reservation_admit_count(free, held, grow, never, prompts, grow_new) <= got


def test_reservation_count_rejects_inconsistent_inputs():
    with pytest.raises(ValueError):
        reservation_admit_count(10, [1, 2], [1], [3, 4], [1], [1])
    with pytest.raises(ValueError):
        reservation_admit_count(10, [1], [1], [0], [1], [1])
    with pytest.raises(ValueError):
        reservation_admit_count(10, [], [], [], [1, 2], [1])
