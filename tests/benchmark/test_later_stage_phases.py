"""A later pipeline stage's loop phases reach the decode benchmark through the log: each later
rank logs its state when a ``/server_info`` request reaches it (``stats.log_rank_state``), and
``decode_throughput`` pairs those lines with its own calls by their start times. Lines are
written by the server's own function, so writer and reader agree on the format."""

import logging
import os
import sys
from types import SimpleNamespace

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "benchmark", "gpu"))

import decode_throughput  # noqa: E402

from spexis_sglang.srt import stats  # noqa: E402


def state(iterations: int, decode: int, busy_s: float, launch_s: float) -> dict:
    return {
        "iterations": iterations,
        "decode_iterations": decode,
        "time_busy_s": busy_s,
        "time_launch_s": launch_s,
    }


@pytest.fixture
def log_file(tmp_path, monkeypatch, caplog):
    path = tmp_path / "server.log"
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("[%(asctime)s PP1] %(message)s"))
    stats.logger.addHandler(handler)
    # setLevel, not the attribute: a logger caches whether a level is on, and an earlier
    # test in the worker may have asked it at WARNING
    caplog.set_level(logging.INFO, logger=stats.logger.name)
    clock = iter([10.0, 10.5, 13.0, 20.9, 31.0, 40.0])
    monkeypatch.setattr(stats, "time", SimpleNamespace(time=lambda: next(clock)))
    # the four calls of one short/long pair are answered at 10.5, 13.0, 20.9, 31.0 (the
    # second well after it began: stage 0 had replied); 10.0 and 40.0 answer other calls
    for it, dec, busy, launch in [
        (0, 0, 0.0, 0.0),
        (5, 4, 0.1, 0.05),
        (25, 20, 0.5, 0.25),
        (25, 20, 0.5, 0.25),
        (85, 76, 1.7, 0.85),
        (90, 80, 1.8, 0.9),
    ]:
        # the rank's GPU timers: 10 forwards of 64 rows at 5 ms a step of the clock
        gpu = {"64@64": [10 * it, 5.0 + it / 100]} if it else {}
        line = {"spexis": state(it, dec, busy, launch), "spexis_gpu_forward_ms": gpu}
        stats.log_rank_state("pp rank 1", line)
    stats.logger.removeHandler(handler)
    handler.close()
    return str(path)


def test_each_call_takes_the_first_state_logged_after_it_began(log_file):
    states = decode_throughput.rank_states(log_file)
    assert list(states) == ["pp rank 1"] and len(states["pp rank 1"]) == 6
    # the calls began at 10.2, 12.0, 20.0, 30.0: before the short run, after it, before the
    # long run, after it
    snapshots = [[10.2, 10.3], [12.0, 12.1], [20.0, 20.1], [30.0, 30.1]]
    later = decode_throughput.later_stage_phases(states, snapshots)
    st = later["pp rank 1"]
    # short: 25 - 5 = 20 iterations; long: 85 - 25 = 60; the difference, 40 iterations, took
    # 1.2 - 0.4 = 0.8 s busy and 0.6 - 0.2 = 0.4 s launching
    assert st["iterations"] == 40 and st["decode_iterations"] == 40
    assert st["phase_ms_per_iteration"] == {"busy": 20.0, "launch": 10.0}


def test_a_call_the_rank_never_answered_leaves_it_out(log_file):
    states = decode_throughput.rank_states(log_file)
    # no state between 13.5 and 20.0: the second call went unanswered
    snapshots = [[10.2, 10.3], [13.5, 13.6], [20.0, 20.1], [30.0, 30.1]]
    assert decode_throughput.later_stage_phases(states, snapshots) == {}
    assert decode_throughput.later_stage_phases(states, snapshots[:3]) == {}


def test_points_get_their_later_stages_and_lose_the_spans(log_file):
    rec = {"batch": 16, "snapshots": [[10.2, 10.3], [12.0, 12.1], [20.0, 20.1], [30.0, 30.1]]}
    results = [{"batches": [rec, {"batch": 32, "error": "x"}]}]
    decode_throughput.attach_later_stages(results, log_file)
    assert "snapshots" not in rec
    assert rec["later_stages"]["pp rank 1"]["iterations"] == 40
    # no stage-0 timers in the point (SPEXIS_GPU_TIMERS off): none of the later ranks' either
    assert "gpu_forward_ms" not in rec and "gpu_forward_ms" not in rec["later_stages"]["pp rank 1"]


