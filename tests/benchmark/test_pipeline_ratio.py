"""benchmark/gpu/pipeline_ratio.py and decode_throughput.py's stock-PP variants: SP is set
against the best stock PP run of the same call, beside the ideal ratio from the stages' GPU
times. Synthetic inputs (no server): every number below is known exactly."""

import argparse
import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "benchmark", "gpu"))

import decode_throughput  # noqa: E402
import pipeline_ratio  # noqa: E402

CTX = pipeline_ratio.ctx_bucket(128, 128)


def _stock(config, tok_s, gpu_ms):
    return {
        "config": config,
        "kind": "pp",
        "n": 2,
        "batches": [{"batch": 16, "input_len": 128, "decode_tok_s": tok_s}],
        "gpu_forward_ms": {"pp rank 0, tp rank 0": {f"8@{CTX}": [100, gpu_ms]}},
    }


def _summary():
    sp = {
        "config": "spexis_sp2_theta0.75",
        "kind": "sp",
        "n": 2,
        "batches": [
            {
                "batch": 16,
                "input_len": 128,
                "decode_tok_s": 3000.0,
                "sp": {"acceptance": 0.75, "iter_time_s": 0.0055},
                "later_stages": {
                    "pp rank 1": {"phase_ms_per_iteration": {"busy": 5.6, "launch": 4.2}}
                },
            }
        ],
        # the slowest rank is the stage time; stage 0's own time is the iteration's yardstick
        "gpu_forward_ms": {
            "pp rank 0, tp rank 0": {f"16@{CTX}": [100, 5.0]},
            "pp rank 1, tp rank 0": {f"16@{CTX}": [100, 4.0]},
        },
    }
    results = [
        _stock("sglang_pp2", 2000.0, 4.0),
        _stock("sglang_pp2_balanced", 1500.0, 4.0),
        _stock("sglang_pp2_async1", 2500.0, 4.0),
        sp,
    ]
    return {"output_len": 128, "models": {"m": {"results": results}}}


def test_sp_is_set_against_the_best_stock_run_beside_the_ideal():
    (row,) = pipeline_ratio.compare(_summary())
    assert row["pp_best"] == "sglang_pp2_async1"
    assert row["sp_over_pp"] == pytest.approx(3000 / 2500, abs=1e-3)
    # ideal = N T(B/N) / ((N - theta (N-1)) T(B)) = 2 * 4 / (1.25 * 5)
    assert row["ideal"] == pytest.approx(2 * 4.0 / (1.25 * 5.0), abs=1e-3)
    assert row["of_ideal"] == pytest.approx(1.2 / 1.28, abs=2e-3)
    assert row["iter_over_gpu"] == pytest.approx(5.5 / 5.0, abs=1e-3)
    # a later stage's loop by phase, beside its own GPU time per forward
    assert row["later_stages"] == {
        "pp rank 1": {"phase_ms": {"busy": 5.6, "launch": 4.2}, "gpu_ms": 4.0}
    }


def test_the_ratio_from_counters_sits_beside_the_wall_clock_one():
    summary = _summary()
    results = summary["models"]["m"]["results"]
    # the best stock point by wall clock: 8 rows per 3.2 ms of its loop (2,500 tok/s)
    results[2]["batches"][0]["stock_phase_ms_per_iteration"] = {"busy": 3.2}
    # SP: 10 more decode iterations of 15 tokens, 5.0 ms each (3,000 tok/s)
    results[3]["batches"][0]["sp"].update(
        short={"decode_iterations": 5, "tokens_committed": 80},
        long={"decode_iterations": 15, "tokens_committed": 230},
        phase_ms_per_iteration={"busy": 5.0},
    )
    (row,) = pipeline_ratio.compare(summary)
    assert row["sp_over_pp_counters"] == pytest.approx(3000 / 2500, abs=1e-3)
    del results[2]["batches"][0]["stock_phase_ms_per_iteration"]  # no stock timers: no ratio
    assert "sp_over_pp_counters" not in pipeline_ratio.compare(summary)[0]


def test_the_steady_state_ratio_sets_the_best_steady_stock_point_against_sp():
    summary = _summary()
    results = summary["models"]["m"]["results"]
    for res, steady in zip(results, (1900.0, 1400.0, 2400.0, 3100.0)):
        res["batches"][0]["steady_tok_s"] = steady
    (row,) = pipeline_ratio.compare(summary)
    assert row["sp_over_pp_steady"] == pytest.approx(3100 / 2400, abs=1e-3)
    assert row["sp_over_pp"] == pytest.approx(3000 / 2500, abs=1e-3)  # the wall ratio stays
    del results[1]["batches"][0]["steady_tok_s"]  # a stock point without one: no ratio
    assert "sp_over_pp_steady" not in pipeline_ratio.compare(summary)[0]


