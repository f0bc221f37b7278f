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


# -- the steady-state rate: every request running, each run's end left out ----------------


def sp_polls(batch: int, finish_at: float, rate: float, every: float = 0.25) -> list:
    """Stage 0's SP counters polled during a long run: ``rate`` tokens/s while all ``batch``
    requests run, then the requests finishing one by one (a random number of tokens a row under
    forced acceptance) at a quarter of the rate."""
    polls, tokens, t = [], 0.0, every
    while t < finish_at + 1.0:
        running = batch if t < finish_at else max(1, batch - int(4 * (t - finish_at) * batch))
        tokens += (rate if running == batch else rate / 4) * every
        polls.append((t, {"tokens_committed": int(tokens), "running_requests": running}))
        t += every
    return polls


def test_sp_steady_rate_leaves_out_the_requests_staggered_finish() -> None:
    polls = sp_polls(batch=16, finish_at=2.9, rate=2000.0)
    got = decode_throughput.steady_rate(polls, "sp", 16, after_s=0.6)
    assert got["tok_s"] == pytest.approx(2000.0, rel=0.01)
    # from the first poll after the short run's length to the last with all 16 running
    assert got["window_s"] == pytest.approx(2.75 - 0.75)
    assert got["polls"] == 9
    # the same polls through to the last read the finishing tail too: well below the rate
    (t_a, a), (t_b, b) = polls[2], polls[-1]
    assert b["tokens_committed"] - a["tokens_committed"] < 0.8 * 2000.0 * (t_b - t_a)


def test_stock_steady_rate_counts_decode_rows_and_drops_the_last_poll() -> None:
    polls = [(0.25 * k, {"decode_rows": 32 * 100 * k}) for k in range(1, 13)]
    polls[-1][1]["decode_rows"] += 5000  # a poll inside the run's last steps: left out
    got = decode_throughput.steady_rate(polls, "pp", 64, after_s=0.5)
    assert got["tok_s"] == pytest.approx(3200 / 0.25)
    assert got["polls"] == 10


def test_no_steady_rate_without_a_window_or_a_gauge() -> None:
    polls = sp_polls(batch=16, finish_at=2.9, rate=2000.0)
    assert decode_throughput.steady_rate(polls, "sp", 32, after_s=0.6) is None  # never all 32
    assert decode_throughput.steady_rate(polls, "sp", 16, after_s=2.7) is None  # window too short
    no_gauge = [(t, {"tokens_committed": st["tokens_committed"]}) for t, st in polls]
    assert decode_throughput.steady_rate(no_gauge, "sp", 16, after_s=0.6) is None
    assert decode_throughput.steady_rate(polls, "tp", 16, after_s=0.6) is None
