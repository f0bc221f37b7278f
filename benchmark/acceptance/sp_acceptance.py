"""Measured acceptance and effective batch of Spexis SP on CPU vs the paper's Eq. 2.

Starts one SP server (the bundled head at stage 0's depth) and runs a steady greedy decode
(``ignore_eos``, fixed length); reports acceptance Θ, committed tokens per launched row and
per iteration, and Eq. 2's prediction 1 / (N - Θ (N - 1)) for tokens per row.

    .venv/bin/python benchmark/acceptance/sp_acceptance.py --pp-size 2 --prompts 16 \
        --new-tokens 160 --out benchmark/results/cpu_sp_acceptance.json

``--workload specbench`` serves the SpecBench-like mix the heads are scored on offline
(``--prompts`` per category, first turns, chat template, greedy to EOS or ``--new-tokens``) and
reports acceptance per category (``--export-prompt-ids F`` writes the tokenized prompts, which
``--prompt-ids F`` serves on a machine without the data packages: the GPU's); ``--draft-head``
(repeatable there) serves each head in turn on the same prompts, so shipped and candidate heads
are compared side by side in one run; ``--draft-vocab K`` (repeatable) serves each head with
``--spexis-draft-vocab K`` for every K given (the vocabulary's size for the whole of it), for the
acceptance a smaller draft vocabulary costs:

    .venv/bin/python benchmark/acceptance/sp_acceptance.py --workload specbench --prompts 8 \
        --new-tokens 96 --one-batch --draft-vocab 49152 --draft-vocab 16384 \
        --draft-vocab 8192 --draft-vocab 4096 \
        --out benchmark/results/cpu_draft_vocab_acceptance.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from spexis_sglang.cpu_support import activate

activate()


from spexis_sglang.core.cost_model import b_eff_star  # noqa: E402
from spexis_sglang.default_model import ensure_default_model  # noqa: E402
from spexis_sglang.srt.bundled import bundled_draft_head  # noqa: E402
from spexis_sglang.srt.stats import stat_deltas  # noqa: E402
from spexis_sglang.testing import ServerProcess, recorded_args, repo_relative  # noqa: E402


def stats(server) -> dict:
    return server.server_info(timeout=60)["internal_states"][0]["spexis"]


def server_args(head: str, args, draft_vocab: int | None = None) -> list:
    """One SP server: ``head`` at stage 0, and ``--alpha`` and ``draft_vocab`` when set."""
    out = ["--pp-size", str(args.pp_size), "--spexis-draft-head", head]
    if draft_vocab is not None:
        out += ["--spexis-draft-vocab", str(draft_vocab)]
    return out + ["--spexis-alpha", str(args.alpha)] if args.alpha else out


def write(res: dict, out) -> None:
    print(json.dumps(res, indent=1))
    if out:
        with open(out, "w") as f:
            json.dump(res, f, indent=1)


def counters(before: dict, after: dict) -> dict:
    """Acceptance and tokens per row from two ``/server_info`` snapshots."""
    d = stat_deltas(before, after)
    rows = d["rows_normal"] + d["rows_spec"]
    verdicts = d["accepted"] + d["rejected"]
    return {
        "drafts": verdicts,
        "accepted": d["accepted"],
        "acceptance": round(d["accepted"] / max(1, verdicts), 4),
        "tokens_committed": d["tokens_committed"],
        "tokens_per_row": round(d["tokens_committed"] / max(1, rows), 4),
        "decode_iterations": d["decode_iterations"],
    }


def specbench(model: str, heads: list, args) -> dict:
    """Per head and category: in-server acceptance on the SpecBench-like mix, natural ends."""
    from transformers import AutoTokenizer

    from spexis_sglang.data.mix import CATEGORIES, evaluation_mix

    if args.prompt_ids:  # tokenized elsewhere (a GPU machine lacks the data packages)
        with open(args.prompt_ids) as f:
            by_cat = json.load(f)
        args.prompts = max(map(len, by_cat.values()))
    else:
        tok = AutoTokenizer.from_pretrained(model)
        by_cat = {c: [] for c in CATEGORIES}
        for p in evaluation_mix(args.prompts, seed=0):
            ids = tok.apply_chat_template(p.chat(), tokenize=True, add_generation_prompt=True)
            by_cat[p.category].append([int(t) for t in getattr(ids, "input_ids", ids)])
    if args.export_prompt_ids:
        with open(args.export_prompt_ids, "w") as f:
            json.dump(by_cat, f)
        return {"exported": sum(map(len, by_cat.values()))}
    out: dict = {}
    outputs: dict = {}
    variants = [(h, k) for h in heads for k in (args.draft_vocab or [None])]
    for head, draft_vocab in variants:
        server = ServerProcess(server_args(head, args, draft_vocab))
        server.wait_ready()
        per: dict = {}
        # per category (a batch each), or every category in one batch (--one-batch: long
        # answers at a tenth of the iterations; acceptance over all drafts, not per category)
        groups = {"all": sum(by_cat.values(), [])} if args.one_batch else by_cat
        try:
            for cat, prompts in groups.items():
                before = stats(server)
                sampling = {"temperature": 0.0, "max_new_tokens": args.new_tokens}
                response = server.generate(
                    {"input_ids": prompts, "sampling_params": sampling}, timeout=3600
                )
                ids = [o["output_ids"] for o in response]
                per[cat] = counters(before, stats(server))
                per[cat]["answer_tokens"] = sum(map(len, ids))
                outputs.setdefault(cat, []).append(ids)
        finally:
            server.stop()
        if not args.one_batch:
            per["avg"] = round(sum(per[c]["acceptance"] for c in CATEGORIES) / len(CATEGORIES), 4)
        label = repo_relative(head)
        if draft_vocab is not None:
            label += f" --spexis-draft-vocab {draft_vocab}"
        out[label] = per
        print(label, json.dumps({c: per[c] if c == "avg" else per[c]["acceptance"] for c in per}))
    identical = all(all(o == outs[0] for o in outs) for outs in outputs.values())
    return {"per_head": out, "outputs_identical_across_heads": identical}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pp-size", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=160)
    ap.add_argument("--alpha", type=float, default=0.0)
    ap.add_argument("--out", default=None)
    ap.add_argument("--workload", choices=("lossless", "specbench"), default="lossless")
    ap.add_argument("--draft-head", action="append", default=None)
    ap.add_argument("--one-batch", action="store_true")
    ap.add_argument(
        "--draft-vocab",
        type=int,
        action="append",
        default=None,
        help="specbench: serve each head with --spexis-draft-vocab K (repeatable)",
    )
    ap.add_argument(
        "--export-prompt-ids",
        default=None,
        help="specbench: write the tokenized prompts (per category) to this JSON and stop",
    )
    ap.add_argument(
        "--prompt-ids", default=None, help="specbench: serve the prompts of such a JSON"
    )
    args = ap.parse_args()

    sys.path.insert(0, ".")
    from tests.e2e.prompts import lossless_prompts

    model = ensure_default_model()
    heads = args.draft_head or [bundled_draft_head(model, args.pp_size)]
    if args.workload == "specbench":
        res = {
            "command": " ".join(recorded_args(sys.argv)),
            "pp_size": args.pp_size,
            "alpha": args.alpha,
            "prompts_per_category": args.prompts,
            "max_new_tokens": args.new_tokens,
            "one_batch": args.one_batch,
            **specbench(model, heads, args),
        }
        write(res, args.out)
        return 0
    if len(heads) > 1:
        ap.error("--workload lossless serves one head: pass --draft-head once")
    head = heads[0]
    server = ServerProcess(server_args(head, args)).wait_ready()
    try:
        prompts = lossless_prompts(model, args.prompts)
        before = stats(server)
        t0 = time.time()
        server.greedy_ids(prompts, args.new_tokens)
        wall = time.time() - t0
        after = stats(server)
    finally:
        server.stop()
    d = stat_deltas(before, after)
    rows = d["rows_normal"] + d["rows_spec"]
    theta = d["accepted"] / max(1, d["accepted"] + d["rejected"])
    res = {
        "command": " ".join(recorded_args(sys.argv)),
        "pp_size": args.pp_size,
        "alpha": args.alpha,
        "draft_head": repo_relative(head),
        "prompts": args.prompts,
        "new_tokens": args.new_tokens,
        "wall_s": round(wall, 1),
        "decode_iterations": d["decode_iterations"],
        "rows_normal": d["rows_normal"],
        "rows_spec": d["rows_spec"],
        "rows_stale": d["rows_stale"],
        "drafts_dropped": d["drafts_dropped"],
        "accepted": d["accepted"],
        "rejected": d["rejected"],
        "acceptance": round(theta, 4),
        "tokens_committed": d["tokens_committed"],
        "tokens_per_row_measured": round(d["tokens_committed"] / rows, 4),
        "tokens_per_row_eq2": round(b_eff_star(1.0, args.pp_size, theta), 4),
        "tokens_per_iteration": round(d["tokens_committed"] / d["decode_iterations"], 3),
        "rows_per_iteration": round(rows / d["decode_iterations"], 3),
    }
    res["eq2_relative_error"] = round(
        res["tokens_per_row_measured"] / res["tokens_per_row_eq2"] - 1, 4
    )
    write(res, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
