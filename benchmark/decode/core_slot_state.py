"""Per-iteration CPU cost of SP bookkeeping: ``SPState`` (per row) vs ``SlotState`` (per batch).

Usage::

    python benchmark/decode/core_slot_state.py [--iters 200] \
        [--out benchmark/results/core_slot_state.json]

For B = 64, 256, 1024 running requests in an N-stage pipeline (N = 2 and 4), every request
rides every iteration it can; drafts are right with probability ``theta`` and selective
speculation drops ``alpha`` of the candidates. One iteration is what stage 0's scheduler does
with the state (docs/design.md §2), in the order of ``SlotState``'s docstring:

* ``result`` — the oldest batch's true tokens: verdicts and commits;
* ``draft``  — the drafts (and confidences) of the batch launched last;
* ``rows``   — the next row of every running request (useless-draft rule included);
* ``select`` — the chain confidence of every candidate, ``select_drops``, the drops;
* ``launch`` — record the launched batch.

``SPState`` is driven the way ``sp_scheduler.py`` drives it (a Python call per row and phase,
the inputs already Python lists); ``SlotState`` with one call per phase on numpy arrays. The
harness's own work (true tokens, drafts) is not timed. Reported: median thread CPU time per
iteration and per phase over ``--iters`` iterations after warm-up, in ms.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import sys
import time
from collections import deque

import numpy as np

from spexis_sglang.core.selection import select_drops
from spexis_sglang.core.slot_state import SlotState
from spexis_sglang.core.sp_state import SPState

BATCHES = (64, 256, 1024)
STAGES = (2, 4)
THETA = 0.8
ALPHA = 0.15
PROMPT = 100
PHASES = ("result", "draft", "rows", "select", "launch")


def _true(slot: np.ndarray, pos: np.ndarray) -> np.ndarray:
    """The target model's token at ``pos`` (a fixed function)."""
    return (slot * 7919 + pos * 104729) % 50021


class _Clock:
    def __init__(self) -> None:
        self.t = dict.fromkeys(PHASES, 0.0)
        self._c = 0.0

    def start(self) -> None:
        self._c = time.thread_time()

    def stop(self, phase: str) -> None:
        self.t[phase] += time.thread_time() - self._c


def _drafts(rng: np.random.Generator, slot: np.ndarray, pos: np.ndarray):
    right = rng.random(slot.size) < THETA
    tok = np.where(right, _true(slot, pos + 1), -1)
    conf = np.where(right, rng.uniform(0.5, 1.0, slot.size), rng.uniform(0.0, 0.7, slot.size))
    return tok, conf


