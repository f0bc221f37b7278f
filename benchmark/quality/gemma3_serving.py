"""A second real model end to end: Gemma 3 270M with its trained head, served with SP on CPU.

Serves the model twice in the exact mode (``--spexis-float64``): plain SGLang at PP=1 (SGLang's
own Gemma 3 class) and Spexis at PP=2 with the trained draft head and length predictor
(``srt/model_gemma3.py`` adds the pipeline stages SGLang's Gemma 3 lacks). Sends the same
greedy requests to both, counts identical outputs, and records live acceptance from
``/server_info`` beside the offline numbers of the training report, in one JSON:

    python -m spexis_sglang.train all --model-path GEMMA_DIR --pp-size 2 --out HEADS ...
    python benchmark/quality/gemma3_serving.py --model-path GEMMA_DIR --heads HEADS \
        --out benchmark/results/quality_gemma3_270m.json

The prompts are the training run's held-out test prompts (``HEADS/<run>/data/*_test``), sent
as the token ids the model was evaluated on.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from spexis_sglang.cpu_support import activate

activate()


from spexis_sglang.srt.stats import stat_deltas  # noqa: E402
from spexis_sglang.testing import ServerProcess, exact_test_args  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def spexis(server) -> dict:
    info = server.server_info(timeout=60)
    return info["internal_states"][0]["spexis"]


def test_prompts(heads: str, n: int) -> list[list[int]]:
    """Held-out prompts of the training run, as token ids (from its collected tensors)."""
    from safetensors.torch import load_file

    out = []
    data = os.path.join(heads, "work", "data")
    for name in ("sharegpt_test", "user_test", "specbench"):
        meta_path = os.path.join(data, name, "meta.json")
        if not os.path.isfile(meta_path):
            continue
        with open(meta_path) as f:
            meta = json.load(f)
        pos = 0
        for shard in meta.get("shards", range(meta["n_shards"])):
            tokens = load_file(os.path.join(data, name, f"shard-{shard:05d}.safetensors"))["tokens"]
            with open(os.path.join(data, name, f"shard-{shard:05d}.safetensors.json")) as f:
                smeta = json.load(f)
            off = 0
            for m in smeta:
                out.append(tokens[off : off + m["prompt_len"]].tolist())
                off += m["length"]
            pos += off
        if len(out) >= n:
            break
    return out[:n]


def _no_machine_paths(command: str) -> str:
    """A command line with each absolute path cut to ``<its last component>``."""
    return " ".join(
        f"<{os.path.basename(a.rstrip('/'))}>" if a.startswith("/") else a for a in command.split()
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-path", required=True)
    ap.add_argument("--heads", required=True, help="the train command's --out")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    report_path = os.path.join(args.heads, "report.json")
    with open(report_path) as f:
        report = json.load(f)
    heads = sorted(d for d in os.listdir(args.heads) if d.startswith("draft-exit"))
    head = os.path.join(args.heads, heads[0])
    prompts = test_prompts(args.heads, args.prompts)
    exact = exact_test_args()
    sampling = {"temperature": 0.0, "max_new_tokens": args.new_tokens, "ignore_eos": True}
    res: dict = {
        "what": "Gemma 3 270M base (GGUF Q4_K_M dequantised), trained head served with SP on CPU",
        "model": os.path.basename(os.path.normpath(args.model_path)),
        "head": heads[0],
        "prompts": len(prompts),
        "new_tokens": args.new_tokens,
        "exact_mode": exact,
        "command": _no_machine_paths(
            "python benchmark/quality/gemma3_serving.py " + " ".join(sys.argv[1:])
        ),
    }
    outputs = {}
    for name, extra in (
        ("plain_pp1", ["--pp-size", "1"]),
        (
            "spexis_pp2",
            ["--pp-size", "2", "--spexis-draft-head", head]
            + ["--spexis-length-predictor", os.path.join(args.heads, "length")],
        ),
    ):
        t0 = time.time()
        server = ServerProcess(["--model-path", args.model_path, *extra, *exact])
        try:
            server.wait_ready(timeout=1800)
            before = spexis(server) if name != "plain_pp1" else None
            t1 = time.time()
            out = server.generate({"input_ids": prompts, "sampling_params": sampling}, 3600)
            res[f"{name}_decode_s"] = time.time() - t1
            outputs[name] = [o["output_ids"] for o in out]
            if before is not None:
                d = stat_deltas(before, spexis(server))
                verdicts = d["accepted"] + d["rejected"]
                res["live"] = {
                    "acceptance": d["accepted"] / max(1, verdicts),
                    "verdicts": verdicts,
                    "rows_spec": d["rows_spec"],
                    "rows_normal": d["rows_normal"],
                }
        finally:
            server.stop()
        res[f"{name}_server_s"] = time.time() - t0
        print(name, "done", flush=True)
    same = [a == b for a, b in zip(outputs["plain_pp1"], outputs["spexis_pp2"])]
    res["identical_outputs"] = f"{sum(same)}/{len(same)}"
    res["first_difference"] = [
        next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), None)
        for a, b in zip(outputs["plain_pp1"], outputs["spexis_pp2"])
        if a != b
    ]
    ex = report["draft"][heads[0].replace("draft-", "")]
    res["offline"] = {
        "acceptance": ex["acceptance"],
        "logit_lens": ex["logit_lens"],
        "length_eval": report["length"]["eval"],
        "length_validation": report["length"]["validation"],
        "data": report["data"],
        "timings_s": report["timings"],
        "train_command": _no_machine_paths(report["run"]["command"]),
    }
    smol = os.path.join(REPO, "benchmark", "results", "quality_cpu.json")
    if os.path.isfile(smol):  # the same pipeline on SmolLM2 at the cpu preset, for comparison
        with open(smol) as f:
            ref = json.load(f)
        res["smollm2_cpu_reference"] = {
            "source": "benchmark/results/quality_cpu.json",
            "acceptance_avg": {k: v["acceptance"]["avg"] for k, v in ref["draft"].items()},
            "length_eval": ref["length"]["eval"],
        }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    print(json.dumps({k: v for k, v in res.items() if k != "offline"}, indent=1))
    return 0 if all(same) else 1


if __name__ == "__main__":
    sys.exit(main())
