"""Look-ahead admission fed by the benchmark-only length oracle, per prediction quality, on CPU.

A check that ``--spexis-benchmark-length-oracle`` does what the GPU admission study needs
on a model with random weights and no length predictor, the oracle's buckets
reach look-ahead admission, the precision / recall reached on the served rows is the stated
one, and the gate's behaviour moves with the quality. One server at a time: the tiny
Llama-shaped config (dummy weights), PP=2, random head, forced acceptance 0.7, a KV pool
smaller than the load; the same ``--requests`` requests (24-token prompts, ``ignore_eos``,
``max_new_tokens`` uniform in [8, 120)) sent at once, per configuration: ``none`` (SP without
look-ahead admission) and each ``--presets`` value with ``--spexis-lookahead-admission``.

    .venv/bin/python benchmark/admission/length_oracle_admission.py \\
        --out benchmark/results/cpu_length_oracle_admission.json

Correctness level: a tiny model on a shared 2-core box; wall times are context only.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from typing import List

from spexis_sglang.cpu_support import activate

activate()


from spexis_sglang.srt.sp_length_oracle import LENGTH_ORACLE_LABEL  # noqa: E402
from spexis_sglang.testing import ServerProcess, count_retractions  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODEL = os.path.join(REPO, "benchmark", "gpu", "configs", "tiny-llama")


def payload(n: int, seed: int) -> dict:
    rng = random.Random(seed)
    prompts = [[rng.randrange(100, 1000) for _ in range(24)] for _ in range(n)]
    params = [
        {"temperature": 0.0, "max_new_tokens": rng.randrange(8, 120), "ignore_eos": True}
        for _ in range(n)
    ]
    return {"input_ids": prompts, "sampling_params": params}


def run(spec: str, args: argparse.Namespace) -> dict:
    server_args = ["--model-path", MODEL, "--load-format", "dummy", "--skip-tokenizer-init"]
    server_args += ["--pp-size", "2", "--spexis-draft-head", "random:0"]
    server_args += ["--spexis-benchmark-force-accept", "0.7", "--spexis-log-interval", "0"]
    server_args += ["--max-total-tokens", str(args.kv), "--chunked-prefill-size", "256"]
    if spec != "none":
        server_args += ["--spexis-benchmark-length-oracle", spec, "--spexis-lookahead-admission"]
    server = ServerProcess(server_args).wait_ready()
    try:
        t0 = time.time()
        server.generate(payload(args.requests, args.seed))
        wall = time.time() - t0
        state = server.server_info(timeout=60)
        state = state["internal_states"][0]
        with open(server.log_path) as f:
            log = f.read()
    finally:
        server.stop()
    sp = state["spexis"]
    oracle = state.get(LENGTH_ORACLE_LABEL) or {}
    return {
        "config": spec,
        "wall_s": round(wall, 1),
        "retractions": count_retractions(log),
        "admissions_delayed": sp["admissions_delayed"],
        "admission_gated_iterations": sp["admission_gated_iterations"],
        "decode_iterations": sp["decode_iterations"],
        "rows_predicted_ending": sp["rows_predicted_ending"],
        "oracle": oracle,
    }


def table(records: List[dict]) -> str:
    lines = [
        "| config | delayed | gated iterations | decode iterations | rows predicted ending | "
        "reached precision | reached recall |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in records:
        o = r["oracle"]

        def fmt(v):
            return "/".join("-" if x is None else f"{x:.2f}" for x in v) if v else "-"

        lines.append(
            f"| {r['config']} | {r['admissions_delayed']} | {r['admission_gated_iterations']} | "
            f"{r['decode_iterations']} | {r['rows_predicted_ending']} | "
            f"{fmt(o.get('measured_precision'))} | {fmt(o.get('measured_recall'))} |"
        )
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--presets", default="perfect,paper-l70,ours")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--kv", type=int, default=900, help="--max-total-tokens")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out")
    args = ap.parse_args()
    records = [run(spec, args) for spec in ["none", *args.presets.split(",")]]
    print(table(records))
    if args.out:
        doc = {
            "benchmark_only": "length oracle (--spexis-benchmark-length-oracle), dummy weights",
            "model": "benchmark/gpu/configs/tiny-llama (dummy weights), PP=2, random:0 head, "
            "forced acceptance 0.7",
            "requests": args.requests,
            "kv_tokens": args.kv,
            "seed": args.seed,
            "records": records,
        }
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=1)
            f.write("\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