def run_slot_state(batch: int, n: int, iters: int, warm: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    capacity = 2 * batch
    slots = rng.permutation(capacity)[:batch].astype(np.int64)  # req_pool_idx of the running
    ss = SlotState(capacity, depth=n)
    ss.admit(slots, PROMPT, _true(slots, np.full(batch, PROMPT - 1)))
    pipe: deque = deque()
    last = None
    per_iter, per_phase, rows_n, committed = [], {p: [] for p in PHASES}, [], 0
    for it in range(warm + iters):
        clk = _Clock()
        if len(pipe) >= n:
            b = pipe.popleft()
            y = _true(b.slot, b.position + 1)
            clk.start()
            res = ss.on_result(y)
            ss.pop_drained()
            clk.stop("result")
            if it >= warm:
                committed += int(np.count_nonzero(res.committed))
        if last is not None:
            tok, conf = _drafts(rng, last.slot, last.position)
            clk.start()
            ss.on_draft(last.slot, last.position, last.epoch, tok, conf)
            clk.stop("draft")
        clk.start()
        rows = ss.next_rows(slots)
        clk.stop("rows")
        clk.start()
        rows, _ = ss.select(rows, ALPHA)
        clk.stop("select")
        clk.start()
        ss.on_launch(rows)
        clk.stop("launch")
        pipe.append(rows)
        last = rows
        if it >= warm:
            per_iter.append(sum(clk.t.values()))
            for p in PHASES:
                per_phase[p].append(clk.t[p])
            rows_n.append(len(rows))
    return per_iter, per_phase, rows_n, committed / iters, ss.stats


def run_sp_state(batch: int, n: int, iters: int, warm: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    capacity = 2 * batch
    slots = rng.permutation(capacity)[:batch].astype(np.int64)
    sp = SPState()
    rids = slots.tolist()  # request ids: the slots, so both runs see the same workload
    for rid, tok in zip(rids, _true(slots, np.full(batch, PROMPT - 1)).tolist()):
        sp.add(rid, PROMPT, tok)
    pipe: deque = deque()
    last = None
    per_iter, per_phase, rows_n, committed = [], {p: [] for p in PHASES}, [], 0
    for it in range(warm + iters):
        clk = _Clock()
        if len(pipe) >= n:
            b = pipe.popleft()
            y = _true(np.array([r[0] for r in b]), np.array([r[1] for r in b]) + 1).tolist()
            clk.start()
            c = 0
            for (rid, pos, ep), tok in zip(b, y):
                if sp.on_result(rid, pos, ep, tok).name != "STALE":
                    c += 1
            sp.pop_drained()
            clk.stop("result")
            if it >= warm:
                committed += c
        if last:
            tok, conf = _drafts(rng, np.array([r[0] for r in last]), np.array([r[1] for r in last]))
            tok, conf = tok.tolist(), conf.tolist()
            clk.start()
            for (rid, pos, ep), t, cf in zip(last, tok, conf):
                sp.on_draft(rid, pos, ep, t, cf)
            clk.stop("draft")
        clk.start()
        plans = []
        for rid in rids:
            plan = sp.next_row(rid)
            if plan is not None:
                plans.append(plan)
        clk.stop("rows")
        clk.start()
        spec = [i for i, p in enumerate(plans) if p.is_spec]
        if spec:
            conf_c = [sp.candidate_confidence(plans[i].rid) for i in spec]
            dropped = {plans[spec[i]].rid for i in select_drops(conf_c, ALPHA)}
            kept = []
            for p in plans:
                if p.rid in dropped:
                    sp.drop_draft(p.rid)
                else:
                    kept.append(p)
            plans = kept
        clk.stop("select")
        clk.start()
        launched = []
        for p in plans:
            ep = sp.on_launch(p.rid, p.position, p.token, p.is_spec, p.confidence)
            launched.append((p.rid, p.position, ep))
        clk.stop("launch")
        pipe.append(launched)
        last = launched
        if it >= warm:
            per_iter.append(sum(clk.t.values()))
            for p in PHASES:
                per_phase[p].append(clk.t[p])
            rows_n.append(len(launched))
    return per_iter, per_phase, rows_n, committed / iters, sp.stats


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--warm", type=int, default=30)
    ap.add_argument(
        "--out",
        default=os.path.join(
            os.path.dirname(os.path.dirname(__file__)), "results", "core_slot_state.json"
        ),
    )
    args = ap.parse_args(argv)
    load_before = os.getloadavg()[0]
    results = []
    head = (
        f"{'B':>5} {'N':>2} {'impl':>9} {'rows':>6} {'tok/it':>6} | {'iter':>7} | "
        + " ".join(f"{p:>7}" for p in PHASES)
        + "   [ms, median thread CPU time]"
    )
    print(head)
    print("-" * len(head))
    for n in STAGES:
        for batch in BATCHES:
            iters = args.iters if batch < 1024 else max(20, args.iters // 2)
            pair = {}
            for impl, fn in (("SPState", run_sp_state), ("SlotState", run_slot_state)):
                gc.collect()
                per_iter, per_phase, rows_n, tok_it, stats = fn(batch, n, iters, args.warm)
                row = {
                    "batch": batch,
                    "num_stages": n,
                    "impl": impl,
                    "iters": iters,
                    "rows_per_iter": statistics.mean(rows_n),
                    "tokens_per_iter": tok_it,
                    "acceptance": stats.accepted / max(1, stats.accepted + stats.rejected),
                    "iteration_cpu_ms": statistics.median(per_iter) * 1e3,
                    "iteration_cpu_p90_ms": sorted(per_iter)[int(0.9 * (len(per_iter) - 1))] * 1e3,
                }
                for p in PHASES:
                    row[f"{p}_cpu_ms"] = statistics.median(per_phase[p]) * 1e3
                pair[impl] = row
                results.append(row)
                print(
                    f"{batch:>5} {n:>2} {impl:>9} {row['rows_per_iter']:>6.1f} "
                    f"{tok_it:>6.1f} | {row['iteration_cpu_ms']:>7.3f} | "
                    + " ".join(f"{row[f'{p}_cpu_ms']:>7.3f}" for p in PHASES),
                    flush=True,
                )
            speedup = pair["SPState"]["iteration_cpu_ms"] / pair["SlotState"]["iteration_cpu_ms"]
            pair["SlotState"]["speedup_vs_sp_state"] = speedup
            print(f"{'':>5} {'':>2} {'speedup':>9} {speedup:>6.1f}x")
    load_after = os.getloadavg()[0]
    out = {
        "description": "SP bookkeeping per decode iteration: SPState (per row) vs SlotState "
        "(numpy, per batch); median thread CPU time",
        "command": "python benchmark/decode/core_slot_state.py " + " ".join(argv or sys.argv[1:]),
        "machine": {
            "python": platform.python_version(),
            "numpy": np.__version__,
            "processor": platform.processor() or platform.machine(),
            "cpus": os.cpu_count(),
            "load_average_1min_before": load_before,
            "load_average_1min_after": load_after,
        },
        "settings": {"theta": THETA, "alpha": ALPHA, "warm": args.warm, "iters": args.iters},
        "results": results,
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(out, f, indent=2)
    print(f"wrote {args.out}; load average {load_before:.1f} -> {load_after:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
