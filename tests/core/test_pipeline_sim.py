"""The pipeline simulator on cases whose answer is known by hand.

Stage times are fixed numbers, so each expected throughput below is a line of arithmetic
(given in the test); the simulator must reproduce it from the choreography alone.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from spexis_sglang.core.des import EventLoop, Process, SharedDevice, Signal, Stream
from spexis_sglang.core.pipeline_sim import (
    AcceptanceModel,
    DecodeWorkload,
    Deployment,
    LoopSpec,
    Machine,
    ServingWorkload,
    simulate,
    simulate_decode_benchmark,
)
from spexis_sglang.core.stage_costs import (
    CostGrid,
    DeviceSharing,
    HostCosts,
    HostPhase,
    LinkSpec,
    StageCosts,
    StagePlan,
    layer_split,
)

MS = 1e-3


def costs(per_layer_s: float, layers: int = 4, tp: int = 1, prefill_per_token_s: float = 0.0):
    """A stage costs ``per_layer_s`` per layer whatever the batch; nothing else costs."""
    decode = {"gemm": CostGrid.constant(per_layer_s)}
    prefill = {
        "gemm": CostGrid([1, 1e6], [1], [[prefill_per_token_s], [prefill_per_token_s * 1e6]])
    }
    return StageCosts("toy", layers, 1024, tp, decode, prefill)


def machine(per_layer_s=1 * MS, layers=4, host=None, link=None, sharing=None, **kw):
    return Machine(
        costs(per_layer_s, layers, **kw),
        host or HostCosts({}, idle_poll=0.0),
        link or LinkSpec(0.0, 1e15, 0.0),
        sharing,
    )


def steady(batch, **kw):
    return DecodeWorkload(batch, 128, iterations=120, warmup=30, prefill_chunk=None, **kw)


# -- the event kernel -------------------------------------------------------------------


def test_stream_is_fifo_and_waits_for_inputs():
    loop = EventLoop()
    s = Stream(loop)
    s.log = []
    ready = Signal(loop)
    a = s.submit(2.0, after=[ready], tag="a")
    b = s.submit(1.0, tag="b")  # ready, but queued behind a
    ready.fire(5.0)
    loop.run()
    assert a.time == 7.0 and b.time == 8.0
    assert s.log == [("a", 5.0, 7.0), ("b", 7.0, 8.0)]


def test_process_sleeps_and_waits():
    loop = EventLoop()
    sig = Signal(loop)
    seen = []

    def proc():
        yield 1.5
        seen.append(loop.now)
        yield sig
        seen.append(loop.now)

    Process(loop, proc())
    sig.fire(4.0)
    loop.run()
    assert seen == [1.5, 4.0]


def test_shared_device_slows_concurrent_jobs_by_the_given_factors():
    # alone: memory-bound x1.2; together: x2.0 -- a 1 s job alone ends at 1.2 s; two 1 s
    # jobs started together end at 2.0 s; a job that overlaps only partly is in between
    loop = EventLoop()
    dev = SharedDevice(loop, compute_slowdown=(1, 1.5, 3.0), memory_slowdown=(1, 1.2, 2.0))
    s0, s1 = Stream(loop, dev), Stream(loop, dev)
    a = s0.submit(1.0, mem_frac=1.0)
    b = s1.submit(1.0, mem_frac=1.0)
    loop.run()
    assert a.time == pytest.approx(2.0) and b.time == pytest.approx(2.0)
    loop = EventLoop()
    dev = SharedDevice(loop, (1, 1.5, 3.0), (1, 1.2, 2.0))
    s0, s1 = Stream(loop, dev), Stream(loop, dev)
    a = s0.submit(1.0, mem_frac=1.0)
    late = Signal(loop)
    b = s1.submit(0.25, after=[late], mem_frac=1.0)
    late.fire(0.6)
    loop.run()
    # a: 0.6 s alone = 0.5 of its work; b then runs 0.25 of work at 1/2.0 -> 0.5 s shared,
    # during which a does 0.25; a's last 0.25 alone takes 0.3 s
    assert b.time == pytest.approx(1.1)
    assert a.time == pytest.approx(1.4)


# -- decode throughput: one stage, pipelines, SP ----------------------------------------


def test_tp_one_stage_is_batch_over_stage_time():
    r = simulate(Deployment("tp", 1, 1), machine(), steady(64))
    assert r.throughput_tok_s == pytest.approx(64 / (4 * MS), rel=1e-6)
    assert r.stage_utilisation[0] == pytest.approx(1.0)


def test_pp_balanced_micro_batches_keep_every_stage_busy():
    # 4 layers over 4 stages: 1 ms per stage, micro-batches of 16: 16 tokens per ms
    r = simulate(Deployment("pp", 4), machine(), steady(64))
    assert r.throughput_tok_s == pytest.approx(16 / MS, rel=1e-6)
    assert r.stage_utilisation == pytest.approx([1.0] * 4)
    assert r.rows_per_iteration == 16


def test_pp_with_one_full_micro_batch_leaves_the_other_stage_idle():
    # SGLang admits all 64 prompts of 128 tokens in one 8192-token prefill: one micro-batch
    wl = DecodeWorkload(64, 128, iterations=120, warmup=40)
    r = simulate(Deployment("pp", 2), machine(), wl)
    assert r.stage_utilisation == pytest.approx([0.5, 0.5], abs=1e-6)
    # one 64-row micro-batch takes both stages, 2 ms each, serially: 64 tokens per 4 ms
    assert r.throughput_tok_s == pytest.approx(64 / (4 * MS), rel=1e-6)


def test_pp_serial_host_phases_and_transfers_add_to_the_cycle():
    # stage 2 ms; transfer 0.5 ms each way; process 0.3 ms and send 0.2 ms on the host.
    # Stage 0 sends batch k's hidden states after processing batch k-1's outputs, so
    # iteration = T + 2x + process + send = 3.5 ms for 32 rows.
    host = HostCosts(
        {"pp": {"process": HostPhase(0.3 * MS), "send": HostPhase(0.2 * MS)}}, idle_poll=0.0
    )
    m = machine(per_layer_s=1 * MS, host=host, link=LinkSpec(0.5 * MS, 1e15, 0.0))
    r = simulate(Deployment("pp", 2), m, steady(64))
    assert r.iteration_s == pytest.approx(3.5 * MS, rel=1e-6)
    assert r.throughput_tok_s == pytest.approx(32 / (3.5 * MS), rel=1e-6)
    # sending right after the launch takes the host off the path: 2 iterations per
    # round trip 2T + 2x + process -> T + x + process / 2 = 2.65 ms
    r2 = simulate(Deployment("pp", 2), m, steady(64), loop=LoopSpec(send_after_launch=True))
    assert r2.iteration_s == pytest.approx(2.65 * MS, rel=1e-6)


def test_sp_effective_batch_follows_eq2_with_a_fixed_stage_time():
    # every row rides every 2 ms iteration; Eq. 2: B_eff = B / (N - Theta (N - 1))
    for n_st, theta in ((2, 0.76), (4, 0.6)):
        r = simulate(
            Deployment("sp", n_st),
            machine(per_layer_s=0.5 * MS, layers=n_st),
            DecodeWorkload(128, 128, iterations=800, warmup=100, prefill_chunk=None),
            AcceptanceModel(theta),
        )
        b_eff = 128 / (n_st - theta * (n_st - 1))
        assert r.rows_per_iteration == 128
        assert r.iteration_s == pytest.approx(0.5 * MS, rel=1e-5)
        assert r.tokens_per_iteration == pytest.approx(b_eff, rel=0.02)
        assert r.theta_measured == pytest.approx(theta, abs=0.01)


def test_selective_speculation_drops_alpha_and_lifts_kept_acceptance():
    prof = (0.99, 0.95, 0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2)
    acc = AcceptanceModel(0.64, prof)
    wl = DecodeWorkload(200, 128, iterations=400, warmup=50, prefill_chunk=None)
    m = machine(per_layer_s=0.5 * MS, layers=2)
    r0 = simulate(Deployment("sp", 2), m, wl, acc)
    r3 = simulate(Deployment("sp", 2, alpha=0.3), m, wl, acc)
    assert r0.theta_measured == pytest.approx(0.64, abs=0.02)
    assert r3.theta_measured > r0.theta_measured + 0.08  # the least confident 30 % sat out
    assert r3.rows_per_iteration < r0.rows_per_iteration


def test_eager_launch_bounds_the_stage_by_host_time():
    # PP=1 overlap loop, GPU 1 ms, eager launch 1 ms per layer x 4 layers: host-bound 4 ms
    host = HostCosts({"tp": {"launch": HostPhase(per_layer=1 * MS)}}, idle_poll=0.0)
    m = machine(per_layer_s=0.25 * MS, host=host)
    r = simulate(Deployment("tp", 1, 1), m, steady(32), loop=LoopSpec(graphs=False))
    assert r.iteration_s == pytest.approx(4 * MS, rel=1e-6)
    r_graph = simulate(Deployment("tp", 1, 1), m, steady(32))
    assert r_graph.iteration_s == pytest.approx(4 * MS, rel=1e-6)  # the host launches either way
    host2 = HostCosts({"tp": {"launch": HostPhase(fixed=0.1 * MS)}}, idle_poll=0.0)
    r_fast = simulate(
        Deployment("tp", 1, 1), machine(per_layer_s=0.25 * MS, host=host2), steady(32)
    )
    assert r_fast.iteration_s == pytest.approx(1 * MS, rel=1e-6)  # GPU-bound again


def test_box_sharing_slows_both_stages_when_both_run():
    sh = DeviceSharing(compute=(1, 1.5, 2.0), memory=(1, 1.5, 2.0))
    r = simulate(Deployment("pp", 2), machine(sharing=sh), steady(64))
    # both stages always busy: 2 ms of work at half speed -> 4 ms per micro-batch of 32
    assert r.iteration_s == pytest.approx(4 * MS, rel=1e-6)


def test_decode_benchmark_protocol_cancels_prefill():
    # prefill 1 us per token differs between nothing in the two runs: T_step is the decode step
    m = machine(prefill_per_token_s=1e-6)
    thr, short, long_ = simulate_decode_benchmark(Deployment("tp", 1, 1), m, 32)
    assert thr == pytest.approx(32 / (4 * MS), rel=1e-6)
    assert long_.serving["completed"] == short.serving["completed"] == 32


def test_serving_single_request_ttft_and_tpot():
    m = machine(prefill_per_token_s=10e-6)
    wl = ServingWorkload(np.array([0.0]), np.array([1000]), np.array([21]))
    r = simulate(Deployment("tp", 1, 1), m, wl)
    s = r.serving
    assert s["completed"] == 1
    # prefill: 4 layers x 1000 tokens x 10 us per token and layer
    assert s["ttft_s"]["p50"] == pytest.approx(40 * MS, rel=1e-6)
    assert s["tpot_s"]["p50"] == pytest.approx(4 * MS, rel=1e-6)


def test_serving_queues_beyond_max_running():
    # 8 requests at once, at most 4 running, 10 tokens each at 4 ms a step: the second
    # four wait for the first four
    m = machine(prefill_per_token_s=1e-9)
    wl = ServingWorkload(np.zeros(8), np.full(8, 16), np.full(8, 10), max_running=4)
    r = simulate(Deployment("tp", 1, 1), m, wl)
    ttft = r.serving["ttft_s"]
    assert r.serving["completed"] == 8
    assert ttft["p99"] > 9 * 4 * MS  # queued behind ten decode steps


# -- inputs -----------------------------------------------------------------------------


def test_cost_grid_interpolates_and_extrapolates_linearly():
    g = CostGrid([1, 3], [10, 30], [[1.0, 3.0], [2.0, 4.0]])
    assert g(2, 20) == pytest.approx(2.5)
    assert g(0.5, 5) == pytest.approx(1.0)  # flat below
    assert g(5, 10) == pytest.approx(3.0)  # linear above
    assert CostGrid.from_json(g.to_json())(2, 20) == pytest.approx(2.5)


def test_host_phase_fit_and_table():
    h = HostPhase.fit([(64, 1.0), (256, 2.5)])
    assert h(160) == pytest.approx(1.75)
    t = HostPhase.table([(64, 0.92), (256, 0.85), (512, 1.8)], per_layer=0.1)
    assert t(64, 0) == pytest.approx(0.92) and t(384, 2) == pytest.approx(1.325 + 0.2)
    assert HostCosts.from_json(HostCosts({"sp": {"x": t}}).to_json()).cost("sp", "x", 64) == (
        pytest.approx(0.92)
    )


def test_stage_plans_put_embedding_first_and_lm_head_last():
    plans = StagePlan.for_pipeline(36, 8, sp=True)
    assert [p.layers for p in plans] == layer_split(36, 8) == [4, 4, 4, 4, 5, 5, 5, 5]
    assert "draft_head" in plans[0].extras and "embedding" in plans[0].extras
    assert plans[-1].extras == ("lm_head", "sampling")
    assert all(not p.extras for p in plans[1:-1])
    only = StagePlan.for_pipeline(32, 1, sp=False)[0]
    assert only.extras == ("embedding", "lm_head", "sampling")


def test_bad_inputs_fail_clearly():
    with pytest.raises(ValueError, match="mode 'tp' is PP=1"):
        Deployment("tp", 2)
    with pytest.raises(ValueError, match="alpha"):
        Deployment("pp", 2, alpha=0.2)
    with pytest.raises(ValueError, match="TP=1"):
        simulate(Deployment("tp", 1, 2), machine(), steady(8))
    with pytest.raises(ValueError, match="unknown cost component"):
        StageCosts("x", 2, 8, 1, {"softmax": CostGrid.constant(1.0)})
    with pytest.raises(ValueError, match="strictly increasing"):
        CostGrid([2, 1], [1], [[1.0], [2.0]])
    assert math.isfinite(simulate(Deployment("sp", 2), machine(), steady(8)).throughput_tok_s)