def test_a_later_ranks_gpu_times_are_the_points_own(log_file):
    stage0 = {"64@64": [3, 4.0]}
    rec = {
        "snapshots": [[10.2, 10.3], [12.0, 12.1], [20.0, 20.1], [30.0, 30.1]],
        "gpu_forward_ms": {"pp rank 0, tp rank 0": stage0},
    }
    decode_throughput.attach_later_stages([{"batches": [rec]}], log_file)
    # states at 10.5 (50 forwards, mean 5.05 ms) and 31.0 (850, mean 5.85): the 800 between
    # them took (850 * 5.85 - 50 * 5.05) / 800 ms each
    mean = round((850 * 5.85 - 50 * 5.05) / 800, 4)
    assert rec["gpu_forward_ms"] == {
        "pp rank 0, tp rank 0": stage0,
        "pp rank 1, tp rank 0": {"64@64": [800, mean]},
    }
    assert "gpu_forward_ms" not in rec["later_stages"]["pp rank 1"]


def test_gpu_time_deltas_keep_the_forwards_between_two_snapshots():
    before = {"32@64": [10, 6.0], "64@64": [5, 4.0]}
    after = {"32@64": [30, 7.0], "64@64": [5, 4.0], "128@64": [2, 9.0]}
    assert stats.gpu_time_deltas(before, after) == {"32@64": [20, 7.5], "128@64": [2, 9.0]}
    assert stats.gpu_time_deltas(None, after) == after


def test_phases_per_iteration_come_from_decode_only_iterations_where_counted():
    # the short run's prefill landed in "launch", the long run's in "process": over all
    # iterations launch's difference comes out negative; over decode-only ones it does not
    short = {"iterations": 20, "time_launch_s": 0.050, "time_process_s": 0.010}
    long = {"iterations": 120, "time_launch_s": 0.040, "time_process_s": 0.150}
    assert decode_throughput.phase_ms_per_iteration(short, long)["launch"] < 0
    short.update(
        decode_timed_iterations=18, decode_time_launch_s=0.018, decode_time_process_s=0.009
    )
    long.update(
        decode_timed_iterations=118, decode_time_launch_s=0.118, decode_time_process_s=0.059
    )
    assert decode_throughput.phase_ms_per_iteration(short, long) == {"launch": 1.0, "process": 0.5}
    # a server that counts no decode-only iterations: every iteration, as before
    none = dict(short, decode_timed_iterations=0), dict(long, decode_timed_iterations=0)
    assert decode_throughput.phase_ms_per_iteration(*none)["process"] == 1.4


def test_the_alpha_controller_keys_recorded_are_in_its_state():
    """Every key the decode benchmark records of ``auto``'s controller is one it reports."""
    from spexis_sglang.core.online_alpha import OnlineAlpha

    oa = OnlineAlpha(2)
    for _ in range(60):
        oa.next_iteration(16)
        oa.record_iteration(16, 0.01)
    assert set(decode_throughput.ALPHA_CONTROLLER_KEYS) <= set(oa.as_dict())


def test_the_cpu_loop_benchmark_reads_a_later_rank_over_its_window(tmp_path, monkeypatch, caplog):
    """``benchmark/decode/sp_loop_overhead.py``: the window's two ``/server_info`` calls began
    at 12.0 and 30.0; the rank's first states logged after each (at 13.0 and 31.0) bound it."""
    sys.path.insert(0, os.path.join(HERE, "..", "..", "benchmark", "decode"))
    import sp_loop_overhead

    path = tmp_path / "server.log"
    handler = logging.FileHandler(path)
    stats.logger.addHandler(handler)
    caplog.set_level(logging.INFO, logger=stats.logger.name)  # see log_file
    clock = iter([11.0, 13.0, 14.0, 31.0])
    monkeypatch.setattr(stats, "time", SimpleNamespace(time=lambda: next(clock)))
    for it, busy_cpu, launch_cpu in [
        (10, 0.1, 0.05),
        (20, 0.2, 0.1),
        (25, 0.3, 0.2),
        (70, 1.1, 0.6),
    ]:
        st = {
            **state(it, it, 2 * busy_cpu, 0.0),
            "cpu_busy_s": busy_cpu,
            "cpu_launch_s": launch_cpu,
        }
        stats.log_rank_state("pp rank 1", {"spexis": st})
    stats.logger.removeHandler(handler)
    handler.close()
    got = sp_loop_overhead.later_ranks(str(path), 12.0, 30.0, ("launch", "process"))
    # 20 -> 70 decode iterations: 0.9 s of CPU busy, 0.5 s of it launching; no process timer
    assert got == {
        "pp rank 1": {
            "iterations": 50,
            "cpu_ms_per_iteration": {"launch": 10.0},
            "cpu_busy_ms_per_iteration": 18.0,
            "wall_busy_ms_per_iteration": 36.0,
        }
    }
    assert sp_loop_overhead.later_ranks(str(path), 12.0, 35.0, ("launch",)) == {}  # none after
