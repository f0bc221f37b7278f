"""What ``--pp-async-batch-depth`` buys stock SGLang PP, and where SP stands, on CPU.

SP refuses ``--pp-async-batch-depth > 0``. Stock PP with depth D splits the running requests
into N + D micro-batches and processes a micro-batch's result D iterations later than with
depth 0, which gives the last stage's output time to travel back while the other micro-batches
run. SP puts every running request in every micro-batch and builds the next one from stage 0's
drafts, so the stages are busy without it; a depth would only lengthen SP's verification loop
from N to N + D iterations (more unverified drafts in flight, fewer committed tokens per row).

Same workload on each server, one at a time, the bundled default model with PP=2 on CPU:
B requests with short random-token prompts decode ``--new-tokens`` tokens (greedy,
``ignore_eos``). Decode throughput = B x (new_tokens - 1) / (time of the full requests - time
of the same requests with one new token), so that the prefill is left out; medians of
``--repeats`` runs.

    .venv/bin/python benchmark/decode/pp_async_depth.py \
        --out benchmark/results/cpu_pp_async_depth.json

On a shared 2-core machine these are wall-clock numbers: compare them side by side only.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from typing import Dict, List

from spexis_sglang.cpu_support import activate

activate()

from spexis_sglang.testing import ServerProcess  # noqa: E402

NOTE = (
    "What a depth buys stock PP here: compare the two stock configurations. The SP line is "
    "context, not a throughput comparison: on this box both stages share two cores, so "
    "compute, not stage overlap, sets the pace and SP's speculative rows (partly stale) cost "
    "compute; GPU throughput: benchmark/README.md."
)
CONFIGS = {
    "stock_pp2_depth0": ["--pp-size", "2", "--pp-async-batch-depth", "0"],
    "stock_pp2_depth1": ["--pp-size", "2", "--pp-async-batch-depth", "1"],
    "sp_pp2_depth0": ["--pp-size", "2", "--spexis-draft-head", "bundled"],
}


def timed_generate(server: ServerProcess, prompts: List[List[int]], new_tokens: int) -> float:
    sampling = {"temperature": 0.0, "max_new_tokens": new_tokens, "ignore_eos": True}
    t0 = time.perf_counter()
    out = server.generate({"input_ids": prompts, "sampling_params": sampling}, timeout=3600)
    elapsed = time.perf_counter() - t0
    assert all(len(o["output_ids"]) == new_tokens for o in out)
    return elapsed


def measure(name: str, args: argparse.Namespace) -> Dict[str, object]:
    rng = random.Random(0)
    prompts = [
        [rng.randrange(1000, 40000) for _ in range(args.prompt_len)] for _ in range(args.batch)
    ]
    server_args = CONFIGS[name] + ["--max-running-requests", str(args.batch)]
    print(f"{name}: starting {' '.join(server_args)}", flush=True)
    server = ServerProcess(server_args)
    try:
        server.wait_ready(timeout=args.server_timeout)
        timed_generate(server, prompts, 4)  # warm-up (and the prompts enter the radix cache)
        rates, full_s, prefill_s = [], [], []
        for _ in range(args.repeats):
            t1 = timed_generate(server, prompts, 1)
            tn = timed_generate(server, prompts, args.new_tokens)
            prefill_s.append(t1)
            full_s.append(tn)
            rates.append(args.batch * (args.new_tokens - 1) / (tn - t1))
            print(f"  {name}: {tn:.1f} s (prefill-only {t1:.1f} s), {rates[-1]:.2f} tok/s")
    finally:
        server.stop()
    rec = {
        "config": name,
        "server_args": server_args,
        "decode_tokens_per_s": [round(r, 3) for r in rates],
        "decode_tokens_per_s_median": round(statistics.median(rates), 3),
        "full_s": [round(t, 2) for t in full_s],
        "prefill_only_s": [round(t, 2) for t in prefill_s],
    }
    print(json.dumps(rec), flush=True)
    return rec


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--server-timeout", type=float, default=900.0)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    records = [measure(name, args) for name in args.configs]
    base = {r["config"]: r["decode_tokens_per_s_median"] for r in records}
    summary = {
        "command": "benchmark/decode/pp_async_depth.py "
        + " ".join(
            f"--{k.replace('_', '-')} {v}"
            for k, v in vars(args).items()
            if k not in ("out", "configs", "server_timeout")
        ),
        "machine": "shared 2-core CPU (other servers running): wall-clock, side by side only",
        "note": NOTE,
        "records": records,
    }
    if "stock_pp2_depth0" in base:
        summary["ratio_to_stock_depth0"] = {
            k: round(v / base["stock_pp2_depth0"], 3) for k, v in base.items()
        }
    print(json.dumps(summary, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(summary, f, indent=1)
            f.write("\n")


if __name__ == "__main__":
    main()