def test_a_wall_rate_off_its_counters_hands_the_comparison_to_the_counters():
    """A short run that paid a one-time cost makes the two runs' difference too small: the
    wall rate reads far above the counters' (seen at B = 512: 1.87x). Within 10 % the wall
    ratio stands; beyond it the row compares counter rates, the best stock point by them."""
    summary = _summary()
    results = summary["models"]["m"]["results"]
    for res, busy in zip(results[:3], (4.0, 6.0, 3.2)):  # 2,000 / 1,333 / 2,500 tok/s
        res["batches"][0]["stock_phase_ms_per_iteration"] = {"busy": busy}
    sp = results[3]["batches"][0]
    sp["sp"].update(
        short={"decode_iterations": 5, "tokens_committed": 80},
        long={"decode_iterations": 15, "tokens_committed": 230},
        phase_ms_per_iteration={"busy": 6.0},  # 2,500 tok/s
    )
    sp["wall_over_counters"] = 1.09
    (row,) = pipeline_ratio.compare(summary)
    assert (row["ratio_source"], row["sp_over_pp"]) == ("wall", 1.2)
    assert "wall_disagrees" not in row
    sp["wall_over_counters"] = 1.2
    results[2]["batches"][0]["wall_over_counters"] = 0.85
    (row,) = pipeline_ratio.compare(summary)
    assert row["ratio_source"] == "counters"
    assert row["wall_disagrees"] == ["spexis_sp2_theta0.75", "sglang_pp2_async1"]
    assert row["sp_over_pp"] == pytest.approx(2500 / 2500, abs=1e-3)
    assert (row["sp_tok_s"], row["pp_best_tok_s"], row["sp_over_pp_wall"]) == (2500, 2500, 1.2)
    # a stock point without counters: the wall ratio stays, the disagreement said
    del results[1]["batches"][0]["stock_phase_ms_per_iteration"]
    (row,) = pipeline_ratio.compare(summary)
    assert (row["ratio_source"], row["sp_over_pp"]) == ("wall", 1.2)
    assert row["wall_disagrees"]


def test_a_point_whose_server_cannot_hold_all_b_requests_gets_no_ratio(capsys):
    """A KV pool short of B requests' full lengths (or a running cap below B) runs fewer
    than B at once: both rates are then no decode rate at B (seen: stock's wall rate half its
    counters at input 2,048, B = 64), so no ratio is drawn and the table says why."""
    summary = _summary()
    results = summary["models"]["m"]["results"]
    results[3]["max_total_num_tokens"] = 16 * 256  # exactly 16 requests of 128 + 128
    assert "sp_over_pp" in pipeline_ratio.compare(summary)[0]
    results[1]["max_total_num_tokens"] = 16 * 256 - 1
    (row,) = pipeline_ratio.compare(summary)
    assert row["short_of_batch"] == ["sglang_pp2_balanced: KV pool 4095 tokens < 16 x 256"]
    assert not {"sp_over_pp", "ideal", "ceiling_tok_s"} & set(row)
    del results[1]["max_total_num_tokens"]
    results[3]["max_running_requests"] = 8
    (row,) = pipeline_ratio.compare(summary)
    assert row["short_of_batch"] == ["spexis_sp2_theta0.75: --max-running-requests 8 < 16"]
    pipeline_ratio.print_table([row])
    assert "no ratio at in=128 B=16" in capsys.readouterr().out


def test_the_ceiling_sets_sp_at_all_rows_against_stocks_best_schedule():
    """Stock's best may not be the ideal's B/N micro-batches (one micro-batch, the stages in
    turn): SP's ceiling B / ((N - theta (N-1)) T(B)) against stock's measured best says where
    SP could get to; SP's measured rate over it, what its host work left."""
    (row,) = pipeline_ratio.compare(_summary())
    ceiling = 16 * 1e3 / (1.25 * 5.0)  # 2,560 tok/s
    assert row["ceiling_tok_s"] == round(ceiling)
    assert row["ceiling_over_pp"] == pytest.approx(ceiling / 2500, abs=1e-3)
    assert row["of_ceiling"] == pytest.approx(3000 / ceiling, abs=1e-3)


