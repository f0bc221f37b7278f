"""benchmark/sim/validate.py: a box point whose requests exceed the run's KV budget is told
apart (SGLang runs fewer of them at once and retracts some; the simulator runs them all)."""

import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.join(HERE, "..", "..")
sys.path.insert(0, os.path.join(ROOT, "benchmark", "sim"))

import validate  # noqa: E402


def test_points_beyond_the_kv_budget_are_kv_bound():
    run = {"kv_budget": {"max_total_tokens": 100000}, "output_len": 128}
    assert not validate._kv_bound(run, 256, 128)  # 65,536 tokens
    assert validate._kv_bound(run, 512, 128)  # 131,072
    assert not validate._kv_bound(run, 32, 2048)  # 69,632
    assert validate._kv_bound(run, 64, 2048)  # 139,264
    assert not validate._kv_bound({"output_len": 128}, 4096, 128)  # no budget recorded


def test_the_committed_box_runs_mark_exactly_their_over_budget_points():
    with open(os.path.join(ROOT, "benchmark", "results", "sim_validation.json")) as f:
        points = json.load(f)["points"]
    for p in points:
        if p["section"] not in ("box_new_loop", "box_qwen3_32b"):
            continue
        with open(os.path.join(ROOT, p["file"])) as f:
            run = json.load(f)
        over = p["batch"] * (p["input_len"] + run["output_len"])
        assert (p["role"] == "kv_bound") == (over > run["kv_budget"]["max_total_tokens"]), p
    assert any(p["role"] == "kv_bound" for p in points)


def test_a_pp1_point_with_forwards_short_of_its_batch_is_told_apart():
    """SGLang ran 255 of 256 requests and then the last one alone: every one of its 288
    forwards has fewer rows than B (the GPU timers' ``rows@context`` keys)."""
    short = {
        "gpu_forward_ms": {"pp rank 0, tp rank 0": {"1@64": [144, 1.43], "255@64": [144, 1.2]}}
    }
    full = {"gpu_forward_ms": {"pp rank 0, tp rank 0": {"64@64": [144, 1.26]}}}
    assert validate._short_forwards(short, 256) == 288
    assert validate._short_forwards(full, 64) == 0
    assert validate._short_forwards({}, 64) == 0  # no timers: nothing to tell


def test_the_committed_h100_pp1_points_are_short_exactly_where_their_timers_say():
    with open(os.path.join(ROOT, "benchmark", "results", "sim_validation.json")) as f:
        points = [p for p in json.load(f)["points"] if p["section"] == "h100_pp1"]
    assert {p["role"] for p in points} == {"validation", "short_of_batch"}
    for p in points:
        assert (p["role"] == "short_of_batch") == (p["short_forwards"] > 0), p
