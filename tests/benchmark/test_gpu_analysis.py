"""benchmark/gpu/analyze.py: how GPU results become ratios and planner errors.

Synthetic ``decode_throughput.json`` inputs (no server, no timing): the numbers are chosen so
that every ratio below is known exactly.
"""

import json
import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "benchmark", "gpu"))

import analyze  # noqa: E402

BATCHES = [16, 32]


def _run(config, kind, n, tok_s, theta=None, measured_head=False, iter_ms=None):
    batches = []
    for b, tps in zip(BATCHES, tok_s):
        t_step = b / tps
        rec = {"batch": b, "decode_tok_s": tps, "t_step_s": t_step}
        if kind == "pp":
            rec["stage_batch"], rec["stage_time_s"] = b / n, t_step / n
        if kind == "sp":
            rec["sp"] = {"acceptance": theta, "iter_time_s": iter_ms / 1e3, "rows_per_iteration": b}
        batches.append(rec)
    return {
        "config": config,
        "kind": kind,
        "n": n,
        "gpus": 1 if (kind == "pp" and n == 1) else 2,
        "status": "run",
        "theta_forced": theta,
        "measured_head_theta": measured_head,
        "max_running_requests": 32,
        "batches": batches,
    }


def _file(path, results, not_run=()):
    d = {
        "batches": BATCHES,
        "input_len": 128,
        "output_len": 128,
        "short_output_len": 16,
        "kv_budget": {"max_total_tokens": 140000},
        "not_run": list(not_run),
        "models": {"m": {"results": results}},
    }
    path.write_text(json.dumps(d))
    return str(path)


@pytest.fixture
def inputs(tmp_path):
    a = _file(
        tmp_path / "a.json",
        [
            _run("sglang_pp2", "pp", 2, [400.0, 750.0]),
            _run("spexis_sp2_theta0.76", "sp", 2, [600.0, 1500.0], theta=0.76, iter_ms=20.0),
        ],
        not_run=[{"model": "m", "config": "sglang_tp2", "why": "time budget"}],
    )
    b = _file(
        tmp_path / "b.json",
        [
            _run("sglang_pp1", "pp", 1, [700.0, 1400.0]),
            _run("sglang_tp2", "tp", 2, [300.0, 500.0]),
            # the other stock-PP setting: faster at B=16 only
            _run("sglang_pp2_async1", "pp", 2, [500.0, 600.0]),
        ],
    )
    return a, b


def test_inputs_of_one_model_are_one_run_against_the_faster_pp_setting(inputs, tmp_path):
    out = tmp_path / "an.json"
    analyze.main([*inputs, "--out", str(out), "--markdown", str(tmp_path / "an.md")])
    s = json.loads(out.read_text())
    # tp2 ran in the second call: no longer "not run"
    assert s["not_run"] == []
    rows = {r["batch"]: r for r in s["models"]["m"]["sp"]["spexis_sp2_theta0.76"]["rows"]}
    assert rows[16]["pp_config"] == "sglang_pp2_async1" and rows[16]["sp_over_pp"] == 1.2
    assert rows[32]["pp_config"] == "sglang_pp2" and rows[32]["sp_over_pp"] == 2.0
    assert rows[16]["sp_over_tp"] == 2.0 and rows[32]["sp_over_tp"] == 3.0
    # Eq. 2 with SP's own iteration time: B*_eff(B, 2, 0.76) / 20 ms
    beff = 16 / (2 - 0.76)
    assert rows[16]["pred_from_sp_latency_tok_s"] == pytest.approx(beff / 0.02, abs=0.1)


def test_planner_prediction_beside_measurement(inputs, tmp_path):
    out = tmp_path / "an.json"
    analyze.main([*inputs, "--out", str(out)])
    pvm = json.loads(out.read_text())["models"]["m"]["planner_vs_measured"]
    by = {(r["batch"], r["mode"]): r for r in pvm}
    assert {m for _, m in by} == {"PP", "SP", "TP"}
    tp = by[(32, "TP")]
    assert tp["measured_config"] == "sglang_tp2" and tp["error"] == pytest.approx(0.0, abs=1e-3)
    # SP: Eq. 2 on SP's own iteration time and the profile's Θ (the SP run's acceptance)
    assert by[(16, "SP")]["predicted_tok_s"] == pytest.approx(16 / (2 - 0.76) / 0.02, abs=0.1)
    # the profile holds stock PP's faster setting at each B: async depth 1 at B=16 (500 tok/s
    # against 400), depth 0 at B=32, so the planner predicts both points exactly
    for b, cfg in ((16, "sglang_pp2_async1"), (32, "sglang_pp2")):
        pp = by[(b, "PP")]
        assert pp["measured_config"] == cfg
        assert pp["error"] == pytest.approx(0.0, abs=1e-3), b
    sp = by[(32, "SP")]
    assert sp["error"] == pytest.approx(sp["predicted_tok_s"] / 1500.0 - 1.0, abs=1e-3)


def test_inputs_with_different_workloads_are_refused(inputs, tmp_path):
    d = json.loads(open(inputs[1]).read())
    d["output_len"] = 256
    other = tmp_path / "c.json"
    other.write_text(json.dumps(d))
    with pytest.raises(SystemExit):
        analyze.main([inputs[0], str(other), "--out", str(tmp_path / "x.json")])
