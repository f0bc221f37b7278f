#!/usr/bin/env python3
"""What a PP rank's host and device did per forward, from a torch.profiler trace.

Reads the Chrome traces SGLang's ``/start_profile`` writes per rank (``*.trace.json.gz``) of a
server started with ``SPEXIS_PROFILE_RANGES=1`` (each step of the PP loop a ``spexis::<step>``
range: ``srt/profiling.py``) and answers, per rank, over the profiled decode forwards:

* the loop's period (from one ``spexis::run_batch`` to the next) and the host's time in each
  loop step per iteration;
* per forward: the host's time in ``run_batch``; the device work it launched (CUDA-graph
  kernels, eager kernels and copies, matched to their launches by correlation id) and how
  busy the device was from the moment the launch began (or the previous forward's work
  ended, if later) to the forward's last kernel: what a CUDA-event timer around the launch
  reads, split into device work and idle gaps (the device waiting for the host);
* the host ops and the CUDA runtime calls that took the most time inside ``run_batch``, and
  the eager device work by kernel;
* with several ranks' traces of one server (ranks sharing one GPU): the idle gaps inside each
  rank's CUDA-graph replays, and how much of them another rank's kernels filled.

    python3 benchmark/gpu/timeline.py TRACE_DIR_OR_FILES... --out timeline.json
"""

from __future__ import annotations

import argparse
import bisect
import glob
import gzip
import json
import os
import re
import statistics
import sys
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

RANGE_PREFIX = "spexis::"  # srt/profiling.RANGE_PREFIX (this script runs without the package)
GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
LAUNCH_CATS = ("cuda_runtime", "cuda_driver")


def load_events(path: str) -> List[Dict[str, Any]]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    return [e for e in events if e.get("ph") == "X" and "dur" in e]


def _merged(intervals: Iterable[Tuple[float, float]]) -> List[Tuple[float, float]]:
    out: List[Tuple[float, float]] = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], e))
        else:
            out.append((s, e))
    return out


def union_length(intervals: Iterable[Tuple[float, float]]) -> float:
    """Total length covered by ``(start, end)`` intervals."""
    return sum(e - s for s, e in _merged(intervals))


def _busy(ops: Iterable[Dict[str, Any]]) -> float:
    """Time (µs) covered by trace events ``ops``."""
    return union_length((op["ts"], op["ts"] + op["dur"]) for op in ops)


def _stats(values: Sequence[float]) -> Optional[Dict[str, float]]:
    if not values:
        return None
    return {
        "mean": round(statistics.fmean(values), 4),
        "median": round(statistics.median(values), 4),
        "min": round(min(values), 4),
        "max": round(max(values), 4),
    }


def rank_label(path: str) -> str:
    m = re.search(r"PP-(\d+)", os.path.basename(path))
    return f"pp{m.group(1)}" if m else os.path.basename(path).split(".")[0]


def _per_forward(by_kernel: Dict[str, List[float]], n: int, top: int) -> List[Dict[str, Any]]:
    """The ``top`` kernels by device time: launches and µs per forward over ``n`` forwards."""
    return [
        {"kernel": k, "count": round(len(v) / n, 2), "us": round(sum(v) / n, 2)}
        for k, v in sorted(by_kernel.items(), key=lambda kv: -sum(kv[1]))[:top]
    ]


