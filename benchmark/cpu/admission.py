"""Look-ahead admission on vs off, side by side on CPU, under KV memory pressure.

Two SP servers on the default model (PP=2, bundled draft head, ``--max-total-tokens`` small
enough that the load does not fit), the same burst of greedy chat requests that end at EOS or
``max_new_tokens``. One server adds ``--spexis-length-predictor bundled
--spexis-lookahead-admission``. Reported per server: wall time, output tokens per second,
retractions (requests evicted and recomputed), requests delayed, and how many outputs are
identical between the two (admission changes only when requests run; on CPU fp32 a different
batch composition can still flip a greedy near-tie, which the e2e tests classify).

    .venv/bin/python benchmark/cpu/admission.py --prompts 32 --new-tokens 96 --kv-tokens 1200 \
        --out benchmark/results/cpu_admission.json

CPU numbers are correctness-level: a 2-core shared box, torch-native attention.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from spexis_sglang.cpu_support import activate

activate()

import requests  # noqa: E402

from spexis_sglang.bundled import bundled_draft_head  # noqa: E402
from spexis_sglang.default_model import ensure_default_model  # noqa: E402
from spexis_sglang.testing import ServerProcess  # noqa: E402

RETRACT_LINE = "KV cache pool is full, retracting request"


def run_one(name: str, server_args, prompts, new_tokens: int) -> dict:
    server = ServerProcess(server_args).wait_ready()
    try:
        t0 = time.time()
        out = server.greedy_ids(prompts, new_tokens, ignore_eos=False)
        wall = time.time() - t0
        info = requests.get(server.base_url + "/server_info", timeout=60).json()
        st = info["internal_states"][0]["spexis"]
        with open(server.log_path) as f:
            retractions = f.read().count(RETRACT_LINE)
    finally:
        server.stop()
    tokens = sum(len(o) for o in out)
    rec = {
        "name": name,
        "server_args": server_args,
        "wall_s": round(wall, 2),
        "output_tokens": tokens,
        "output_tok_s": round(tokens / wall, 2),
        "retractions": retractions,
        "admissions_delayed": st.get("admissions_delayed", 0),
        "admission_gated_iterations": st.get("admission_gated_iterations", 0),
        "decode_iterations": st["decode_iterations"],
        "acceptance_rate": round(st["acceptance_rate"], 4),
    }
    print(json.dumps(rec), flush=True)
    return rec, out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--kv-tokens", type=int, default=1200)
    ap.add_argument("--pdr", type=float, default=2.0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    sys.path.insert(0, ".")
    from tests.e2e.prompts import lossless_prompts

    model = ensure_default_model()
    prompts = lossless_prompts(model, args.prompts)
    base = ["--pp-size", "2", "--spexis-draft-head", bundled_draft_head(model, 2)]
    base += ["--max-total-tokens", str(args.kv_tokens), "--chunked-prefill-size", "256"]
    lookahead = base + ["--spexis-length-predictor", "bundled", "--spexis-lookahead-admission"]
    lookahead += ["--spexis-admission-pdr", str(args.pdr)]
    off, out_off = run_one("sp_admission_sglang", base, prompts, args.new_tokens)
    on, out_on = run_one("sp_lookahead_admission", lookahead, prompts, args.new_tokens)
    result = {
        "script": "benchmark/cpu/admission.py",
        "argv": sys.argv[1:],
        "model": "SmolLM2-135M-Instruct (bundled), PP=2, CPU",
        "prompts": args.prompts,
        "max_new_tokens": args.new_tokens,
        "kv_tokens": args.kv_tokens,
        "runs": [off, on],
        "outputs_identical": sum(a == b for a, b in zip(out_off, out_on)),
        "throughput_ratio_lookahead_over_off": round(on["output_tok_s"] / off["output_tok_s"], 3),
    }
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