def test_the_ideal_takes_each_points_own_forwards_where_recorded():
    """A server's timers merge its points: the stock server's 8-row forwards at B = 16 above
    read 4.0 ms over every point. Point timers say what this B ran: the default cap put all 16
    rows in one micro-batch (no 8-row forward: the next stock point is asked), the balanced cap
    two of 8 at 6.0 ms (both stages busy), and SP's 16-row forwards took 7.0 at this point."""
    summary = _summary()
    results = summary["models"]["m"]["results"]
    results[0]["batches"][0]["gpu_forward_ms"] = {"pp rank 0, tp rank 0": {f"16@{CTX}": [9, 4.2]}}
    results[1]["batches"][0]["gpu_forward_ms"] = {"pp rank 0, tp rank 0": {f"8@{CTX}": [9, 6.0]}}
    sp_point = results[3]["batches"][0]
    sp_point["gpu_forward_ms"] = {
        "pp rank 0, tp rank 0": {f"16@{CTX}": [9, 7.0]},
        "pp rank 1, tp rank 0": {f"16@{CTX}": [9, 6.5]},
    }
    (row,) = pipeline_ratio.compare(summary)
    assert row["stage_ms_source"] == "point"
    assert (row["stage_ms_pp"], row["stage_ms_sp"]) == (6.0, 7.0)
    assert row["ideal"] == pytest.approx(2 * 6.0 / (1.25 * 7.0), abs=1e-3)
    assert row["iter_over_gpu"] == pytest.approx(5.5 / 7.0, abs=1e-3)
    assert row["later_stages"]["pp rank 1"]["gpu_ms"] == 6.5
    # without a stock point of B/N-row forwards: the servers' timers, said so
    del results[1]["batches"][0]["gpu_forward_ms"]
    (row,) = pipeline_ratio.compare(summary)
    assert row["stage_ms_source"] == "server"
    assert (row["stage_ms_pp"], row["stage_ms_sp"]) == (4.0, 5.0)


def test_the_table_prints_the_later_stages(capsys):
    pipeline_ratio.print_table(pipeline_ratio.compare(_summary()))
    assert "pp rank 1: busy 5.60 launch 4.20 (gpu 4.00)" in capsys.readouterr().out


def test_plot_draws_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    summary = _summary()
    # a point whose wall rate is off its counters is drawn at its counter rate
    summary["models"]["m"]["results"][3]["batches"][0].update(
        wall_over_counters=1.5, counter_tok_s=2000.0
    )
    out = tmp_path / "ratio.png"
    pipeline_ratio.plot(summary, pipeline_ratio.compare(summary), str(out), "title")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_stock_pp_runs_both_micro_batch_caps_and_its_async_variant_after_sp():
    cfgs = decode_throughput.plan_configs([2], [0.76], ["pp", "ppa", "sp"])
    assert [c["name"] for c in cfgs] == ["sglang_pp2", "spexis_sp2", "sglang_pp2_async1"]
    for cfg in (cfgs[0], cfgs[2]):
        assert [v["micro"] for v in cfg["variants"]] == ["sglang", "balanced"]
        assert cfg["variants"][1]["name"] == cfg["name"] + "_balanced"


def test_draft_vocabulary_runs_each_sp_server_again_with_the_flag():
    cfgs = decode_throughput.plan_configs(
        [2], [0.76, 0.6], ["pp", "sp", "spauto"], draft_vocab=32768
    )
    names = [c["name"] for c in cfgs]
    assert names == [
        "sglang_pp2",
        "spexis_sp2",
        "spexis_sp2_alphaauto",
        "spexis_sp2_draftvocab32768",
        "spexis_sp2_alphaauto_draftvocab32768",
    ]
    plain, again = cfgs[2], cfgs[4]
    assert again["args"] == plain["args"] + ["--spexis-draft-vocab", "32768"]
    assert [v["name"] for v in again["variants"]] == [
        "spexis_sp2_alphaauto_theta0.76_draftvocab32768",
        "spexis_sp2_alphaauto_theta0.6_draftvocab32768",
    ]
    assert again.get("alpha_auto") and "--spexis-draft-vocab" not in cfgs[0]["args"]


def test_auto_before_runs_the_alpha_auto_server_from_the_old_package():
    cfgs = decode_throughput.plan_configs(
        [2], [0.6], ["pp", "spauto", "spautoold"], old_python="/old/python"
    )
    assert [c["name"] for c in cfgs] == [
        "sglang_pp2",
        "spexis_sp2_alphaauto",
        "spexis_sp2_alphaauto_before",
    ]
    now, before = cfgs[1], cfgs[2]
    assert before["args"] == now["args"] and before.get("alpha_auto")
    assert before["python_path"] == "/old/python" and now.get("python_path") is None
    assert [v["name"] for v in before["variants"]] == ["spexis_sp2_alphaauto_before_theta0.6"]
    # without an old package there is nothing to run it from
    names = [c["name"] for c in decode_throughput.plan_configs([2], [0.6], ["spautoold"])]
    assert names == []