def analyse(events: List[Dict[str, Any]], skip: int = 2, top: int = 12) -> Dict[str, Any]:
    """One rank's trace: see the module's docstring. ``skip`` forwards at either end are left
    out (the profiler starts and stops inside them)."""
    ranges = [e for e in events if e.get("cat") == "user_annotation"]
    ranges = [e for e in ranges if e["name"].startswith(RANGE_PREFIX)]
    forwards = sorted(
        (e for e in ranges if e["name"] == RANGE_PREFIX + "run_batch"), key=lambda e: e["ts"]
    )
    gpu_ops = [e for e in events if e.get("cat") in GPU_CATS]
    launches = {
        e["args"]["correlation"]: e
        for e in events
        if e.get("cat") in LAUNCH_CATS and "correlation" in e.get("args", {})
    }
    by_launch: Dict[int, List[Dict[str, Any]]] = {}
    for op in gpu_ops:
        corr = op.get("args", {}).get("correlation")
        if corr in launches:
            by_launch.setdefault(corr, []).append(op)
    launch_list = sorted(launches.values(), key=lambda e: e["ts"])
    out: Dict[str, Any] = {"forwards_in_trace": len(forwards), "gpu_ops_in_trace": len(gpu_ops)}
    if len(forwards) < 2 * skip + 2:
        out["error"] = f"too few spexis::run_batch ranges ({len(forwards)})"
        return out
    kept = forwards[skip : len(forwards) - skip]
    t0, t1 = kept[0]["ts"], kept[-1]["ts"]
    periods = [b["ts"] - a["ts"] for a, b in zip(kept, kept[1:])]
    out["forwards"] = len(kept)
    out["period_ms"] = _stats([p / 1e3 for p in periods])

    # the host's time per loop step, per forward, over the kept periods: a range belongs to
    # the last forward that began before it ended (a step that holds the forward, as
    # _sp_launch holds run_batch, and the forward itself then count for the same forwards;
    # by start time, the first kept forward's _sp_launch, begun before it, would drop out
    # while the last one's came in)
    starts = [f["ts"] for f in forwards]
    steps: Dict[str, float] = {}
    for e in ranges:
        i = bisect.bisect_right(starts, e["ts"] + e["dur"]) - 1
        if skip <= i < skip + len(periods):
            name = e["name"][len(RANGE_PREFIX) :]
            steps[name] = steps.get(name, 0.0) + e["dur"]
    n_periods = len(periods)
    out["host_ms_per_forward_by_step"] = {
        k: round(v / 1e3 / n_periods, 4) for k, v in sorted(steps.items(), key=lambda kv: -kv[1])
    }

    # the device over the same window: busy, and each forward's own work
    window = [(op["ts"], op["ts"] + op["dur"]) for op in gpu_ops if t0 <= op["ts"] < t1]
    out["device_busy_fraction"] = round(union_length(window) / (t1 - t0), 4) if t1 > t0 else None
    rows: Dict[str, List[float]] = {}
    prev_end = None
    li = 0
    eager_by_kernel: Dict[str, List[float]] = {}
    graph_by_kernel: Dict[str, List[float]] = {}
    for idx, fwd in enumerate(forwards):
        s, e = fwd["ts"], fwd["ts"] + fwd["dur"]
        while li < len(launch_list) and launch_list[li]["ts"] < s:
            li += 1
        ops, graph_ops, eager_ops, calls = [], [], [], []
        j = li
        while j < len(launch_list) and launch_list[j]["ts"] < e:
            call = launch_list[j]
            calls.append(call)
            mine = by_launch.get(call["args"]["correlation"], [])
            ops += mine
            if "Graph" in call["name"]:
                graph_ops += mine
            else:
                eager_ops += mine
            j += 1
        if not ops:
            continue
        first = min(op["ts"] for op in ops)
        last = max(op["ts"] + op["dur"] for op in ops)
        if not skip <= idx < len(forwards) - skip:  # only where the previous one's work ends
            prev_end = last
            continue
        # what a CUDA-event timer recorded at the launch's start reads: from when the stream
        # reached it (the later of the launch's start and the previous forward's last work)
        span_start = s if prev_end is None else max(s, min(prev_end, first))
        busy = _busy(ops)
        span = last - span_start
        rows.setdefault("host_run_batch_ms", []).append(fwd["dur"] / 1e3)
        rows.setdefault("device_span_ms", []).append(span / 1e3)
        rows.setdefault("device_busy_ms", []).append(busy / 1e3)
        rows.setdefault("device_idle_in_span_ms", []).append(max(0.0, span - busy) / 1e3)
        rows.setdefault("device_idle_before_first_ms", []).append(
            max(0.0, first - span_start) / 1e3
        )
        rows.setdefault("host_after_last_launch_ms", []).append(
            max(0.0, e - max(c["ts"] + c["dur"] for c in calls)) / 1e3
        )
        if graph_ops:
            g_first = min(op["ts"] for op in graph_ops)
            g_last = max(op["ts"] + op["dur"] for op in graph_ops)
            rows.setdefault("graph_ms", []).append((g_last - g_first) / 1e3)
            eager_before = _busy(op for op in eager_ops if op["ts"] < g_first)
            rows.setdefault("graph_busy_ms", []).append(_busy(graph_ops) / 1e3)
            rows.setdefault("eager_before_graph_ms", []).append(eager_before / 1e3)
            rows.setdefault("eager_after_graph_ms", []).append(
                _busy(op for op in eager_ops if op["ts"] >= g_first) / 1e3
            )
            graph_call = next(c for c in calls if "Graph" in c["name"])
            rows.setdefault("host_before_graph_launch_ms", []).append((graph_call["ts"] - s) / 1e3)
            rows.setdefault("device_idle_before_graph_ms", []).append(
                (max(0.0, g_first - span_start) - eager_before) / 1e3
            )
        rows.setdefault("eager_kernels", []).append(float(len(eager_ops)))
        for op in eager_ops:
            eager_by_kernel.setdefault(op["name"][:90], []).append(op["dur"])
        for op in graph_ops:
            graph_by_kernel.setdefault(op["name"][:90], []).append(op["dur"])
        prev_end = last
    out["per_forward"] = {k: _stats(v) for k, v in rows.items()}
    n = max(1, len(rows.get("device_span_ms", [])))
    out["eager_device_work_per_forward"] = _per_forward(eager_by_kernel, n, top)
    # the replays' kernels by name: where one configuration's forward spends what another's
    # does not (summed over a kernel's launches, so a name run once per layer reads per forward)
    out["graph_device_work_per_forward"] = _per_forward(graph_by_kernel, n, 2 * top)

    # the host's heaviest ops and runtime calls inside run_batch (self time not separated:
    # nested aten ops count in their parent too, so read these as "where", not a sum)
    inside: Dict[Tuple[str, str], List[float]] = {}
    spans = [(f["ts"], f["ts"] + f["dur"]) for f in kept]
    k = 0
    for e in sorted(
        (e for e in events if e.get("cat") in ("cpu_op",) + LAUNCH_CATS), key=lambda e: e["ts"]
    ):
        while k < len(spans) and spans[k][1] < e["ts"]:
            k += 1
        if k < len(spans) and spans[k][0] <= e["ts"] < spans[k][1]:
            inside.setdefault((e["cat"], e["name"]), []).append(e["dur"])
    out["host_calls_in_run_batch_per_forward"] = [
        {
            "cat": c,
            "name": name[:90],
            "count": round(len(v) / len(kept), 2),
            "us": round(sum(v) / len(kept), 1),
        }
        for (c, name), v in sorted(inside.items(), key=lambda kv: -sum(kv[1]))[:top]
    ]
    return out


