#!/usr/bin/env python3
"""Greedy equality of Spexis SP and plain SGLang on a GPU, without real weights.

Plain SGLang (PP=1) and Spexis SP (PP=N, an untrained ``random:0`` draft head, real
verification) serve the same dummy-weight model (SGLang's dummy weights are the same in every
server), bf16 with ``--enable-deterministic-inference`` (batch-invariant kernels) and CUDA
graphs on. The same token-id prompts go to both, greedy to a fixed length; every output must
be identical token for token. An untrained head's drafts are nearly all rejected, so almost
every speculative row is redone on the device (``rows_redone`` in the SP counters): this
exercises the pipelined loop's redo path on the GPU far harder than a trained head would.

    python3 benchmark/gpu/sp_equality_dummy.py --out $OUT/sp_equality_dummy.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from typing import Any, Dict, List

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from decode_throughput import MODELS, Server, server_state  # noqa: E402


def generate(srv: Server, prompts: List[List[int]], new_tokens: int) -> List[List[int]]:
    body = {
        "input_ids": prompts,
        "sampling_params": {"max_new_tokens": new_tokens, "temperature": 0.0, "ignore_eos": True},
    }
    out = srv.generate(body, timeout=600)
    return [o["output_ids"] for o in out]


def main(argv: List[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=48)
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--max-total-tokens", type=int, default=65536)
    ap.add_argument("--port", type=int, default=30200)
    ap.add_argument("--local-cpu", action="store_true", help="CPU dry run (float32, no GPU flags)")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "sp_equality.json"))
    a = ap.parse_args(argv)
    model_dir = MODELS.get(a.model, a.model)
    with open(os.path.join(model_dir, "config.json")) as f:
        vocab = int(json.load(f)["vocab_size"])
    rng = random.Random(7)
    prompts = [
        [rng.randrange(100, min(vocab, 32000)) for _ in range(a.input_len)]
        for _ in range(a.prompts)
    ]
    common = [
        "--load-format",
        "dummy",
        "--skip-tokenizer-init",
        "--max-total-tokens",
        str(a.max_total_tokens),
        "--context-length",
        str(a.input_len + a.new_tokens + 64),
    ]
    if a.local_cpu:
        common += ["--dtype", "float32"]
    else:
        common += ["--dtype", "bfloat16", "--enable-deterministic-inference"]
        common += ["--cuda-graph-max-bs", str(max(a.prompts, 8))]
    sp_args = ["--pp-size", str(a.pp), "--spexis-draft-head", "random:0"]
    result: Dict[str, Any] = {
        "script": "benchmark/gpu/sp_equality_dummy.py",
        "model": a.model,
        "pp": a.pp,
        "prompts": a.prompts,
        "input_len": a.input_len,
        "new_tokens": a.new_tokens,
        "share_gpu": os.environ.get("SPEXIS_SHARE_GPU"),
        "servers": {},
    }
    outputs = {}
    sp_name, alpha_one = f"spexis_sp{a.pp}", f"spexis_sp{a.pp}_alpha1"
    servers = [("plain_pp1", ["--pp-size", "1"]), (sp_name, sp_args)]
    # alpha 1 runs stock PP's schedule: stage 0 skips the drafts nothing uses, and the rows
    # built on their placeholders are redone on the device
    servers.append((alpha_one, sp_args + ["--spexis-alpha", "1"]))
    for name, extra in servers:
        log = os.path.join("/tmp", f"sp_equality_{name}.log")
        t = time.time()
        srv = Server(model_dir, common + extra, a.port, log, a.local_cpu)
        try:
            srv.wait_ready(600)
            outputs[name] = generate(srv, prompts, a.new_tokens)
            state = server_state(srv)
            result["servers"][name] = {
                "args": common + extra,
                "seconds": round(time.time() - t, 1),
                "pp_link": state.get("pp_link"),
                "spexis": state.get("spexis"),
            }
        except Exception as e:  # noqa: BLE001 - recorded
            result["servers"][name] = {"error": repr(e), "log_tail": srv.log_tail(40)}
            print(f"{name} failed: {e!r}\n{srv.log_tail(40)}", flush=True)
        finally:
            srv.stop()
    base = outputs.get("plain_pp1")
    for name, key in ((sp_name, None), (alpha_one, "alpha_one")):
        if base is None or name not in outputs:
            continue
        differ = []
        for i, (x, y) in enumerate(zip(base, outputs[name])):
            if x != y:
                first = next(
                    k for k in range(min(len(x), len(y)) + 1) if k >= len(x) or x[k] != y[k]
                )
                differ.append({"prompt": i, "first_difference": first})
        st = result["servers"][name].get("spexis") or {}
        keys = ("rows_normal", "rows_spec", "rows_redone", "rows_stale", "accepted", "rejected")
        keys += ("decode_graph_replays", "decode_eager_forwards", "draft_pass_replays")
        keys += ("drafts_unmade_forwards", "unmade_drafts_verified")
        part = {
            "identical": len(base) - len(differ),
            "differing": differ,
            "sp_rows": {k: st.get(k) for k in keys},
        }
        if key is None:
            result.update(part)
        else:
            result[key] = part
        link = result["servers"][name].get("pp_link")
        print(f"{name} (PP link {link}): identical {part['identical']}/{len(base)}; ", end="")
        print(f"SP rows {part['sp_rows']}")
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)
    ok = result.get("identical") == a.prompts
    ok = ok and result.get("alpha_one", {}).get("identical") == a.prompts
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
