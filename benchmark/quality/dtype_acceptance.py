"""Draft-head acceptance when the exit features come from an fp32, bf16 or fp16 forward.

Why: a head trained on fp32 hidden states (``train/collect.py``'s teacher-forced pass) led
offline (the ``gpu-long`` candidate: .778 vs .760) but not inside the server, which runs the
base *and* the head in float16 on CPU (bfloat16 on GPU). This script scores several heads on
the same greedy answers with features and targets taken from one forward per dtype, split by
answer position, paired per position so that a small difference is told from noise.

Steps (one CPU thread throughout):

1. SpecBench-like prompts (``data.mix.evaluation_mix``, first turns, chat template), as
   ``benchmark/acceptance/sp_acceptance.py --workload specbench`` serves them;
2. greedy answers from the fp32 base (HF ``generate``, ``train.collect.generate_greedy``);
3. per dtype, one teacher-forced forward over prompt + answer: the exit-layer residual stream
   (``output_hidden_states[exit]``, the hook ``collect.teacher_forced`` uses) and that dtype's
   greedy next token (LM head in the same dtype, as SGLang without ``--enable-fp32-lm-head``);
4. each head drafts every answer row in two modes: ``fp32`` (the torch reference,
   ``DraftHead.forward`` + fp32 LM head, on the cast features) and ``native`` (head weights,
   activations and LM head in the feature dtype, as ``srt/draft_model.py`` runs it). The fp32
   forward also gets ``fp32_fp16feat``: features rounded to fp16, as collect stores them for
   training and the offline metric.

Row ``p`` (``prompt_len - 1 <= p < length - 1``) drafts answer token ``k = p - prompt_len + 1``;
it is accepted iff the draft equals that dtype's greedy next token at ``p``.

    PYTHONPATH=python OMP_NUM_THREADS=1 python benchmark/quality/dtype_acceptance.py \
        --head shipped=python/spexis_sglang/artifacts/smollm2-135m-instruct/draft-exit15 \
        --head candidate=REV:python/spexis_sglang/artifacts/smollm2-135m-instruct/draft-exit15 \
        --out benchmark/results/quality_dtype_acceptance.json

``REV``: a commit whose tree held the candidate head (``git log --
python/spexis_sglang/artifacts/smollm2-135m-instruct/draft-exit15`` lists them).
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time

import torch

logger = logging.getLogger("dtype_acceptance")

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def head_dir(spec: str, tmp: str) -> str:
    """A head directory, or ``REV:PATH`` of a committed one (extracted with ``git show``)."""
    if os.path.isdir(spec) or ":" not in spec:
        return spec
    rev, path = spec.split(":", 1)
    out = os.path.join(tmp, rev)
    os.makedirs(out, exist_ok=True)
    for fn in ("config.json", "model.safetensors"):
        blob = subprocess.run(
            ["git", "show", f"{rev}:{path}/{fn}"], check=True, capture_output=True
        ).stdout
        with open(os.path.join(out, fn), "wb") as f:
            f.write(blob)
    return out


@torch.no_grad()
def exit_features(
    model: torch.nn.Module, ids: list[int], exit_layer: int, rows: slice
) -> tuple[torch.Tensor, torch.Tensor]:
    """One unpadded forward: the exit residual stream [T, H] and greedy next tokens on ``rows``.

    The hook on layer ``exit_layer - 1`` is ``collect.teacher_forced``'s; the LM head runs in
    the model's dtype, as SGLang's logits processor does by default."""
    captured: dict[str, torch.Tensor] = {}

    def hook(_mod, _inp, out):
        captured["h"] = out[0] if isinstance(out, tuple) else out

    handle = model.model.layers[exit_layer - 1].register_forward_hook(hook)
    try:
        out = model.model(input_ids=torch.tensor([ids]))
    finally:
        handle.remove()
    final = out.last_hidden_state[0, rows]
    nxt = model.lm_head(final).float().argmax(-1)
    return captured["h"][0], nxt


@torch.no_grad()
def head_hidden_native(head, hidden: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """``DraftHead.forward`` without its fp32 upcast: every op in ``hidden``'s dtype.

    ``srt/draft_model.py`` runs the head in the model dtype (norms compute in fp32 and cast
    back, like ``models.draft_head.RMSNorm``); the reference forward upcasts to fp32 first."""
    from spexis_sglang.models.draft_head import rope_cos_sin

    y = head.fc(head.norm(hidden))
    cos, sin = rope_cos_sin(positions, head.cfg.head_dim, head.cfg.rope_theta)
    for layer in head.layers:
        a, _ = layer.self_attn(layer.input_layernorm(y), cos, sin, None, None)
        y = y + a
    return head.final_norm(y)


@torch.no_grad()
def drafts(
    head_fp32,
    head_low,
    lm_w32: torch.Tensor,
    lm_low: torch.Tensor,
    hidden: torch.Tensor,
    rows: slice,
    mode: str,
) -> torch.Tensor:
    """Greedy drafts on ``rows`` of one sequence (``hidden``: [T, H])."""
    pos = torch.arange(hidden.shape[0])[None]
    if mode == "native":
        z = head_hidden_native(head_low, hidden[None], pos)[0, rows]
        return (z @ lm_low.t()).float().argmax(-1)
    z, _ = head_fp32(hidden[None].float(), pos)
    return (z[0, rows].float() @ lm_w32.t()).argmax(-1)


def binom_two_sided(k: int, n: int) -> float:
    """Exact two-sided sign test p-value for ``k`` successes of ``n`` at p = 1/2."""
    if n == 0:
        return 1.0
    lo = min(k, n - k)
    logs = [
        math.lgamma(n + 1) - math.lgamma(i + 1) - math.lgamma(n - i + 1) - n * math.log(2)
        for i in range(lo + 1)
    ]
    return min(1.0, 2.0 * sum(math.exp(x) for x in logs))


def paired(a: list[torch.Tensor], b: list[torch.Tensor], boot: int, seed: int) -> dict:
    """Acceptance of heads a and b on the same rows (one tensor per sequence), the discordant
    counts, a sign test, and a sequence-level bootstrap 95% interval for ``acc(b) - acc(a)``."""
    ca = torch.tensor([int(x.sum()) for x in a], dtype=torch.float64)
    cb = torch.tensor([int(x.sum()) for x in b], dtype=torch.float64)
    n_seq = torch.tensor([len(x) for x in a], dtype=torch.float64)
    n = int(n_seq.sum())
    only_a = sum(int((x & ~y).sum()) for x, y in zip(a, b))
    only_b = sum(int((y & ~x).sum()) for x, y in zip(a, b))
    res = {
        "rows": n,
        "sequences": int((n_seq > 0).sum()),
        "acc_a": round(float(ca.sum()) / max(n, 1), 4),
        "acc_b": round(float(cb.sum()) / max(n, 1), 4),
        "diff_b_minus_a": round(float(cb.sum() - ca.sum()) / max(n, 1), 4),
        "only_a_right": only_a,
        "only_b_right": only_b,
        "sign_test_p": round(binom_two_sided(only_b, only_a + only_b), 5),
    }
    if n and boot:
        gen = torch.Generator().manual_seed(seed)
        m = len(a)
        idx = torch.randint(0, m, (boot, m), generator=gen)
        tot = n_seq[idx].sum(1).clamp_min(1)
        d = ((cb - ca)[idx].sum(1) / tot).sort().values
        res["boot95"] = [
            round(float(d[int(0.025 * boot)]), 4),
            round(float(d[int(0.975 * boot)]), 4),
        ]
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--head", action="append", required=True, help="NAME=DIR or NAME=REV:DIR (2 or more)"
    )
    ap.add_argument("--prompts", type=int, default=8, help="per category")
    ap.add_argument("--new-tokens", type=int, default=384)
    ap.add_argument("--bands", default="0,128,384", help="answer-position band edges")
    ap.add_argument("--dtypes", default="fp32,bf16,fp16")
    ap.add_argument("--exit-layer", type=int, default=15)
    ap.add_argument("--gen-batch", type=int, default=8)
    ap.add_argument("--answers-cache", default=None, help="JSON of answers to reuse/write")
    ap.add_argument("--bootstrap", type=int, default=2000)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    torch.set_num_threads(1)
    t_start = time.time()

    from spexis_sglang.cpu_support import activate

    activate()
    from spexis_sglang.data.mix import CATEGORIES, evaluation_mix
    from spexis_sglang.default_model import ensure_default_model
    from spexis_sglang.models.draft_head import load_draft_head
    from spexis_sglang.testing import recorded_args, repo_relative
    from spexis_sglang.train.collect import chat_ids, generate_greedy, load_base_model

    specs = dict(h.split("=", 1) for h in args.head)
    tmp = tempfile.mkdtemp(prefix="dtype_acceptance_")
    heads = {n: head_dir(s, tmp) for n, s in specs.items()}
    names = list(heads)
    edges = [int(x) for x in args.bands.split(",")]
    bands = {f"{lo}-{hi - 1}": (lo, hi) for lo, hi in zip(edges, edges[1:])}
    bands["all"] = (0, edges[-1])
    base = load_base_model(ensure_default_model())
    prompts = evaluation_mix(args.prompts, seed=0)
    cats = [p.category for p in prompts]
    prompt_ids = [chat_ids(base, p.chat()) for p in prompts]

    # 1. greedy fp32 answers (cached: they are the slowest step and dtype independent)
    answers = None
    if args.answers_cache and os.path.isfile(args.answers_cache):
        with open(args.answers_cache) as f:
            cached = json.load(f)
        if cached["prompt_ids"] == prompt_ids and cached["new_tokens"] == args.new_tokens:
            answers = cached["answers"]
            logger.info("answers: reused %s", args.answers_cache)
    if answers is None:
        answers = []
        t0 = time.time()
        for s in range(0, len(prompt_ids), args.gen_batch):
            part = prompt_ids[s : s + args.gen_batch]
            answers += [a for a, _ in generate_greedy(base, part, args.new_tokens)]
            logger.info("generated %d/%d (%.0f s)", len(answers), len(prompt_ids), time.time() - t0)
        if args.answers_cache:
            with open(args.answers_cache, "w") as f:
                json.dump(
                    {"prompt_ids": prompt_ids, "new_tokens": args.new_tokens, "answers": answers}, f
                )
    seqs = [p + a for p, a in zip(prompt_ids, answers)]
    rows = [slice(len(p) - 1, len(s) - 1) for p, s in zip(prompt_ids, seqs)]

    head32 = {
        n: load_draft_head(d, base.config, exit_layer=args.exit_layer)[0] for n, d in heads.items()
    }
    shutil.rmtree(tmp, ignore_errors=True)  # heads are in memory now
    lm_w32 = base.lm_head_weight.detach().float()
    # per condition: per head, per sequence, bool accept tensors over answer rows
    accept: dict[str, dict[str, list[torch.Tensor]]] = {}
    labels: dict[str, list[torch.Tensor]] = {}
    timing: dict[str, float] = {}
    for dname in args.dtypes.split(","):
        dt = DTYPES[dname]
        model = base.model if dt == torch.float32 else copy.deepcopy(base.model).to(dt)
        lm_low = model.lm_head.weight.detach()
        head_low = {n: copy.deepcopy(h).to(dt) for n, h in head32.items()}
        modes = ["fp32", "fp32_fp16feat"] if dt == torch.float32 else ["fp32", "native"]
        conds = {m: f"{dname}/{m}" for m in modes}
        for c in conds.values():
            accept[c] = {n: [] for n in names}
        labels[dname] = []
        t0 = time.time()
        for i, (ids, r) in enumerate(zip(seqs, rows)):
            hidden, nxt = exit_features(model, ids, args.exit_layer, r)
            labels[dname].append(nxt)
            for m, c in conds.items():
                feat = hidden.half().float() if m == "fp32_fp16feat" else hidden
                mode = "native" if m == "native" else "fp32"
                for n in names:
                    d = drafts(head32[n], head_low[n], lm_w32, lm_low, feat, r, mode)
                    accept[c][n].append(d == nxt)
            if (i + 1) % 6 == 0 or i + 1 == len(seqs):
                logger.info(
                    "%s: %d/%d sequences (%.0f s)", dname, i + 1, len(seqs), time.time() - t0
                )
        timing[dname] = round(time.time() - t0, 1)
        if model is not base.model:
            del model

    # 2. tables: every condition x band, heads paired against the first
    a_name = names[0]
    results: dict = {}
    for c, per_head in accept.items():
        results[c] = {}
        for band, (lo, hi) in bands.items():
            for b_name in names[1:]:
                a = [x[lo:hi] for x in per_head[a_name]]
                b = [x[lo:hi] for x in per_head[b_name]]
                key = band if len(names) == 2 else f"{band}:{b_name}"
                results[c][key] = paired(a, b, args.bootstrap, seed=0)
        # per category, whole answers
        results[c]["by_category"] = {
            cat: {
                n: round(
                    float(sum(int(x.sum()) for x, k in zip(per_head[n], cats) if k == cat))
                    / max(1, sum(len(x) for x, k in zip(per_head[n], cats) if k == cat)),
                    4,
                )
                for n in names
            }
            for cat in CATEGORIES
        }
    agree = {}
    for dname, lab in labels.items():
        same_ans = sum(int((x == torch.tensor(a)).sum()) for x, a in zip(lab, answers))
        row = {"rows": sum(len(x) for x in lab), "label_equals_answer_token": same_ans}
        if dname != "fp32" and "fp32" in labels:
            row["label_equals_fp32_label"] = sum(
                int((x == y).sum()) for x, y in zip(lab, labels["fp32"])
            )
        agree[dname] = row
    res = {
        "command": " ".join(recorded_args(sys.argv)),
        "heads": {n: repo_relative(s) if os.path.isdir(s) else s for n, s in specs.items()},
        "pair": f"a={a_name}, b={names[1]}" if len(names) == 2 else f"a={a_name}",
        "exit_layer": args.exit_layer,
        "prompts_per_category": args.prompts,
        "max_new_tokens": args.new_tokens,
        "sequences": len(seqs),
        "answer_tokens": sum(map(len, answers)),
        "answers_finished_by_eos": sum(1 for a in answers if a and a[-1] in base.eos_ids),
        "bands": {k: list(v) for k, v in bands.items()},
        "labels": agree,
        "results": results,
        "seconds": {"per_dtype": timing, "total": round(time.time() - t_start, 1)},
        "threads": torch.get_num_threads(),
    }
    text = json.dumps(res, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
