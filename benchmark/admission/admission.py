"""Look-ahead admission vs SGLang's admission, side by side, under KV memory pressure.

Two SP servers on the default model (PP=2, bundled draft head, ``--max-total-tokens`` small
enough that the load does not fit), the same burst of greedy chat requests (the e2e suite's
hand-written prompts, then MT-Bench first turns) that end at EOS or ``max_new_tokens``. One
server adds ``--spexis-length-predictor bundled --spexis-lookahead-admission``: the gate's
KV projection decides how many requests to admit in place of SGLang's reservation.

Reported per server: wall time and output tokens per second; what does not depend on the
box's load: decode and prefill iterations to finish the burst, running rows per decode
iteration (the batch the admission built), CPU seconds of the server's processes and output
tokens per CPU second; retractions (requests evicted and recomputed); requests admitted early
(SGLang's reservation would still have held them back) and delayed (it would have admitted
them); and how many outputs are identical between the two (admission changes only when a
request runs; on CPU fp32 a different batch can still flip a greedy near-tie, which the e2e
tests classify). The load average before and after is recorded: the box is shared.

    .venv/bin/python benchmark/admission/admission.py --prompts 24 --new-tokens 192 \
        --kv-tokens 1200 800 --out benchmark/results/cpu_admission_float16.json

Each pool is one side-by-side pair (SGLang's admission first); the JSON is written after each.

CPU numbers are correctness-level: a 2-core shared box, torch-native attention, where a decode
iteration costs about the same per row whatever the batch (``LATENCY_FIT``), so fewer iterations
with more rows each buy little. On a GPU an iteration of a small batch costs about the same
whatever its rows, so the iteration count is what wall time follows: the same script runs there
(``benchmark/admission/admission_gpu.sh``: the caller's ``SPEXIS_TEST_SERVER_ARGS`` bring the GPU
flags, CUDA graphs stay on), reporting stage 0's time per iteration and the graph replays beside the
ratios; the CPU pricing is left out there.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import time

from spexis_sglang.cpu_support import activate

activate()

import psutil  # noqa: E402

from spexis_sglang.cpu_support import cuda_available  # noqa: E402
from spexis_sglang.default_model import ensure_default_model  # noqa: E402
from spexis_sglang.srt.bundled import bundled_draft_head  # noqa: E402
from spexis_sglang.testing import ServerProcess, count_retractions, recorded_args  # noqa: E402

#: decode latency per iteration on this CPU, T(rows) = a + b * rows seconds, measured in
#: benchmark/results/cpu_alpha_auto.json ("common_latency_fit"): it prices each run's decode
#: work the same way, whatever the box's load was while the run took place
LATENCY_FIT = (0.065645536453934, 0.03854917009143584)


def priced(rec: dict) -> dict:
    """Decode seconds the run's iterations and rows cost under LATENCY_FIT, and tokens/s."""
    a, b = LATENCY_FIT
    rows = rec["decode_iterations"] * rec["rows_per_decode_iteration"]
    secs = a * rec["decode_iterations"] + b * rows
    return {
        "priced_decode_s": round(secs, 2),
        "priced_tok_s": round(rec["output_tokens"] / secs, 2),
    }


