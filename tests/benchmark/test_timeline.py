"""The trace reader of ``benchmark/gpu/timeline.py`` and the ranges it reads
(``srt/profiling.ProfilerRanges``).

The reader is checked on a trace built by hand, whose forwards have known host spans, graph
and eager kernels and device gaps; the ranges on a real ``torch.profiler`` trace of the CPU,
read back by the same reader."""

import gzip
import json
import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "benchmark", "gpu"))

import timeline  # noqa: E402

from spexis_sglang.srt import profiling  # noqa: E402


def x(cat, name, ts, dur, **args):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "args": args}


class Stream:
    """One device stream: a kernel starts 10 µs after its launch or when the previous one ends."""

    def __init__(self):
        self.free = 0.0

    def run(self, launched: float, dur: float) -> float:
        start = max(launched + 10, self.free)
        self.free = start + dur
        return start


def forward_events(stream: Stream, start: float, corr: int, host_gap: float):
    """One forward at ``start`` (µs): ``host_gap + 500`` µs of host work; a 100 µs eager
    kernel launched at once, a graph of 3,000 + 2,000 µs launched at ``host_gap`` and a 200 µs
    eager kernel launched 100 µs after the graph."""
    g0 = start + host_gap
    k0 = stream.run(start + 10, 100)
    k1 = stream.run(g0 + 10, 3000)
    k2 = stream.run(k1 + 3000 - 10, 2000)
    k3 = stream.run(g0 + 100, 200)
    return [
        x("user_annotation", "spexis::run_batch", start, host_gap + 500),
        x("user_annotation", "spexis::_sp_launch", start - 50, host_gap + 600),
        x("cuda_runtime", "cudaLaunchKernel", start + 10, 5, correlation=corr),
        x("kernel", "index_kernel", k0, 100, correlation=corr),
        x("cuda_runtime", "cudaGraphLaunch", g0, 20, correlation=corr + 1),
        x("kernel", "gemm", k1, 3000, correlation=corr + 1),
        x("kernel", "attn", k2, 2000, correlation=corr + 1),
        x("cuda_runtime", "cudaLaunchKernel", g0 + 100, 5, correlation=corr + 2),
        x("kernel", "argmax_kernel", k3, 200, correlation=corr + 2),
        x("cpu_op", "aten::index", start + 5, 40),
    ]


def synthetic_trace(host_gap: float, forwards: int = 10, period: float = 8000.0):
    stream, events = Stream(), []
    for i in range(forwards):
        events += forward_events(stream, i * period, 10 * i, host_gap)
    return events


def test_forward_split_into_device_work_and_host_gaps():
    a = timeline.analyse(synthetic_trace(host_gap=1000.0), skip=2)
    assert a["forwards"] == 6
    assert a["period_ms"]["median"] == pytest.approx(8.0)
    pf = a["per_forward"]
    # graph: 5,000 µs busy; eager: 100 before it, 200 after it
    assert pf["graph_ms"]["median"] == pytest.approx(5.0)
    assert pf["graph_busy_ms"]["median"] == pytest.approx(5.0)
    assert pf["eager_before_graph_ms"]["median"] == pytest.approx(0.1)
    assert pf["eager_after_graph_ms"]["median"] == pytest.approx(0.2)
    # the span runs from the launch's start (the device was idle) to the last kernel's end:
    # 1,000 + 20 + 5,000 + 200 µs; busy 5,300; the rest the device waited on the host
    assert pf["device_span_ms"]["median"] == pytest.approx(6.22)
    assert pf["device_busy_ms"]["median"] == pytest.approx(5.3)
    assert pf["device_idle_in_span_ms"]["median"] == pytest.approx(0.92)
    assert pf["host_before_graph_launch_ms"]["median"] == pytest.approx(1.0)
    assert pf["device_idle_before_graph_ms"]["median"] == pytest.approx(1.02 - 0.1)
    assert pf["eager_kernels"]["median"] == 2
    # host time per loop step per forward, over the kept window
    assert a["host_ms_per_forward_by_step"]["run_batch"] == pytest.approx(1.5)
    assert a["host_ms_per_forward_by_step"]["_sp_launch"] == pytest.approx(1.6)
    kernels = {k["kernel"]: k for k in a["eager_device_work_per_forward"]}
    assert kernels["argmax_kernel"]["us"] == pytest.approx(200)
    replayed = {k["kernel"]: k for k in a["graph_device_work_per_forward"]}
    assert replayed["gemm"]["us"] == pytest.approx(3000)
    assert replayed["attn"]["count"] == 1
    assert "argmax_kernel" not in replayed
    calls = {c["name"]: c for c in a["host_calls_in_run_batch_per_forward"]}
    assert calls["aten::index"]["us"] == pytest.approx(40)
    assert calls["cudaLaunchKernel"]["count"] == 2


def test_host_gap_shows_as_device_idle():
    short = timeline.analyse(synthetic_trace(host_gap=200.0))["per_forward"]
    long = timeline.analyse(synthetic_trace(host_gap=1200.0))["per_forward"]
    # the same device work; a launch 1 ms later is 1 ms more idle inside the span
    assert long["device_busy_ms"]["median"] == pytest.approx(short["device_busy_ms"]["median"])
    idle = long["device_idle_in_span_ms"]["median"] - short["device_idle_in_span_ms"]["median"]
    assert idle == pytest.approx(1.0)


def test_previous_forward_still_running_is_not_idle():
    # forwards launched 3 ms apart with 5.3 ms of device work each: the stream falls behind
    # and never waits on the host
    a = timeline.analyse(synthetic_trace(host_gap=200.0, period=3000.0, forwards=12))
    pf = a["per_forward"]
    assert pf["device_idle_in_span_ms"]["max"] < 0.05
    assert a["device_busy_fraction"] > 0.95


def test_too_few_forwards_is_said():
    a = timeline.analyse(synthetic_trace(host_gap=200.0, forwards=4))
    assert "too few" in a["error"]


def test_ranges_in_a_real_trace_read_back(tmp_path):
    torch = pytest.importorskip("torch")

    class Loop:
        def run_batch(self, n):
            return torch.ones(n).sum()

        def _sp_launch(self, n):
            return self.run_batch(n)

    loop = Loop()
    ranges = profiling.ProfilerRanges(loop, ("run_batch", "_sp_launch", "not_a_method"))
    assert ranges.names == ("run_batch", "_sp_launch")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(10):
            assert loop._sp_launch(4).item() == 4
    folder = tmp_path / "sp"
    folder.mkdir()
    path = folder / "trace-TP-0-PP-0.trace.json"
    prof.export_chrome_trace(str(path))
    with open(path, "rb") as f, gzip.open(str(path) + ".gz", "wb") as g:
        g.write(f.read())
    os.remove(path)
    summary = timeline.summarise([str(tmp_path)], skip=1)
    a = summary["sp"]["pp0"]
    assert a["forwards_in_trace"] == 10 and a["forwards"] == 8
    steps = a["host_ms_per_forward_by_step"]
    assert set(steps) == {"run_batch", "_sp_launch"}
    assert steps["_sp_launch"] >= steps["run_batch"] > 0
    names = [c["name"] for c in a["host_calls_in_run_batch_per_forward"]]
    assert any(n.startswith("aten::") for n in names)
    # the CLI writes the same summary
    out = tmp_path / "timeline.json"
    assert timeline.main([str(tmp_path), "--skip", "1", "--out", str(out)]) == 0
    assert json.loads(out.read_text())["sp"]["pp0"]["forwards"] == 8
