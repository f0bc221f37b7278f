"""How much does batch composition move a row's logits in plain SGLang on CPU?

Plain SGLang is not batch-invariant: the same prompt decoded alone, in a batch of 32, or in
the batch reversed gets logits that differ in the last bits, and those differences grow along
the decode. Where the top two tokens almost tie, the greedy token can flip. This script
serves the default model with plain SGLang (PP=1), decodes the equality test's 32 prompts in
several batch compositions with the top-2 logprobs of every position, and reports, per dtype:

* ``max_gap_shift``: over every (prompt, position) where all compositions share the prefix,
  the largest change of the top-2 logprob gap ``logp1 - logp2`` (= the logit gap) between two
  compositions: how far noise can move a near-tie;
* the positions where the compositions already emit different tokens (flips), with the gap;
* for the flip recorded in CI (prompt 19, position 23), the gap in each composition.

Dtypes: ``auto`` is SGLang's default, which serves this float32 checkpoint in float16 on CPU
(what every CPU server ran before the exact mode, CI's flip included); ``float32``;
``float64`` is ``--spexis-float64``. Results go to ``benchmark/results/cpu_batch_noise.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from typing import Dict, List

from spexis_sglang.cpu_support import activate

activate()

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, ROOT)

from spexis_sglang.default_model import ensure_default_model  # noqa: E402
from spexis_sglang.testing import ServerProcess  # noqa: E402
from tests.e2e.prompts import lossless_prompts  # noqa: E402

DTYPE_ARGS = {"auto": [], "float32": ["--dtype", "float32"], "float64": ["--spexis-float64"]}
RECORDED_FLIP = (19, 23)  # a CI flip in float16: prompt 19, position 23, relative gap 3.8e-4


def decode(server: ServerProcess, prompts: List[List[int]], order: List[int], n: int):
    """Greedy ids and per-position top-2 logprobs of ``prompts`` sent as one batch in ``order``."""
    sampling = {"temperature": 0.0, "max_new_tokens": n, "ignore_eos": True}
    out = server.generate(
        {
            "input_ids": [prompts[i] for i in order],
            "sampling_params": sampling,
            "return_logprob": True,
            "top_logprobs_num": 2,
        }
    )
    res: Dict[int, dict] = {}
    for i, o in zip(order, out):
        tops = o["meta_info"]["output_top_logprobs"]
        res[i] = {
            "ids": o["output_ids"],
            "gaps": [t[0][0] - t[1][0] for t in tops],
        }
    return res


def compositions(n_prompts: int, seed: int) -> Dict[str, List[List[int]]]:
    rng = random.Random(seed)
    everyone = list(range(n_prompts))
    shuffled = everyone[:]
    rng.shuffle(shuffled)
    return {
        "batch": [everyone],
        "reversed": [everyone[::-1]],
        "shuffled": [shuffled],
        "halves": [everyone[: n_prompts // 2], everyone[n_prompts // 2 :]],
        "eighths": [everyone[k : k + n_prompts // 8] for k in range(0, n_prompts, n_prompts // 8)],
        "alone": [[i] for i in everyone],
    }


def measure(dtype: str, prompts: List[List[int]], new_tokens: int, seed: int) -> dict:
    args = ["--pp-size", "1", *DTYPE_ARGS[dtype]]
    server = ServerProcess(args)
    try:
        server.wait_ready()
        runs: Dict[str, Dict[int, dict]] = {}
        for name, batches in compositions(len(prompts), seed).items():
            runs[name] = {}
            for order in batches:
                runs[name].update(decode(server, prompts, order, new_tokens))
    finally:
        server.stop()
    names = list(runs)
    max_shift, at = 0.0, None
    flips = []
    for i in range(len(prompts)):
        ids = [runs[c][i]["ids"] for c in names]
        for j in range(new_tokens):
            # the compositions share the prefix up to j (so the same logits are compared)
            if any(x[:j] != ids[0][:j] for x in ids):
                break
            gaps = [runs[c][i]["gaps"][j] for c in names]
            shift = max(gaps) - min(gaps)
            if shift > max_shift:
                max_shift, at = shift, (i, j)
            if any(x[j] != ids[0][j] for x in ids):
                flips.append({"prompt": i, "position": j, "gaps": dict(zip(names, gaps))})
    p, j = RECORDED_FLIP
    recorded = {
        c: {"token": runs[c][p]["ids"][j], "gap": runs[c][p]["gaps"][j]}
        for c in names
        if runs[c][p]["ids"][:j] == runs["batch"][p]["ids"][:j]
    }
    return {
        "dtype": dtype,
        "compositions": names,
        "max_gap_shift": max_shift,
        "max_gap_shift_at": at,
        "flips": flips,
        "recorded_flip_position": recorded,
    }


def recorded_flip_reference(prompts: List[List[int]]) -> dict:
    """The float64 reference (HF transformers) at the recorded flip: its top-2 tokens and gap."""
    import torch

    from tests.e2e.reference import load_model

    model = load_model(ensure_default_model())
    p, j = RECORDED_FLIP
    ids = list(prompts[p])
    with torch.no_grad():
        out = model(input_ids=torch.tensor([ids]), use_cache=True)
        past, logits = out.past_key_values, out.logits[0, -1]
        for _ in range(j):
            ids.append(int(logits.argmax()))
            out = model(input_ids=torch.tensor([[ids[-1]]]), past_key_values=past, use_cache=True)
            past, logits = out.past_key_values, out.logits[0, -1]
    top = torch.topk(logits, 2)
    gap = float(top.values[0] - top.values[1])
    return {
        "prompt": p,
        "position": j,
        "top2_ids": top.indices.tolist(),
        "top2_logits": top.values.tolist(),
        "gap": gap,
        "relative_gap": gap / abs(float(top.values[0])),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--dtype", nargs="+", choices=list(DTYPE_ARGS), default=["auto", "float32", "float64"]
    )
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmark/results/cpu_batch_noise.json"))
    args = ap.parse_args()
    prompts = lossless_prompts(ensure_default_model(), args.prompts)
    command = "python benchmark/correctness/batch_noise.py " + " ".join(sys.argv[1:])
    reference = recorded_flip_reference(prompts)
    print("float64 reference at the recorded flip:", reference, flush=True)
    results = []
    for dtype in args.dtype:
        t0 = time.time()
        r = measure(dtype, prompts, args.new_tokens, args.seed)
        r["wall_s"] = round(time.time() - t0, 1)
        print(
            f"{dtype}: max top-2 gap shift {r['max_gap_shift']:.3g} at {r['max_gap_shift_at']}, "
            f"{len(r['flips'])} flips across compositions",
            flush=True,
        )
        results.append(r)
        with open(args.out, "w") as f:  # after each dtype: a long run keeps what it measured
            json.dump(
                {
                    "command": command.strip(),
                    "recorded_flip_reference": reference,
                    "results": results,
                },
                f,
                indent=1,
            )
        print("wrote", os.path.relpath(args.out, ROOT), flush=True)


if __name__ == "__main__":
    main()