def _overlap(gap: Tuple[float, float], merged: List[Tuple[float, float]], starts: List[float]):
    s, e = gap
    i = max(0, bisect.bisect_right(starts, s) - 1)
    total = 0.0
    while i < len(merged) and merged[i][0] < e:
        total += max(0.0, min(e, merged[i][1]) - max(s, merged[i][0]))
        i += 1
    return total


def graph_gaps(events: List[Dict[str, Any]], skip: int = 2) -> List[List[Tuple[float, float]]]:
    """Per CUDA-graph replay (the first and last ``skip`` left out): the gaps between its
    consecutive kernels, when the device ran nothing of that replay."""
    launches = {
        e["args"]["correlation"]: e
        for e in events
        if e.get("cat") in LAUNCH_CATS and "Graph" in e["name"] and "correlation" in e["args"]
    }
    replays: Dict[int, List[Tuple[float, float]]] = {}
    for op in events:
        corr = op.get("args", {}).get("correlation") if op.get("cat") in GPU_CATS else None
        if corr in launches:
            replays.setdefault(corr, []).append((op["ts"], op["ts"] + op["dur"]))
    ordered = [sorted(replays[c]) for c in sorted(replays, key=lambda c: launches[c]["ts"])]
    ordered = ordered[skip : len(ordered) - skip]
    gaps = []
    for ops in ordered:
        merged = _merged(ops)
        gaps.append([(a[1], b[0]) for a, b in zip(merged, merged[1:])])
    return gaps


