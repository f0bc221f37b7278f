"""Acceptance of SP drafts on structured output, with and without grammar draft masking.

Under constrained decoding a draft the grammar forbids is a certain rejection: the target samples
under the grammar's mask. With draft masking (the default) stage 0's draft head takes its argmax
over the tokens the row's grammar allows; ``--spexis-no-grammar-draft-mask`` turns that off. This
script starts one SP server per setting (one at a time: the bundled head at stage 0's depth,
default model, float64 so the two settings' outputs can be compared token for token), sends the
same greedy requests per grammar (JSON schema, regex, EBNF; plus the same prompts unconstrained
for reference) and reads the change of ``/server_info``'s accepted / rejected drafts per workload.
Masking must not change any output token (it only changes drafts): the script checks that too.

    .venv/bin/python benchmark/acceptance/grammar_acceptance.py --prompts 12 --new-tokens 64 \
        --out benchmark/results/cpu_grammar_acceptance.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from spexis_sglang.cpu_support import activate

activate()


from spexis_sglang.default_model import ensure_default_model  # noqa: E402
from spexis_sglang.testing import ServerProcess, exact_test_args  # noqa: E402

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "maxLength": 24},
        "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 24}, "maxItems": 3},
    },
    "required": ["name", "age", "city", "hobbies"],
    "additionalProperties": False,
}
SUBJECTS = [
    "a retired sailor",
    "a young painter",
    "a chess champion",
    "a baker from Lyon",
    "a software engineer",
    "a marathon runner",
    "a jazz pianist",
    "a school teacher",
    "a beekeeper",
    "an astronaut",
    "a librarian",
    "a street musician",
    "a gardener",
    "a detective",
    "a pilot",
    "a fisherman",
]
QUESTIONS = [
    "Is the sky blue?",
    "Is a tomato a fruit?",
    "Can penguins fly?",
    "Is water wet?",
    "Is the sun a star?",
    "Do fish sleep?",
    "Is chess a sport?",
    "Is Paris in Germany?",
    "Can cats swim?",
    "Is ice lighter than water?",
    "Do plants need light?",
    "Is zero an even number?",
    "Is the moon made of cheese?",
    "Are bats birds?",
    "Is glass a liquid?",
    "Can humans breathe underwater?",
]
WORKLOADS = {
    "json_schema": (
        lambda i: (
            f"Describe {SUBJECTS[i % len(SUBJECTS)]} as JSON with name, age, city and hobbies."
        ),
        {"json_schema": json.dumps(PERSON)},
    ),
    "regex": (
        lambda i: f"{QUESTIONS[i % len(QUESTIONS)]} Answer yes or no, then explain.",
        {"regex": r"(yes|no), because [a-z ,]{10,120}\."},
    ),
    "ebnf": (
        lambda i: f"{QUESTIONS[i % len(QUESTIONS)]} Answer in one sentence.",
        {"ebnf": 'root ::= "The answer is " ("yes" | "no") ". " [a-zA-Z ,]+ "."'},
    ),
}


def stats(server) -> dict:
    info = server.server_info(timeout=60)
    return info["internal_states"][0]["spexis"]


def _tokens_per_row(w: dict) -> float:
    return round(w["tokens_committed"] / max(1, w["rows_normal"] + w["rows_spec"]), 4)


def run_setting(args, model: str, mask: bool, prompts) -> dict:
    server_args = ["--pp-size", "2", "--spexis-draft-head", "bundled", *exact_test_args()]
    if not mask:
        server_args.append("--spexis-no-grammar-draft-mask")
    server = ServerProcess(server_args).wait_ready()
    out = {"server_args": server_args, "workloads": {}}
    try:
        for name, (_, params) in WORKLOADS.items():
            for constrained in (True, False):
                key = name if constrained else f"{name}_unconstrained"
                sampling = {"temperature": 0.0, "max_new_tokens": args.new_tokens}
                if constrained:
                    sampling.update(params)
                before = stats(server)
                t0 = time.time()
                res = server.generate({"input_ids": prompts[name], "sampling_params": sampling})
                wall = time.time() - t0
                after = stats(server)
                acc = after["accepted"] - before["accepted"]
                rej = after["rejected"] - before["rejected"]
                out["workloads"][key] = {
                    "accepted": acc,
                    "rejected": rej,
                    "acceptance": round(acc / max(1, acc + rej), 4),
                    "rows_normal": after["rows_normal"] - before["rows_normal"],
                    "rows_spec": after["rows_spec"] - before["rows_spec"],
                    "rows_stale": after["rows_stale"] - before["rows_stale"],
                    "tokens_committed": after["tokens_committed"] - before["tokens_committed"],
                    "wall_s": round(wall, 1),
                    "finished_by_grammar": sum(
                        o["meta_info"]["finish_reason"]["type"] == "stop" for o in res
                    ),
                    "output_ids": [o["output_ids"] for o in res],
                }
                print(
                    f"mask={mask} {key}: acceptance {out['workloads'][key]['acceptance']:.3f} "
                    f"({acc}/{acc + rej}), {wall:.0f} s",
                    flush=True,
                )
    finally:
        server.stop()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=12)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    sys.path.insert(0, ".")
    from tests.e2e.prompts import templated

    model = ensure_default_model()
    prompts = {
        name: templated(model, [make(i) for i in range(args.prompts)])
        for name, (make, _) in WORKLOADS.items()
    }
    settings = {"masked": run_setting(args, model, True, prompts)}
    settings["unmasked"] = run_setting(args, model, False, prompts)

    summary = {}
    for key in settings["masked"]["workloads"]:
        m = settings["masked"]["workloads"][key]
        u = settings["unmasked"]["workloads"][key]
        summary[key] = {
            "acceptance_masked": m["acceptance"],
            "acceptance_unmasked": u["acceptance"],
            "drafts_masked": m["accepted"] + m["rejected"],
            "drafts_unmasked": u["accepted"] + u["rejected"],
            # committed tokens per launched row (the effective batch's share, Eq. 2)
            "tokens_per_row_masked": _tokens_per_row(m),
            "tokens_per_row_unmasked": _tokens_per_row(u),
            "identical_outputs": sum(a == b for a, b in zip(m["output_ids"], u["output_ids"])),
            "requests": len(m["output_ids"]),
            "finished_by_grammar": m["finished_by_grammar"],
        }
    for s in settings.values():
        for w in s["workloads"].values():
            del w["output_ids"]
    res = {
        "command": " ".join(sys.argv),
        "model": "SmolLM2-135M-Instruct (bundled), float64, PP=2, bundled draft head",
        "prompts_per_workload": args.prompts,
        "new_tokens": args.new_tokens,
        "summary": summary,
        "settings": settings,
    }
    print(json.dumps(summary, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
            f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
