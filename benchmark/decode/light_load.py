"""Light load on the CPU server: SP against stock PP=2 at B = 1, 4 and 16, phase by phase.

A user trying the CPU server alone sends one request, or a few: this is where SP must not
lose. Both servers serve the bundled model as ``make serve`` and ``make serve-plain`` do (PP=2,
SGLang's CPU defaults, the default dtype; SP with the bundled head), one after the other, in
pairs whose order alternates (a shared machine drifts). For each B, B chat prompts go in one
``/generate`` call, greedy to a fixed length (``ignore_eos``): the wall time of the call and,
from ``/server_info``'s stage-0 phase timers (stock: ``SPEXIS_PHASE_TIMERS=1``), the CPU and
wall time per decode iteration by phase, with SP's committed tokens per iteration.

``--mixed`` then sends three requests at once to each server, as a user's client might: a
long prompt, a streaming completion and a chat request with a required tool call, and records
when each finished.

    .venv/bin/python benchmark/decode/light_load.py --out /tmp/light_load.json

CPU numbers: thread CPU time is the scheduler's own cost; wall time includes waiting for the
other stage and for the machine's other processes.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import statistics
import sys
import time
from typing import Dict, List

from spexis_sglang.cpu_support import activate

activate()

import requests  # noqa: E402

from spexis_sglang.default_model import ensure_default_model  # noqa: E402
from spexis_sglang.srt.config import ENV_PHASE_TIMERS  # noqa: E402
from spexis_sglang.testing import ServerProcess  # noqa: E402

CONFIGS = {
    "stock_pp2": ["--pp-size", "2"],
    "spexis_sp2": ["--pp-size", "2", "--spexis-draft-head", "bundled"],
}
PROMPTS = [
    "What is the capital of France?",
    "Give me three tips for learning to cook.",
    "Explain what a binary search does.",
    "Write a haiku about autumn rain.",
    "How do vaccines train the immune system?",
    "Suggest a name for a small bakery.",
    "What causes the seasons on Earth?",
    "Describe a good morning routine.",
]


def _chat(model_dir: str, text: str) -> str:
    from transformers import AutoTokenizer

    tok = _chat.tok = getattr(_chat, "tok", None) or AutoTokenizer.from_pretrained(model_dir)
    return tok.apply_chat_template(
        [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
    )


def _spexis(server: ServerProcess) -> Dict[str, float]:
    info = server.server_info(timeout=120)
    return info["internal_states"][0].get("spexis") or {}


def measure(server: ServerProcess, prompts: List[str], new_tokens: int) -> Dict[str, object]:
    body = {
        "text": prompts,
        "sampling_params": {"max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True},
    }
    before = _spexis(server)
    t = time.perf_counter()
    out = requests.post(server.base_url + "/generate", json=body, timeout=1800).json()
    wall = time.perf_counter() - t
    after = _spexis(server)
    d = {k: after[k] - before.get(k, 0) for k in after if isinstance(after[k], (int, float))}
    iters = d.get("decode_iterations") or 0
    rec: Dict[str, object] = {
        "wall_s": round(wall, 3),
        "tokens": sum(len(o["output_ids"]) for o in (out if isinstance(out, list) else [out])),
        "decode_iterations": iters,
    }
    if iters:
        rec["phase_ms_per_decode_iteration"] = {
            k: round(1e3 * v / iters, 3)
            for k, v in d.items()
            if (k.startswith("cpu_") or k.startswith("time_")) and k.endswith("_s")
        }
    if "tokens_committed" in d:
        rec["tokens_per_iteration"] = round(d["tokens_committed"] / max(1, iters), 3)
        verdicts = d.get("accepted", 0) + d.get("rejected", 0)
        rec["acceptance"] = round(d["accepted"] / verdicts, 3) if verdicts else None
    return rec


def mixed(server: ServerProcess, model_dir: str) -> Dict[str, object]:
    """A long prompt, a streaming completion and a required tool call, sent at once."""
    base = server.base_url + "/v1"
    long_text = " ".join(PROMPTS * 40)[:6000]

    def long_prompt():
        return requests.post(
            base + "/chat/completions",
            json={
                "model": "default",
                "messages": [{"role": "user", "content": long_text + "\nSummarise this."}],
                "max_tokens": 32,
                "temperature": 0,
            },
            timeout=1800,
        )

    def streaming():
        r = requests.post(
            base + "/completions",
            json={
                "model": "default",
                "prompt": _chat(model_dir, PROMPTS[2]),
                "max_tokens": 48,
                "temperature": 0,
                "stream": True,
            },
            stream=True,
            timeout=1800,
        )
        chunks = sum(1 for line in r.iter_lines() if line.startswith(b"data:"))
        r.chunks = chunks
        return r

    def tool_call():
        return requests.post(
            base + "/chat/completions",
            json={
                "model": "default",
                "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
                "tools": [
                    {
                        "type": "function",
                        "function": {
                            "name": "get_weather",
                            "parameters": {
                                "type": "object",
                                "properties": {"city": {"type": "string"}},
                                "required": ["city"],
                            },
                        },
                    }
                ],
                "tool_choice": "required",
                "max_tokens": 48,
                "temperature": 0,
            },
            timeout=1800,
        )

    t0 = time.perf_counter()
    out: Dict[str, object] = {}
    with cf.ThreadPoolExecutor(3) as pool:
        futures = {
            pool.submit(fn): name
            for name, fn in (
                ("long_prompt", long_prompt),
                ("streaming", streaming),
                ("tool_call", tool_call),
            )
        }
        for fut in cf.as_completed(futures):
            name = futures[fut]
            try:
                r = fut.result()
                out[name] = {
                    "status": r.status_code,
                    "done_after_s": round(time.perf_counter() - t0, 3),
                }
            except Exception as e:  # noqa: BLE001 - recorded
                out[name] = {"error": repr(e)}
    out["all_done_s"] = round(time.perf_counter() - t0, 3)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", default="1,4,16")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--pairs", type=int, default=2, help="server pairs, order alternating")
    ap.add_argument("--mixed", action="store_true", help="also the three concurrent requests")
    ap.add_argument("--out", default="/tmp/light_load.json")
    a = ap.parse_args(argv)
    model_dir = ensure_default_model()
    batches = [int(b) for b in a.batches.split(",")]
    prompts = [_chat(model_dir, p) for p in PROMPTS]
    runs: Dict[str, Dict[str, list]] = {name: {str(b): [] for b in batches} for name in CONFIGS}
    mixed_runs: Dict[str, list] = {name: [] for name in CONFIGS}
    order = list(CONFIGS)
    for pair in range(a.pairs):
        for name in order if pair % 2 == 0 else order[::-1]:
            env = {ENV_PHASE_TIMERS: "1"}
            server = ServerProcess(CONFIGS[name], env=env)
            try:
                server.wait_ready()
                measure(server, prompts[:2], 8)  # warm-up
                for b in batches:
                    rec = measure(
                        server, [prompts[i % len(prompts)] for i in range(b)], a.new_tokens
                    )
                    runs[name][str(b)].append(rec)
                    print(name, f"B={b}", rec, flush=True)
                if a.mixed:
                    rec = mixed(server, model_dir)
                    mixed_runs[name].append(rec)
                    print(name, "mixed", rec, flush=True)
            finally:
                server.stop()
    summary = {}
    for b in batches:
        med = {name: statistics.median(r["wall_s"] for r in runs[name][str(b)]) for name in CONFIGS}
        summary[str(b)] = {
            "median_wall_s": med,
            "sp_over_stock": round(med["spexis_sp2"] / med["stock_pp2"], 3),
        }
    result = {
        "script": "benchmark/decode/light_load.py",
        "argv": sys.argv[1:] if argv is None else argv,
        "machine": f"{os.cpu_count()} CPU cores",
        "new_tokens": a.new_tokens,
        "runs": runs,
        "summary": summary,
        "mixed": mixed_runs if a.mixed else None,
    }
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)
    for b, s in summary.items():
        print(
            f"B={b}: stock {s['median_wall_s']['stock_pp2']:.2f} s, "
            f"SP {s['median_wall_s']['spexis_sp2']:.2f} s, SP/stock {s['sp_over_stock']}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