def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process and its children (the server's ranks)."""
    procs = [psutil.Process(pid)]
    procs += procs[0].children(recursive=True)
    total = 0.0
    for p in procs:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.Error:
            pass
    return total


def run_one(name: str, server_args, prompts, new_tokens: int, log_path=None) -> dict:
    t_start = time.time()
    server = ServerProcess(server_args, log_path=log_path).wait_ready()
    start_s = time.time() - t_start
    try:
        cpu0 = _cpu_seconds(server.proc.pid)
        t0 = time.time()
        out = server.greedy_ids(prompts, new_tokens, ignore_eos=False)
        wall = time.time() - t0
        cpu = _cpu_seconds(server.proc.pid) - cpu0
        info = server.server_info(timeout=60)
        st = info["internal_states"][0]["spexis"]
        with open(server.log_path) as f:
            retractions = count_retractions(f.read())
    finally:
        server.stop()
    tokens = sum(len(o) for o in out)
    rec = {
        "name": name,
        "server_args": recorded_args(server_args),
        "server_start_s": round(start_s, 1),
        "wall_s": round(wall, 2),
        "output_tokens": tokens,
        "output_tok_s": round(tokens / wall, 2),
        "server_cpu_s": round(cpu, 1),
        "output_tokens_per_cpu_s": round(tokens / cpu, 3),
        "retractions": retractions,
        "admissions_early": st.get("admissions_early", 0),
        "admissions_delayed": st.get("admissions_delayed", 0),
        "admission_gated_iterations": st.get("admission_gated_iterations", 0),
        "iterations": st["iterations"],
        "decode_iterations": st["decode_iterations"],
        "prefill_iterations": st["iterations"] - st["decode_iterations"],
        "rows_per_decode_iteration": round(st["avg_rows_per_decode_iteration"], 3),
        "tokens_per_decode_iteration": round(st["avg_tokens_per_decode_iteration"], 3),
        "acceptance_rate": round(st["acceptance_rate"], 4),
        # stage 0's event loop: busy wall time per iteration (what the count multiplies)
        "stage0_busy_ms_per_iteration": round(
            1e3 * st.get("time_busy_s", 0.0) / max(1, st["iterations"]), 3
        ),
        "decode_graph_replays": st.get("decode_graph_replays", 0),
        "decode_eager_forwards": st.get("decode_eager_forwards", 0),
        "load_average_end": [round(x, 1) for x in os.getloadavg()],
    }
    if not cuda_available():  # the fit is this CPU's; a GPU's wall time is measured as is
        rec.update(priced(rec))
    print(json.dumps(rec), flush=True)
    return rec, out


def differing(a: list, b: list) -> list:
    """Per prompt whose outputs differ: its index, the first differing position, both lengths."""
    out = []
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            pos = next((k for k, (u, v) in enumerate(zip(x, y)) if u != v), min(len(x), len(y)))
            out.append({"prompt": i, "first_differing_token": pos, "lengths": [len(x), len(y)]})
    return out


def compare(kv_tokens: int, prompts, args, lookahead_first: bool = False) -> dict:
    """SGLang's admission and look-ahead admission on a KV pool of ``kv_tokens`` (SGLang's
    first unless ``lookahead_first``: repeats alternate the order, so that a drift of the box
    between the two runs does not always favour the same one)."""
    model = ensure_default_model()
    base = ["--pp-size", "2", "--spexis-draft-head", bundled_draft_head(model, 2)]
    base += ["--max-total-tokens", str(kv_tokens), "--chunked-prefill-size", "256"]
    lookahead = base + ["--spexis-length-predictor", "bundled", "--spexis-lookahead-admission"]
    lookahead += ["--spexis-admission-pdr", str(args.pdr)]
    load_start = [round(x, 1) for x in os.getloadavg()]

    def log(name):  # --log-dir keeps each server's log (retraction lines, admission)
        if not args.log_dir:
            return None
        os.makedirs(args.log_dir, exist_ok=True)
        order = "lf" if lookahead_first else "sf"
        return os.path.join(args.log_dir, f"{name}_kv{kv_tokens}_{order}_{time.time():.0f}.log")

    def run(name, server_args):
        return run_one(name, server_args, prompts, args.new_tokens, log(name))

    if lookahead_first:
        on, out_on = run("sp_lookahead_admission", lookahead)
        off, out_off = run("sp_admission_sglang", base)
    else:
        off, out_off = run("sp_admission_sglang", base)
        on, out_on = run("sp_lookahead_admission", lookahead)
    diff_on = differing(out_off, out_on)
    pool = {
        "kv_tokens": kv_tokens,
        "order": "lookahead first" if lookahead_first else "SGLang's admission first",
        "load_average_start": load_start,
        "runs": [off, on],
        "output_lengths": [len(o) for o in out_off],
        "outputs_identical": len(out_off) - len(diff_on),
        "outputs_differing": diff_on,
        "throughput_ratio_lookahead_over_off": round(on["output_tok_s"] / off["output_tok_s"], 3),
        "tokens_per_cpu_s_ratio": round(
            on["output_tokens_per_cpu_s"] / off["output_tokens_per_cpu_s"], 3
        ),
        "decode_iterations_ratio_off_over_lookahead": round(
            off["decode_iterations"] / on["decode_iterations"], 3
        ),
        "retractions_off_vs_lookahead": [off["retractions"], on["retractions"]],
    }
    if "priced_tok_s" in on:
        pool["priced_throughput_ratio"] = round(on["priced_tok_s"] / off["priced_tok_s"], 3)
    if args.lookahead_variant:  # a third server: look-ahead admission with more flags
        extra = shlex.split(args.lookahead_variant)
        var, out_var = run("sp_lookahead_admission_variant", lookahead + extra)
        diff_var = differing(out_off, out_var)
        pool["runs"].append(var)
        pool["variant"] = {
            "extra_args": extra,
            "outputs_identical": len(out_off) - len(diff_var),
            "outputs_differing": diff_var,
            "throughput_ratio_over_off": round(var["output_tok_s"] / off["output_tok_s"], 3),
            "decode_iterations_ratio_off_over_variant": round(
                off["decode_iterations"] / var["decode_iterations"], 3
            ),
            "retractions": var["retractions"],
        }
    return pool


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=24)
    ap.add_argument("--new-tokens", type=int, default=192)
    ap.add_argument("--kv-tokens", type=int, nargs="+", default=[1200, 800])
    ap.add_argument("--pdr", type=float, default=2.0)
    ap.add_argument(
        "--repeats", type=int, default=1, help="comparisons per pool, alternating the order"
    )
    ap.add_argument("--out", default=None)
    ap.add_argument("--log-dir", default=None, help="keep every server's log here")
    ap.add_argument(
        "--lookahead-variant",
        default=None,
        help="flags of a third server per pool: look-ahead admission with these added",
    )
    args = ap.parse_args()

    sys.path.insert(0, ".")
    from tests.e2e.prompts import lossless_prompts

    prompts = lossless_prompts(ensure_default_model(), args.prompts)
    result = {
        "script": "benchmark/admission/admission.py",
        "argv": recorded_args(sys.argv[1:]),
        "model": f"SmolLM2-135M-Instruct (bundled), PP=2, {device_label()}",
        "server_args_env": recorded_args(
            shlex.split(os.environ.get("SPEXIS_TEST_SERVER_ARGS", ""))
        ),
        "prompts": args.prompts,
        "max_new_tokens": args.new_tokens,
        "pools": [],
    }
    if not cuda_available():
        result["latency_fit"] = {"intercept_s": LATENCY_FIT[0], "slope_s": LATENCY_FIT[1]}
    for kv in args.kv_tokens:
        for rep in range(args.repeats):
            pool = compare(kv, prompts, args, lookahead_first=rep % 2 == 1)
            result["pools"].append(pool)
            print(json.dumps({k: v for k, v in pool.items() if k != "runs"}), flush=True)
            if args.repeats > 1:
                result["repeat_summary"] = repeat_summary(result["pools"])
            if args.out:
                with open(args.out, "w") as f:
                    json.dump(result, f, indent=1)
    return 0


def device_label() -> str:
    """``CPU``, or the GPU's name and how many the run saw."""
    if not cuda_available():
        return "CPU"
    import torch

    return f"{torch.cuda.device_count()}x {torch.cuda.get_device_name(0)}"


def repeat_summary(pools: list) -> dict:
    """Per KV pool: the ratios of every repeat, their mean, median and range."""
    out = {}
    for kv in sorted({p["kv_tokens"] for p in pools}):
        reps = [p for p in pools if p["kv_tokens"] == kv]
        out[str(kv)] = {}
        keys = ("throughput_ratio_lookahead_over_off", "tokens_per_cpu_s_ratio")
        for key in keys + ("decode_iterations_ratio_off_over_lookahead",):
            vals = [p[key] for p in reps]
            out[str(kv)][key] = {
                "values": vals,
                "mean": round(statistics.fmean(vals), 3),
                "median": round(statistics.median(vals), 3),
                "min": min(vals),
                "max": max(vals),
            }
    return out


if __name__ == "__main__":
    sys.exit(main())
