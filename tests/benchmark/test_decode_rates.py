"""The decode benchmark's second rate, from stage 0's own counters (``counter_tok_s``): it
must not move when a run pays a one-time cost, which the wall-clock difference of a short and
a long run does (a slow first run at a batch size once read 1.27x the true rate)."""

import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "benchmark", "gpu"))

import decode_throughput  # noqa: E402
from pipeline_ratio import counter_tok_s  # noqa: E402


def counters(decode_iterations: int, busy_s: float, tokens: int) -> dict:
    return {
        "iterations": decode_iterations + 9,
        "decode_iterations": decode_iterations,
        "decode_timed_iterations": decode_iterations,
        "decode_time_busy_s": busy_s,
        "decode_time_launch_s": 0.1 * busy_s,
        "time_busy_s": busy_s + 1.5,  # with the run's prefills
        "tokens_committed": tokens,
    }


def sp_point(short: dict, long: dict) -> dict:
    phases = decode_throughput.phase_ms_per_iteration(short, long)
    return {"batch": 512, "sp": {"short": short, "long": long, "phase_ms_per_iteration": phases}}


def test_sp_rate_is_tokens_per_decode_iteration_over_its_loop_time() -> None:
    # SP at alpha 1, B = 512 on the box: 224 more decode iterations of 256 tokens, 10.96 ms each
    short, long = counters(31, 0.3869, 7680), counters(255, 0.3869 + 224 * 0.01096, 65024)
    rate = counter_tok_s(sp_point(short, long), "sp", 2)
    assert rate == pytest.approx(256 / 0.01096, rel=1e-6)
    # the same counters whatever the runs' wall times were: 1.93 s read 29,653 tok/s
    assert 512 * 112 / 1.9338 / rate == pytest.approx(1.27, abs=0.01)


def test_stock_rate_is_a_micro_batch_per_iteration() -> None:
    short, long = counters(40, 0.5, 0), counters(264, 0.5 + 224 * 0.01399, 0)
    point = {
        "batch": 512,
        "stock_phase_ms_per_iteration": (decode_throughput.phase_ms_per_iteration(short, long)),
    }
    assert counter_tok_s(point, "pp", 2) == pytest.approx(256 / 0.01399, rel=1e-6)


def test_no_rate_without_decode_timers_or_iterations() -> None:
    assert counter_tok_s({"batch": 64, "sp": {}}, "sp", 2) is None
    assert counter_tok_s({"batch": 64}, "pp", 2) is None
    same = counters(31, 0.4, 960)
    assert counter_tok_s(sp_point(same, same), "sp", 2) is None
    assert counter_tok_s(sp_point(same, counters(40, 0.5, 960)), "sp", 2) is None  # no tokens
    assert (
        counter_tok_s({"batch": 64, "stock_phase_ms_per_iteration": {"busy": 5}}, "tp", 2) is None
    )