def cross_rank_stalls(events_by_rank: Dict[str, List[Dict[str, Any]]], skip: int = 2):
    """Ranks sharing one GPU (the emulated box): per rank, the idle gaps inside its own graph
    replays per replay, and the part of them during which another rank's device work ran. On
    separate GPUs a replay never waits for another rank's kernels; on one GPU split by MPS a
    large kernel of one rank can hold back the next kernel of the other's."""
    busy = {
        r: _merged((e["ts"], e["ts"] + e["dur"]) for e in evs if e.get("cat") in GPU_CATS)
        for r, evs in events_by_rank.items()
    }
    out: Dict[str, Any] = {}
    for rank, evs in events_by_rank.items():
        replays = graph_gaps(evs, skip)
        if not replays:
            continue
        others = _merged(iv for r, ivs in busy.items() if r != rank for iv in ivs)
        starts = [s for s, _ in others]
        gap_total = sum(e - s for gaps in replays for s, e in gaps)
        shared = sum(_overlap(g, others, starts) for gaps in replays for g in gaps)
        out[rank] = {
            "replays": len(replays),
            "graph_gaps_ms_per_replay": round(gap_total / 1e3 / len(replays), 4),
            "of_which_other_rank_busy_ms": round(shared / 1e3 / len(replays), 4),
            "gaps_over_100us_per_replay": round(
                sum(e - s > 100 for gaps in replays for s, e in gaps) / len(replays), 2
            ),
        }
    return out


def trace_files(paths: Sequence[str]) -> List[str]:
    files: List[str] = []
    for p in paths:
        if os.path.isdir(p):
            files += sorted(glob.glob(os.path.join(p, "**", "*.trace.json*"), recursive=True))
        else:
            files.append(p)
    return files


def summarise(paths: Sequence[str], skip: int = 2) -> Dict[str, Any]:
    """``{trace file's directory name: {rank: analysis}}``."""
    out: Dict[str, Any] = {}
    loaded: Dict[str, Dict[str, List[Dict[str, Any]]]] = {}
    for path in trace_files(paths):
        group = os.path.basename(os.path.dirname(path)) or "."
        rank = rank_label(path)
        try:
            events = load_events(path)
            out.setdefault(group, {})[rank] = analyse(events, skip)
            loaded.setdefault(group, {})[rank] = events
        except (OSError, ValueError, KeyError) as e:
            out.setdefault(group, {})[rank] = {"error": repr(e)}
    for group, ranks in loaded.items():
        if len(ranks) > 1:
            for rank, stalls in cross_rank_stalls(ranks, skip).items():
                out[group][rank]["graph_gaps"] = stalls
    return out


def print_table(summary: Dict[str, Any]) -> None:
    keys = (
        "host_run_batch_ms",
        "device_span_ms",
        "device_busy_ms",
        "device_idle_in_span_ms",
        "graph_ms",
        "host_before_graph_launch_ms",
        "eager_before_graph_ms",
        "eager_after_graph_ms",
    )
    for group, ranks in summary.items():
        for rank, a in sorted(ranks.items()):
            if "error" in a:
                print(f"{group} {rank}: {a['error']}")
                continue
            period = (a.get("period_ms") or {}).get("median")
            print(
                f"{group} {rank}: {a['forwards']} forwards, period {period} ms (median), "
                f"device busy {a['device_busy_fraction']}"
            )
            pf = a["per_forward"]
            print("   " + ", ".join(f"{k} {pf[k]['median']}" for k in keys if pf.get(k)))
            print("   host per forward by step:", a["host_ms_per_forward_by_step"])
            if a.get("graph_gaps"):
                print("   inside graph replays:", a["graph_gaps"])


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("paths", nargs="+", help="trace files or folders holding them")
    p.add_argument("--skip", type=int, default=2, help="forwards left out at either end")
    p.add_argument("--out", default=None, help="write the summary here (JSON)")
    a = p.parse_args(argv)
    summary = summarise(a.paths, a.skip)
    if not summary:
        print("no traces found", file=sys.stderr)
        return 1
    print_table(summary)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(summary, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
