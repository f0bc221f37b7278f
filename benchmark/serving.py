"""Serving under load: Poisson request-rate sweeps per server configuration (issue 13).

For each configuration the server is started once; then, for each request rate, SGLang's own
load generator (``python -m spexis_sglang.bench_serving``, i.e. ``sglang.benchmark.serving``
unchanged) sends the same workload (same ``--seed``) with Poisson arrivals. Recorded per rate:

* **mean normalized latency**: the mean over requests of end-to-end latency / output tokens
  (the paper's serving metric), the end-to-end latency of a request being its TTFT plus its
  inter-token latencies as bench_serving measures them (``--output-details``);
* TTFT and TPOT (mean, p50, p99), request and output-token throughput, completed requests;
* retractions (SGLang's "KV cache pool is full, retracting request" lines of this rate), and
  from ``/server_info`` ``internal_states[0]["spexis"]`` the counters' change over the rate:
  acceptance, tokens committed per row, dropped drafts, delayed admissions (and graph
  replays, once such a counter exists).

**Max rate under SLO**: the highest swept rate, below which no rate failed, whose mean
normalized latency is at most ``K`` times the configuration's own value at the lowest rate
(``--slo-k``, default 2: latency may double relative to an unloaded server). Also reported
against one common threshold, ``K`` times the lowest of all configurations' values at the
lowest rate (same absolute SLO for everyone). Ratios are against the first configuration.
A plot shows mean normalized latency vs rate, one line per configuration.

Tiny CPU run (default model, PP=2, plain vs SP with the bundled head)::

    .venv/bin/python benchmark/serving.py --pp-size 2 --configs plain,sp --rates 0.5,1 \\
        --num-prompts 8 --input-len 32 --output-len 16 --out /tmp/serving.json

Configurations: ``plain`` (SGLang PP=N), ``sp`` (Spexis, ``--spexis-draft-head``), ``sp-alpha``
(+ ``--spexis-alpha``), ``sp-la`` (+ length predictor and lookahead admission); more with
``--config NAME='ARGS'`` (e.g. ``--config tp2='--tp-size 2'``). ``--server-args`` is appended to
every server (GPU flags, ``--load-format dummy``, a KV budget); ``--bench-args`` to every
bench_serving call (e.g. ``--dataset-name sharegpt --dataset-path FILE``). CPU numbers are
correctness-level (2 shared cores, torch-native attention).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shlex
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Optional, Tuple

import requests

logger = logging.getLogger("benchmark.serving")

RETRACT_LINE = "KV cache pool is full, retracting request"
SPEXIS_COUNTERS = (
    "accepted",
    "rejected",
    "tokens_committed",
    "rows_normal",
    "rows_spec",
    "rows_stale",
    "drafts_dropped",
    "admissions_delayed",
    "decode_iterations",
    "graph_replays",
)


def build_configs(args: argparse.Namespace) -> List[Tuple[str, List[str]]]:
    base = ["--pp-size", str(args.pp_size)] + shlex.split(args.server_args)
    sp = ["--spexis-draft-head", args.draft_head]
    known = {
        "plain": base,
        "sp": base + sp,
        "sp-alpha": base + sp + ["--spexis-alpha", str(args.alpha)],
        "sp-la": base
        + sp
        + ["--spexis-alpha", str(args.alpha)]
        + ["--spexis-length-predictor", args.length_predictor, "--spexis-lookahead-admission"],
    }
    configs = []
    for name in [c for c in args.configs.split(",") if c]:
        if name not in known:
            raise SystemExit(f"unknown configuration {name!r}: one of {sorted(known)}")
        configs.append((name, known[name]))
    for spec in args.config:
        name, _, extra = spec.partition("=")
        configs.append((name, shlex.split(extra) + shlex.split(args.server_args)))
    return configs


def bench_command(args: argparse.Namespace, base_url: str, rate: float, out: str) -> List[str]:
    return [
        sys.executable,
        "-m",
        "spexis_sglang.bench_serving",
        "--backend",
        "sglang",
        "--base-url",
        base_url,
        "--dataset-name",
        "random-ids",
        "--random-input-len",
        str(args.input_len),
        "--random-output-len",
        str(args.output_len),
        "--random-range-ratio",
        str(args.range_ratio),
        "--num-prompts",
        str(args.num_prompts),
        "--request-rate",
        str(rate),
        "--seed",
        str(args.seed),
        "--disable-tqdm",
        "--output-details",
        "--output-file",
        out,
        *shlex.split(args.bench_args),
    ]


def spexis_state(base_url: str) -> Dict[str, float]:
    try:
        info = requests.get(base_url + "/server_info", timeout=60).json()
        return dict(info["internal_states"][0].get("spexis", {}))
    except (requests.RequestException, KeyError, IndexError, ValueError):
        return {}


def count_retractions(log_path: str) -> int:
    with open(log_path, errors="replace") as f:
        return f.read().count(RETRACT_LINE)


def percentile(values: List[float], q: float) -> Optional[float]:
    if not values:
        return None
    import numpy as np

    return float(np.percentile(values, q))


def summarize_rate(result: dict, before: dict, after: dict, retractions: int) -> dict:
    """One rate's record from bench_serving's JSON line and the Spexis counters around it."""
    norm = []
    for ttft, itls, out_len, err in zip(
        result["ttfts"], result["itls"], result["output_lens"], result["errors"]
    ):
        if not err and out_len:
            norm.append((ttft + sum(itls)) / out_len)
    rec = {
        "request_rate": result["request_rate"],
        "completed": result["completed"],
        "failed": sum(1 for e in result["errors"] if e),
        "duration_s": result["duration"],
        "mean_normalized_latency_s": sum(norm) / len(norm) if norm else None,
        "p50_normalized_latency_s": percentile(norm, 50),
        "p99_normalized_latency_s": percentile(norm, 99),
        "request_throughput": result["request_throughput"],
        "output_throughput": result["output_throughput"],
        "total_output_tokens": result["total_output_tokens"],
        "retractions": retractions,
    }
    for metric in ("ttft", "tpot", "e2e_latency"):
        for stat in ("mean", "median", "p99"):
            rec[f"{stat}_{metric}_ms"] = result.get(f"{stat}_{metric}_ms")
    if after:
        delta = {k: after[k] - before.get(k, 0) for k in SPEXIS_COUNTERS if k in after}
        verdicts = delta.get("accepted", 0) + delta.get("rejected", 0)
        rows = sum(delta.get(k, 0) for k in ("rows_normal", "rows_spec", "rows_stale"))
        rec["spexis"] = {
            **delta,
            "acceptance_rate": delta.get("accepted", 0) / verdicts if verdicts else None,
            "tokens_per_row": delta.get("tokens_committed", 0) / rows if rows else None,
        }
    return rec


def sweep(args: argparse.Namespace, name: str, server_args: List[str], rates: List[float]):
    from spexis_sglang.testing import ServerProcess

    logger.info("%s: starting server %s", name, " ".join(server_args))
    server = ServerProcess(server_args).wait_ready(timeout=args.server_timeout)
    records = []
    try:
        for rate in rates:
            before = spexis_state(server.base_url)
            retract0 = count_retractions(server.log_path)
            with tempfile.TemporaryDirectory() as tmp:
                out = os.path.join(tmp, "bench.jsonl")
                cmd = bench_command(args, server.base_url, rate, out)
                t0 = time.time()
                proc = subprocess.run(cmd, capture_output=True, text=True)
                if proc.returncode != 0:
                    raise RuntimeError(
                        f"bench_serving failed at rate {rate}:\n{proc.stdout[-2000:]}"
                        f"\n{proc.stderr[-2000:]}"
                    )
                with open(out) as f:
                    result = json.loads(f.read().splitlines()[-1])
            rec = summarize_rate(
                result,
                before,
                spexis_state(server.base_url),
                count_retractions(server.log_path) - retract0,
            )
            rec["bench_wall_s"] = round(time.time() - t0, 2)
            logger.info("%s rate %s: %s", name, rate, json.dumps(rec))
            records.append(rec)
    finally:
        server.stop()
    return records


def max_rate_under(records: List[dict], threshold: float) -> Optional[float]:
    best = None
    for rec in sorted(records, key=lambda r: r["request_rate"]):
        lat = rec["mean_normalized_latency_s"]
        if lat is None or rec["failed"] or lat > threshold:
            break
        best = rec["request_rate"]
    return best


def analyse(results: Dict[str, List[dict]], k: float) -> dict:
    lowest = {
        name: min(recs, key=lambda r: r["request_rate"])["mean_normalized_latency_s"]
        for name, recs in results.items()
    }
    common = k * min(v for v in lowest.values() if v is not None)
    out = {"slo_k": k, "common_threshold_s": common, "configs": {}}
    first = None
    for name, recs in results.items():
        own = max_rate_under(recs, k * lowest[name]) if lowest[name] is not None else None
        shared = max_rate_under(recs, common)
        if first is None:
            first = (own, shared)
        out["configs"][name] = {
            "latency_at_lowest_rate_s": lowest[name],
            "own_threshold_s": k * lowest[name] if lowest[name] is not None else None,
            "max_rate_under_slo": own,
            "max_rate_under_common_slo": shared,
            "ratio_vs_first": own / first[0] if own and first[0] else None,
            "ratio_vs_first_common": shared / first[1] if shared and first[1] else None,
        }
    return out


def plot(results: Dict[str, List[dict]], analysis: dict, path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, recs in results.items():
        recs = sorted(recs, key=lambda r: r["request_rate"])
        ax.plot(
            [r["request_rate"] for r in recs],
            [r["mean_normalized_latency_s"] for r in recs],
            marker="o",
            label=name,
        )
    ax.axhline(analysis["common_threshold_s"], color="grey", ls="--", lw=1, label="common SLO")
    ax.set_xlabel("request rate (req/s, Poisson)")
    ax.set_ylabel("mean normalized latency (s / output token)")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pp-size", type=int, default=2)
    ap.add_argument("--configs", default="plain,sp", help="comma list of built-in ones")
    ap.add_argument("--config", action="append", default=[], help="NAME='SERVER ARGS'")
    ap.add_argument("--server-args", default="", help="appended to every server")
    ap.add_argument("--bench-args", default="", help="appended to every bench_serving call")
    ap.add_argument("--draft-head", default="bundled")
    ap.add_argument("--length-predictor", default="bundled")
    ap.add_argument("--alpha", type=float, default=0.25)
    ap.add_argument("--rates", default="0.5,1,2,4")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--range-ratio", type=float, default=0.5)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--slo-k", type=float, default=2.0)
    ap.add_argument("--server-timeout", type=float, default=900.0)
    ap.add_argument("--out", required=True, help="result JSON; the plot goes beside it (.png)")
    ap.add_argument("--plan", action="store_true", help="print the configurations and exit")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s] %(message)s")

    from spexis_sglang.cpu_support import activate

    cpu = activate()
    rates = sorted(float(r) for r in args.rates.split(","))
    configs = build_configs(args)
    if args.plan:
        for name, server_args in configs:
            print(f"{name}: {' '.join(server_args)}")
        print("bench:", " ".join(bench_command(args, "URL", rates[0], "OUT")[1:]))
        return 0

    results = {name: sweep(args, name, server_args, rates) for name, server_args in configs}
    analysis = analyse(results, args.slo_k)
    doc = {
        "argv": sys.argv[1:] if argv is None else argv,
        "cpu": cpu,
        "configs": {name: server_args for name, server_args in configs},
        "rates": rates,
        "results": results,
        "analysis": analysis,
    }
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=1)
    png = os.path.splitext(args.out)[0] + ".png"
    plot(results, analysis, png, f"PP={args.pp_size}, {args.num_prompts} req/rate")
    logger.info("analysis: %s", json.dumps(analysis, indent=1))
    logger.info("wrote %s and %s", args.out, png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
