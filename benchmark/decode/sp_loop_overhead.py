"""Stage 0's event-loop CPU time by phase: Spexis SP vs stock SGLang PP, on CPU.

Two PP=2 servers on a tiny random Llama (``--load-format dummy``, so the forward is small),
with the same flags where they apply: stock SGLang PP (``SPEXIS_PHASE_TIMERS=1`` times its
``event_loop_pp`` by phase) and SP (``--spexis-draft-head random:0`` with forced acceptance
``--spexis-benchmark-force-accept 0.76``). For each total batch B, B requests with short
prompts and ``ignore_eos`` decode steadily; once stage 0 runs only decode batches of the
expected size (SP: ~B rows per iteration; stock: B/N rows per micro-batch step, its micro-batch
cap set to B/N through ``/set_internal_state`` so the B requests split evenly), the counters of
``/server_info`` ``internal_states[0]["spexis"]`` are read before and after a window; then the
requests are aborted. Reported per decode iteration (SP) and per micro-batch step (stock), and
per row: thread CPU time of each phase of stage 0's loop (and of each later rank's, from the
state it logs when those ``/server_info`` calls reach it: ``later_ranks``), and ``sched+proc`` = scheduling
(schedule + draft_sync) + result processing, the part that must stay small.

Phases (srt/stats.py): schedule (request receive and relay, batch building), draft_sync (SP:
reading stage 0's drafts into SPState), launch (the proxy receive and the forward: on CPU the
forward runs in the scheduler thread, so launch is mostly compute), wait_output (receiving the
last stage's outputs), process (result processing, output streaming), forced (SP: the benchmark
mode's forced acceptance, taken out of process: a serving loop verifies against the model and
does not do it; ``sched+proc`` leaves it out, ``cpu_sched_proc_with_forced`` keeps it), send (the
proxy send);
busy = the whole iteration (loop glue included).

    .venv/bin/python benchmark/decode/sp_loop_overhead.py \
        --out benchmark/results/cpu_sp_loop_overhead.json

On a GPU machine the same servers run with CUDA graphs (``--dtype bfloat16``, the GPU flags in
``--server-args``; with one GPU both stages share it under ``SPEXIS_SHARE_GPU=1``): the GPU's
times then mean nothing, but stage 0's scheduling and result processing are the host CPU work
of the regime users serve in (see ``benchmark/decode/loop_overhead_gpu.sh``).

CPU numbers are thread CPU time on a shared 2-core box: the scheduler's own cost, not its wall
time (waits and other processes' time are not in it).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import sys
import tempfile
import threading
import time
from typing import Dict, List, Optional, Tuple

from spexis_sglang.cpu_support import activate

activated = activate()  # False on a GPU machine

import requests  # noqa: E402

from spexis_sglang.srt.config import ENV_PHASE_TIMERS  # noqa: E402
from spexis_sglang.srt.stats import SP_PHASES, stat_deltas  # noqa: E402
from spexis_sglang.testing import ServerProcess, recorded_args  # noqa: E402

RESULT = "benchmark/results/cpu_sp_loop_overhead.json"
# the model directory as recorded: made by tests/e2e/tiny_model.py's make_tiny_llama
TINY_MODEL = "<tmp>/spexis-tiny-llama-{layers}l-v{vocab}"
STOCK_PHASES = tuple(p for p in SP_PHASES if p not in ("draft_sync", "forced"))
# scheduling + result processing: what must stay below the GPU's time. The
# benchmark mode's forced acceptance ("forced", inside result processing, which a serving
# loop does not do: a real model verifies) is timed apart and reported beside it
SCHED_PROC = ("schedule", "draft_sync", "process")


def rank0_state(server: ServerProcess) -> Dict[str, object]:
    return server.server_info(timeout=600)["internal_states"][0]


def stats(server: ServerProcess) -> Dict[str, float]:
    return rank0_state(server)["spexis"]


def counts(kind: str, before: dict, after: dict) -> Dict[str, float]:
    """Decode iterations, rows and all launches between two readings."""
    d = {k: after[k] - before[k] for k in after if isinstance(after[k], (int, float))}
    if kind == "sp":
        rows = d["rows_normal"] + d["rows_spec"]
        launches = d["iterations"]  # every launched batch, prefill included
    else:
        rows = d["decode_rows"]
        launches = d["iterations"]  # busy micro-batch steps
    return {"iterations": d["decode_iterations"], "rows": rows, "launches": launches, "d": d}


def steady(kind: str, c: Dict[str, float], rows_expected: float, min_iters: int = 3) -> bool:
    """Only decode batches of (nearly) the expected size ran."""
    n = c["iterations"]
    return n >= min_iters and c["launches"] == n and c["rows"] / n >= 0.95 * rows_expected


def measure(
    server: ServerProcess, kind: str, batch: int, pp: int, args: argparse.Namespace
) -> Dict[str, object]:
    rows_expected = batch if kind == "sp" else batch / pp
    if kind == "stock":
        r = requests.post(
            server.base_url + "/set_internal_state",
            json={"server_args": {"pp_max_micro_batch_size": batch // pp}},
            timeout=120,
        )
        r.raise_for_status()
    rng = random.Random(batch)
    prompts = [
        [rng.randrange(100, args.vocab) for _ in range(args.prompt_len)] for _ in range(batch)
    ]
    payload = {
        "input_ids": prompts,
        "sampling_params": {
            "temperature": 0.0,
            "max_new_tokens": args.new_tokens,
            "ignore_eos": True,
        },
    }
    thread = threading.Thread(
        target=lambda: requests.post(server.base_url + "/generate", json=payload, timeout=3600)
    )
    t_start = time.time()
    thread.start()
    prev, t_prev = stats(server), time.time()
    before: Optional[dict] = None
    while time.time() - t_start < args.steady_timeout:
        time.sleep(args.poll_s)
        t_call = time.time()
        cur, t_cur = stats(server), time.time()
        c = counts(kind, prev, cur)
        if steady(kind, c, rows_expected):
            before, rate, t_before = cur, c["iterations"] / (t_cur - t_prev), t_call
            break
        prev, t_prev = cur, t_cur
    if before is None:
        raise RuntimeError(f"{kind} B={batch}: no steady decode after {args.steady_timeout} s")
    window = min(max(args.window_iters / rate, args.min_window_s), args.max_window_s)
    time.sleep(window)
    t_after = time.time()
    state = rank0_state(server)
    after = state["spexis"]
    requests.post(server.base_url + "/abort_request", json={"abort_all": True}, timeout=120)
    thread.join()
    c = counts(kind, before, after)
    d, n, rows = c["d"], c["iterations"], c["rows"]
    phases = SP_PHASES if kind == "sp" else STOCK_PHASES
    rec: Dict[str, object] = {
        "loop": kind,
        "B": batch,
        "steady": steady(kind, c, rows_expected),
        "window_s": round(window, 2),
        # the shared box's load average (1, 5, 15 min) at the window's end: CPU time is the
        # measure because wall time moves with it
        "load_average": [round(x, 1) for x in os.getloadavg()],
        "iterations": n,
        "rows_per_iteration": round(rows / n, 1),
        "cpu_ms_per_iteration": {p: round(1e3 * d[f"cpu_{p}_s"] / n, 3) for p in phases},
        "cpu_busy_ms_per_iteration": round(1e3 * d["cpu_busy_s"] / n, 3),
        "wall_busy_ms_per_iteration": round(1e3 * d["time_busy_s"] / n, 3),
        # what carried the PP messages: an SP server's packed link, a plain one's SGLang's
        "pp_link": state.get("spexis_pp_link"),
    }
    sched_proc = sum(d.get(f"cpu_{p}_s", 0.0) for p in SCHED_PROC)
    rec["cpu_sched_proc_ms_per_iteration"] = round(1e3 * sched_proc / n, 3)
    if "cpu_forced_s" in d:  # servers before the forced phase existed counted it in process
        forced = sched_proc + d["cpu_forced_s"]
        rec["cpu_sched_proc_with_forced_ms_per_iteration"] = round(1e3 * forced / n, 3)
    rec["cpu_us_per_row"] = {p: round(1e6 * d[f"cpu_{p}_s"] / rows, 2) for p in phases}
    rec["cpu_sched_proc_us_per_row"] = round(1e6 * sched_proc / rows, 2)
    rec["cpu_busy_us_per_row"] = round(1e6 * d["cpu_busy_s"] / rows, 2)
    later = later_ranks(server.log_path, t_before, t_after, phases)
    if later:
        rec["later_ranks"] = later
    if kind == "sp":
        verdicts = d["accepted"] + d["rejected"]
        rec["acceptance_rate"] = round(d["accepted"] / verdicts, 3) if verdicts else None
        rec["tokens_per_iteration"] = round(d["tokens_committed"] / n, 1)
        # decode batches replayed in CUDA graphs vs run eagerly (always eager on CPU)
        rec["decode_graph_replays"] = d.get("decode_graph_replays")
        rec["decode_eager_forwards"] = d.get("decode_eager_forwards")
    print(json.dumps(rec), flush=True)
    drain(server, kind)
    return rec


def later_ranks(
    log_path: str, t_before: float, t_after: float, phases
) -> Dict[str, Dict[str, object]]:
    """Each later rank's loop CPU time by phase per decode iteration over the window, from
    the states it logged when the ``/server_info`` calls that began at ``t_before`` and
    ``t_after`` reached it (the first state logged after each; ``stats.log_rank_state``)."""
    # benchmark/gpu, on sys.path in main
    from decode_throughput import rank_states, state_logged_for

    out: Dict[str, Dict[str, object]] = {}
    for label, states in rank_states(log_path).items():
        first = [state_logged_for(states, t) for t in (t_before, t_after)]
        if None in first:
            continue
        d = stat_deltas(*(line["spexis"] for line in first))
        n = d.get("decode_iterations", 0)
        if n <= 0:
            continue
        out[label] = {
            "iterations": n,
            "cpu_ms_per_iteration": {
                p: round(1e3 * d[f"cpu_{p}_s"] / n, 3) for p in phases if f"cpu_{p}_s" in d
            },
            "cpu_busy_ms_per_iteration": round(1e3 * d.get("cpu_busy_s", 0.0) / n, 3),
            "wall_busy_ms_per_iteration": round(1e3 * d.get("time_busy_s", 0.0) / n, 3),
        }
    return out


def drain(server: ServerProcess, kind: str, timeout: float = 300.0) -> None:
    """Wait until the aborted requests have left the loop (no more iterations)."""
    deadline = time.time() + timeout
    prev = stats(server)
    while time.time() < deadline:
        time.sleep(2.0)
        cur = stats(server)
        if cur["iterations"] == prev["iterations"]:
            return
        prev = cur


def with_variant(name: str, variant: Optional[str]) -> str:
    """``name``, or ``name (variant)`` for a record of an ``--sp-variant`` server."""
    return f"{name} ({variant})" if variant else name


def run_server(
    kind: str,
    server_args: List[str],
    batches: List[int],
    pp: int,
    args: argparse.Namespace,
    variant: Optional[str] = None,
    env: Optional[Dict[str, str]] = None,
) -> List[Dict[str, object]]:
    """One server's records per batch; ``variant`` names an SP server started with ``env``
    added to its environment (``--sp-variant``)."""
    label = with_variant(kind, variant)
    print(f"{label}: starting {' '.join(server_args)} {env or ''}", flush=True)
    server = ServerProcess(server_args, env={ENV_PHASE_TIMERS: "1", **(env or {})})
    try:
        server.wait_ready(timeout=args.server_timeout)
        records = [measure(server, kind, b, pp, args) for b in batches]
    finally:
        server.stop()
    if variant is not None:
        for r in records:
            r["variant"], r["variant_env"] = variant, dict(env or {})
    return records


def parse_variant(text: str) -> Tuple[str, Dict[str, str]]:
    """``NAME:VAR=VALUE,VAR=VALUE`` -> (name, environment)."""
    name, sep, assignments = text.partition(":")
    if not name or not sep:
        raise argparse.ArgumentTypeError(f"expected NAME:VAR=VALUE[,VAR=VALUE...], got {text!r}")
    env = {}
    for item in filter(None, assignments.split(",")):
        var, eq, value = item.partition("=")
        if not var or not eq:
            raise argparse.ArgumentTypeError(f"expected VAR=VALUE in {text!r}, got {item!r}")
        env[var] = value
    return name, env


def record_key(r: Dict[str, object]) -> Tuple[str, str, int]:
    return str(r["loop"]), str(r.get("variant") or ""), int(r["B"])


def table(records: List[Dict[str, object]]) -> str:
    """Markdown: per B, SP per iteration and stock per micro-batch step, ms and µs/row."""
    by: Dict[Tuple[str, int], List[Dict[str, object]]] = {}
    for r in records:
        by.setdefault((str(r["loop"]), int(r["B"])), []).append(r)
    head = (
        "| B | loop | rows/iter | " + " | ".join(SP_PHASES) + " | sched+proc ms | busy ms "
        "| sched+proc µs/row | busy µs/row |\n"
    )
    head += "|" + "---|" * (len(SP_PHASES) + 7) + "\n"
    lines = []
    for b in sorted({r["B"] for r in records}):
        for kind in ("sp", "stock"):
            for r in by.get((kind, b), []):
                ms = r["cpu_ms_per_iteration"]
                cells = [f"{ms[p]:.3f}" if p in ms else "-" for p in SP_PHASES]
                name = "SP iteration" if kind == "sp" else "stock PP step"
                label = with_variant(name, r.get("variant"))
                lines.append(
                    f"| {b} | {label} | {r['rows_per_iteration']} | "
                    + " | ".join(cells)
                    + f" | {r['cpu_sched_proc_ms_per_iteration']:.3f} "
                    f"| {r['cpu_busy_ms_per_iteration']:.3f} "
                    f"| {r['cpu_sched_proc_us_per_row']:.2f} | {r['cpu_busy_us_per_row']:.2f} |"
                )
    later = [r for r in records if r.get("later_ranks")]
    if not later:
        return head + "\n".join(lines)
    lines.append("\nlater ranks, CPU ms per decode iteration by phase (busy: the whole loop):\n")
    for r in sorted(later, key=lambda r: (r["B"], r["loop"], r.get("variant") or "")):
        loop = with_variant(str(r["loop"]), r.get("variant"))
        for label, st in r["later_ranks"].items():
            ms = st["cpu_ms_per_iteration"]
            lines.append(
                f"- B = {r['B']}, {loop}, {label}: "
                + ", ".join(f"{p} {v:.3f}" for p, v in ms.items())
                + f"; busy {st['cpu_busy_ms_per_iteration']:.3f}"
            )
    return head + "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[64, 256, 1024])
    ap.add_argument("--pp-size", type=int, default=2)
    ap.add_argument("--theta", type=float, default=0.76, help="SP's forced acceptance")
    ap.add_argument("--prompt-len", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--layers", type=int, default=2, help="the tiny model's layers")
    ap.add_argument(
        "--vocab", type=int, default=2048, help="the tiny model's vocabulary (forward and memory)"
    )
    ap.add_argument("--window-iters", type=int, default=30, help="decode iterations to time")
    ap.add_argument("--min-window-s", type=float, default=3.0)
    ap.add_argument("--max-window-s", type=float, default=60.0)
    ap.add_argument("--poll-s", type=float, default=1.5)
    ap.add_argument("--steady-timeout", type=float, default=300.0)
    ap.add_argument("--server-timeout", type=float, default=600.0)
    ap.add_argument(
        "--dtype", default="float32", help="float32 on CPU; bfloat16 on a GPU (no fp32 rmsnorm)"
    )
    ap.add_argument("--server-args", default="", help="more flags for both servers (GPU flags)")
    ap.add_argument("--only", choices=("sp", "stock"), default=None)
    ap.add_argument(
        "--sp-variant",
        type=parse_variant,
        action="append",
        default=None,
        metavar="NAME:VAR=VALUE[,VAR=VALUE...]",
        help="an SP server with these environment variables, one per variant, side by side in "
        "one run (e.g. torch-ops:SPEXIS_DRAFT_FUSED=0,SPEXIS_ROWS_FUSED=0); default: one SP "
        "server as the environment has it",
    )
    ap.add_argument("--out", default=None, help=f"JSON result (e.g. {RESULT})")
    ap.add_argument(
        "--merge",
        action="store_true",
        help="keep --out's records of other (loop, B) pairs (re-run one loop or one B)",
    )
    args = ap.parse_args()

    sys.path.insert(0, ".")
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "gpu"))
    from tests.e2e.tiny_model import make_tiny_llama

    model = make_tiny_llama(
        os.path.join(tempfile.gettempdir(), f"spexis-tiny-llama-{args.layers}l-v{args.vocab}"),
        num_layers=args.layers,
        vocab_size=args.vocab,
    )
    tiny_model = TINY_MODEL.format(layers=args.layers, vocab=args.vocab)
    b_max = max(args.batches)
    common = ["--model-path", model, "--load-format", "dummy", "--pp-size", str(args.pp_size)]
    # float32: CPU matmuls in float16 (the checkpoint's default here) are many times slower,
    # and SP's stage 0 runs the draft head's vocabulary projection on every row
    common += ["--dtype", args.dtype]
    # SGLang's warm-up request is text, whose token ids lie beyond the small vocabulary
    common += ["--skip-server-warmup"]
    common += ["--max-running-requests", str(b_max), "--random-seed", "0"]
    common += ["--max-total-tokens", str(b_max * (args.prompt_len + args.new_tokens + 16))]
    common += shlex.split(args.server_args)
    sp = common + ["--spexis-draft-head", "random:0"]
    sp += ["--spexis-benchmark-force-accept", str(args.theta)]
    device = "CPU"
    if not activated:
        import torch

        device = torch.cuda.get_device_name(0)
    t0 = time.time()
    records = []
    if args.only != "sp":
        records += run_server("stock", common, args.batches, args.pp_size, args)
    if args.only != "stock":
        for variant, env in args.sp_variant or [(None, None)]:
            records += run_server("sp", sp, args.batches, args.pp_size, args, variant, env)
    argv = recorded_args(sys.argv[1:])
    commands = ["python benchmark/decode/sp_loop_overhead.py " + shlex.join(argv)]
    if args.merge and args.out and os.path.isfile(args.out):
        with open(args.out) as f:
            old = json.load(f)
        done = {record_key(r) for r in records}
        records = [r for r in old["records"] if record_key(r) not in done] + records
        commands = old.get("commands", [old.get("command")]) + commands
    md = table(records)
    print(md)
    result = {
        "script": "benchmark/decode/sp_loop_overhead.py",
        "commands": commands,
        "model": f"tiny random Llama ({args.layers} layers, hidden 64, vocab {args.vocab}), dummy "
        f"weights, PP={args.pp_size}, {device}",
        "server_args": {
            kind: [tiny_model if a == model else a for a in server_args]
            for kind, server_args in (("stock", common), ("sp", sp))
        },
        "server_env": {ENV_PHASE_TIMERS: "1"},
        "unit": "thread CPU time of stage 0's scheduler thread (time.thread_time)",
        "prompt_len": args.prompt_len,
        "max_new_tokens": args.new_tokens,
        "wall_s": round(time.time() - t0, 1),
        "records": records,
        "table_md": md,
    }
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