def test_plan_alpha_one_is_sp_with_every_draft_dropped():
    (cfg,) = decode_throughput.plan_configs([2], [0.6, 0.76], ["spalpha1"])
    assert cfg["kind"] == "sp" and not cfg.get("alpha_auto")
    args = cfg["args"]
    assert args[args.index("--spexis-alpha") + 1] == "1"
    assert args[args.index("--pp-size") + 1] == "2"
    assert [v["theta"] for v in cfg["variants"]] == [0.6, 0.76]


class _FakeServer:
    def __init__(self, reply):
        self.reply, self.sent = reply, []

    def post_json(self, path, obj, timeout):
        self.sent.append((path, obj))
        return self.reply


@pytest.mark.parametrize("micro,expected", [("balanced", 32), ("sglang", 513)])
def test_micro_batch_cap_per_point(micro, expected):
    srv = _FakeServer([True])
    a = argparse.Namespace(batches=[16, 64, 512], request_timeout=5)
    cfg = {"kind": "pp", "n": 2}
    # SGLang's cap is at most the server's running cap over N: one micro-batch holds any B
    assert decode_throughput.running_cap(cfg, a) == 1026
    assert decode_throughput.running_cap({"kind": "sp", "n": 2}, a) == 513
    got = decode_throughput.set_micro_batch_cap(srv, cfg, {"micro": micro}, 64, a)
    assert got == expected
    assert srv.sent == [
        ("/set_internal_state", {"server_args": {"pp_max_micro_batch_size": expected}})
    ]


def test_micro_batch_cap_refused_is_an_error_and_sp_is_left_alone():
    a = argparse.Namespace(batches=[16], request_timeout=5)
    with pytest.raises(RuntimeError, match="refused"):
        decode_throughput.set_micro_batch_cap(
            _FakeServer([False]), {"kind": "pp", "n": 2}, {"micro": "balanced"}, 16, a
        )
    srv = _FakeServer([True])
    assert decode_throughput.set_micro_batch_cap(srv, {"kind": "sp", "n": 2}, {}, 16, a) is None
    assert srv.sent == []


def test_a_pair_whose_wall_rate_is_off_its_counters_is_measured_once_more():
    calls = []

    def again(ratio):
        def measure():
            calls.append(ratio)
            return {"t_step_s": 0.01, "wall_over_counters": ratio}

        return measure

    agreeing = {"t_step_s": 0.02, "wall_over_counters": 1.05}
    assert decode_throughput.measure_again_if_wall_off(agreeing, again(1.0)) is agreeing
    assert calls == []
    off = {"t_step_s": 0.005, "wall_over_counters": 1.87}
    rec = decode_throughput.measure_again_if_wall_off(off, again(0.98))
    assert (calls, rec["wall_over_counters"]) == ([0.98], 0.98)
    assert rec["remeasured"] == {"t_step_s": [0.005, 0.01], "wall_over_counters": [1.87, 0.98]}
    # the second pair no better: the first stands, both kept
    rec = decode_throughput.measure_again_if_wall_off(dict(off), again(2.5))
    assert rec["wall_over_counters"] == 1.87 and len(rec["remeasured"]["t_step_s"]) == 2


def test_a_stock_points_stage_rows_are_the_rows_its_forwards_ran():
    """SGLang's default cap puts B = 64 into one micro-batch (the stages in turn): the point's
    own timers show 64-row forwards, and its stage table row is 64, not B/N = 32."""
    one_batch = {"gpu_forward_ms": {pipeline_ratio.STAGE0: {"64@64": [142, 3.48], "1@1": [4, 3.7]}}}
    assert pipeline_ratio.forward_rows(one_batch) == 64
    two = {"gpu_forward_ms": {pipeline_ratio.STAGE0: {"32@64": [284, 4.77]}}}
    assert pipeline_ratio.forward_rows(two) == 32
    assert pipeline_ratio.forward_rows({"batch": 64}) is None
    assert pipeline_ratio.forward_rows(None) is None


@pytest.mark.parametrize(
    "input_len, output_len, ctx", [(128, 128, 64), (2048, 128, 512), (4, 2, 1), (448, 128, 512)]
)
def test_ctx_bucket_is_the_timers_key(input_len, output_len, ctx):
    """A sweep's bucket is the ``ctx`` of the timers' key for rows at its mean context."""
    from spexis_sglang.srt.stats import GpuForwardTimer

    assert pipeline_ratio.ctx_bucket(input_len, output_len) == ctx
    mean = input_len + output_len / 2
    assert GpuForwardTimer.key(16, int(16 * mean)) == f"16@{ctx}"
    assert GpuForwardTimer.rows_of(f"16@{ctx}") == 16
    assert GpuForwardTimer.key(16, 0) == "16@0"
