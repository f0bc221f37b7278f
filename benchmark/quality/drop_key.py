"""Which confidence should selective speculation rank drafts by: each draft's own, or the
request's previous draft's?

Selective speculation drops the fraction alpha of a batch's drafts with the lowest confidence
(``core/selection.py``). Ranking by each draft's *own* confidence makes stage 0 wait for its own
forward before it can build the next batch. The *previous* draft's confidence (the same
request's draft one position earlier) is already on the host, so ranking by it would hide that
wait. This benchmark measures what the lagged key costs in ranking quality, offline, on the
default model and the bundled draft head:

1. SpecBench-like prompts (``data.mix.evaluation_mix``, ``--per-category`` per category, chat
   template, the model's own answer as context for an MT-Bench follow-up, as ``train.collect``
   does), greedy answers of at most ``--max-new-tokens`` from the fp32 base;
2. one teacher-forced fp32 forward per sequence: the draft head on the exit layer's residual
   stream drafts every row ``p``; a row is accepted iff its draft equals the base's greedy next
   token at ``p`` (``train/draft.py``'s rule). Rows are the answer rows
   ``prompt_len - 1 <= p < length - 1``;
3. keys per row: ``own`` = ``c_p``, ``previous`` = ``c_(p-1)`` of the same sequence (for the
   first answer row, the draft at the prompt's last-but-one position), ``random``;
4. ROC AUC of each key for predicting acceptance, with a 95% interval from a bootstrap over
   sequences;
5. batches of ``B`` rows (from distinct sequences where possible, as a decode batch holds one
   row per request): drop the ``floor(alpha * B)`` lowest by each key (and by an oracle that
   knows the verdicts) and count the acceptance of the dropped and the kept rows and the
   fraction of all accepted drafts that were dropped.

The server ranks by *chain* confidence (the product over a request's unverified drafts and the
new one); the single draft's confidence measured here is the factor the two keys differ in.

Run from the repository root (about 3 minutes on 2 CPU cores; the default model is converted
on first use):

    python benchmark/quality/drop_key.py

writes ``benchmark/results/quality_drop_key_smollm2.json``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from typing import Sequence

import numpy as np

from spexis_sglang.core.selection import num_dropped

logger = logging.getLogger("drop_key")

DEFAULT_OUT = "benchmark/results/quality_drop_key_smollm2.json"
# greedy generation batch (prompts sorted by length, so batches are barely padded)
GEN_BATCH = 6


def roc_auc(score: Sequence[float], label: Sequence[bool]) -> float:
    """ROC AUC of ``score`` for ``label`` (Mann-Whitney U, tied scores share their mean rank).

    The probability that an accepted row outranks a rejected one: how well a key orders drafts,
    whatever fraction is dropped. NaN when one class is empty."""
    score = np.asarray(score, dtype=float)
    label = np.asarray(label, dtype=bool)
    if score.shape != label.shape or score.ndim != 1:
        raise ValueError(f"score {score.shape} and label {label.shape} must be equal 1-D shapes")
    if np.isnan(score).any():
        raise ValueError("scores must not be NaN")
    n_pos = int(label.sum())
    n_neg = label.size - n_pos
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    _, inverse, counts = np.unique(score, return_inverse=True, return_counts=True)
    mean_rank = np.cumsum(counts) - (counts - 1) / 2.0  # 1-based, ties averaged
    ranks = mean_rank[inverse.reshape(-1)]
    return float((ranks[label].sum() - n_pos * (n_pos + 1) / 2.0) / (n_pos * n_neg))


def lag_within_sequences(
    seq: Sequence[int], pos: Sequence[int], values: Sequence[float], fill: float = np.nan
) -> np.ndarray:
    """Per row, ``values`` of the row at ``pos - 1`` of the same sequence (``fill`` if none).

    The previous draft's confidence is the request's own history: it must never come from
    another sequence, whatever order the rows are in."""
    seq = np.asarray(seq)
    pos = np.asarray(pos)
    values = np.asarray(values, dtype=float)
    if not seq.shape == pos.shape == values.shape:
        raise ValueError("seq, pos and values must have one entry per row")
    order = np.lexsort((pos, seq))
    s, p, v = seq[order], pos[order], values[order]
    has_prev = np.zeros(len(order), dtype=bool)
    has_prev[1:] = (s[1:] == s[:-1]) & (p[1:] == p[:-1] + 1)
    lagged = np.full(len(order), fill, dtype=float)
    lagged[1:][has_prev[1:]] = v[:-1][has_prev[1:]]
    out = np.empty_like(lagged)
    out[order] = lagged
    return out


def sample_batches(
    seq: Sequence[int], batch: int, trials: int, rng: np.random.Generator
) -> np.ndarray:
    """``trials`` batches of ``batch`` row indices, shape ``[trials, batch]``.

    A decode batch holds one row per request, so a batch takes each sequence once, in a random
    order; only when ``batch`` exceeds the sequences does a sequence give more rows (in turn,
    at distinct positions)."""
    _, group = np.unique(np.asarray(seq), return_inverse=True)
    group = group.reshape(-1)
    sizes = np.bincount(group)
    if batch > sizes.sum():
        raise ValueError(f"batch {batch} exceeds the {sizes.sum()} rows")
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    out = np.empty((trials, batch), dtype=np.int64)
    for t in range(trials):
        order = rng.permutation(len(sizes))
        need = np.zeros(len(sizes), dtype=np.int64)
        left = batch
        while left:
            open_ = order[need[order] < sizes[order]]
            take = open_[:left]
            need[take] += 1
            left -= take.size
        # the need[g] rows of each sequence with the smallest random draws
        ranked = np.lexsort((rng.random(group.size), group))
        rank = np.arange(group.size) - starts[group[ranked]]
        out[t] = ranked[rank < need[group[ranked]]]
    return out


def simulate_drops(
    accept: Sequence[bool],
    keys: dict[str, Sequence[float]],
    seq: Sequence[int],
    batch_sizes: Sequence[int],
    alphas: Sequence[float],
    trials: int,
    rng: np.random.Generator,
) -> dict[str, dict[str, dict[str, dict[str, float]]]]:
    """Per batch size, alpha and key (plus ``oracle``, which drops rejected drafts first): the
    acceptance of the dropped and the kept rows and the fraction of accepted drafts dropped.

    Drops follow ``core/selection.py``: ``floor(alpha * B)`` rows with the lowest key, NaN
    lowest; ties are broken at random. Every key sees the same batches."""
    accept = np.asarray(accept, dtype=bool)
    keys = {name: np.asarray(k, dtype=float) for name, k in keys.items()}
    keys["oracle"] = accept.astype(float)
    out: dict = {}
    for b in batch_sizes:
        idx = sample_batches(seq, b, trials, rng)
        acc = accept[idx]
        tie = rng.random(idx.shape)
        total = int(acc.sum())
        res: dict = {f"{a:g}": {} for a in alphas}
        for name, key in keys.items():
            val = key[idx]
            val = np.where(np.isnan(val), -np.inf, val)
            ranked = np.take_along_axis(acc, np.lexsort((tie, val), axis=-1), axis=-1)
            for a in alphas:
                k = num_dropped(b, a)
                dropped = int(ranked[:, :k].sum())
                kept = total - dropped
                res[f"{a:g}"][name] = {
                    "dropped_per_batch": k,
                    "acceptance_dropped": dropped / max(1, k * trials),
                    "acceptance_kept": kept / max(1, (b - k) * trials),
                    "accepted_lost": dropped / max(1, total),
                }
        out[str(b)] = res
    return out


def bootstrap_auc(
    seq: Sequence[int],
    accept: Sequence[bool],
    keys: dict[str, Sequence[float]],
    resamples: int,
    rng: np.random.Generator,
) -> dict[str, list[float]]:
    """95% intervals of each key's AUC and of the first key's minus each other's, resampling
    whole sequences: rows of one answer are not independent."""
    seq = np.asarray(seq)
    accept = np.asarray(accept, dtype=bool)
    keys = {name: np.asarray(k, dtype=float) for name, k in keys.items()}
    groups = [np.flatnonzero(seq == s) for s in np.unique(seq)]
    names = list(keys)
    draws = np.empty((resamples, len(names)))
    for i in range(resamples):
        rows = np.concatenate([groups[j] for j in rng.integers(0, len(groups), len(groups))])
        draws[i] = [roc_auc(keys[n][rows], accept[rows]) for n in names]
    out = {n: np.percentile(draws[:, j], [2.5, 97.5]).tolist() for j, n in enumerate(names)}
    for j, n in enumerate(names[1:], start=1):
        diff = draws[:, 0] - draws[:, j]
        out[f"{names[0]}_minus_{n}"] = np.percentile(diff, [2.5, 97.5]).tolist()
    return out


def collect_rows(
    model_path: str,
    head_path: str,
    per_category: int,
    max_new_tokens: int,
    max_prompt_tokens: int,
) -> tuple[dict[str, np.ndarray], dict]:
    """Rows ``p`` from ``prompt_len - 2`` (the prompt-side draft the first answer row's lagged
    key reads) to ``length - 2``: sequence, position, draft confidence, acceptance, and whether
    the row is an answer row; with what was collected."""
    import torch
    from tqdm import tqdm

    from spexis_sglang.data.mix import evaluation_mix
    from spexis_sglang.models.draft_head import load_draft_head
    from spexis_sglang.train.collect import chat_ids, generate_greedy, load_base_model

    base = load_base_model(model_path)
    head, head_cfg = load_draft_head(head_path, base.config)
    exit_layer = head_cfg.exit_layer
    lm_w = base.lm_head_weight.detach().float()
    prompts = evaluation_mix(per_category)
    items = []  # [prompt, chat, prompt ids]
    for p in prompts:
        ids = chat_ids(base, p.chat())
        if len(ids) <= max_prompt_tokens:
            items.append([p, p.chat(), ids])
    logger.info("%d prompts of %d within %d tokens", len(items), len(prompts), max_prompt_tokens)

    def generate(which: list[int], desc: str) -> dict[int, tuple[list[int], bool]]:
        which = sorted(which, key=lambda i: len(items[i][2]))
        out: dict[int, tuple[list[int], bool]] = {}
        for s in tqdm(range(0, len(which), GEN_BATCH), desc=desc, unit="batch"):
            part = which[s : s + GEN_BATCH]
            out.update(
                zip(part, generate_greedy(base, [items[i][2] for i in part], max_new_tokens))
            )
        return out

    answers = generate(list(range(len(items))), "generate")
    # multi-turn prompts: the model's own answer is the context of the next user turn
    for turn in range(max((len(it[0].followups) for it in items), default=0)):
        todo = [i for i, it in enumerate(items) if len(it[0].followups) > turn]
        for i in todo:
            text = base.tokenizer.decode(answers[i][0], skip_special_tokens=True)
            items[i][1] = items[i][1] + [
                {"role": "assistant", "content": text},
                {"role": "user", "content": items[i][0].followups[turn]},
            ]
            items[i][2] = chat_ids(base, items[i][1])
        answers.update(generate(todo, f"generate, follow-up {turn + 1}"))

    cols: dict[str, list[np.ndarray]] = {k: [] for k in ("seq", "pos", "conf", "accept", "answer")}
    categories: dict[str, int] = {}
    mismatches = finished = 0
    with torch.no_grad():
        for i, (p, _, pids) in enumerate(tqdm(items, desc="teacher-forced", unit="seq")):
            answer, done = answers[i]
            n, plen = len(pids) + len(answer), len(pids)
            out = base.model(input_ids=torch.tensor([pids + answer]), output_hidden_states=True)
            nxt = out.logits[0].argmax(-1)
            hidden = out.hidden_states[exit_layer]  # residual stream after the exit layer
            tok, conf, _ = head.draft(hidden, torch.arange(n)[None], lm_w)
            mismatches += int((nxt[plen - 1 : n - 1] != torch.tensor(answer)).sum())
            r = np.arange(plen - 2, n - 1)
            cols["seq"].append(np.full(r.size, i))
            cols["pos"].append(r)
            cols["conf"].append(conf[0].numpy()[r])
            cols["accept"].append((tok[0] == nxt).numpy()[r])
            cols["answer"].append(r >= plen - 1)
            categories[p.category] = categories.get(p.category, 0) + 1
            finished += int(done)
    info = {
        "model": base.name,
        "exit_layer": exit_layer,
        "categories": categories,
        "answers_finished_by_eos": finished,
        # greedy answers whose token differs from the teacher-forced forward's argmax
        "generate_vs_teacher_forced_mismatches": mismatches,
    }
    return {k: np.concatenate(v) for k, v in cols.items()}, info


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=DEFAULT_OUT, help="results JSON")
    ap.add_argument("--per-category", type=int, default=10, help="prompts per category")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--max-prompt-tokens", type=int, default=1536, help="longer prompts skipped")
    ap.add_argument("--batches", default="32,128", help="batch sizes B")
    ap.add_argument("--alphas", default="0.1,0.2,0.3,0.5")
    ap.add_argument("--trials", type=int, default=4000, help="batches per B")
    ap.add_argument("--bootstrap", type=int, default=1000, help="AUC resamples")
    ap.add_argument("--seed", type=int, default=0, help="random key, batches, ties, bootstrap")
    ap.add_argument("--model-path", default=None, help="default: the default model")
    ap.add_argument(
        "--draft-head", default="bundled", help="DIR, or bundled: the shipped head at stage 0"
    )
    ap.add_argument("--pp-size", type=int, default=2, help="stage 0's depth for bundled")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    t0 = time.time()

    from spexis_sglang.cpu_support import activate

    activate()
    import torch

    from spexis_sglang.default_model import ensure_default_model
    from spexis_sglang.srt.bundled import bundled_draft_head
    from spexis_sglang.testing import recorded_args, repo_relative

    torch.set_num_threads(args.threads)
    model_path = args.model_path or ensure_default_model()
    head_path = args.draft_head
    if head_path == "bundled":
        head_path = bundled_draft_head(model_path, args.pp_size)
    rows, info = collect_rows(
        model_path, head_path, args.per_category, args.max_new_tokens, args.max_prompt_tokens
    )
    t_collect = time.time() - t0

    rng = np.random.default_rng(args.seed)
    prev = lag_within_sequences(rows["seq"], rows["pos"], rows["conf"])
    prev_acc = lag_within_sequences(rows["seq"], rows["pos"], rows["accept"])
    m = rows["answer"]
    seq, accept = rows["seq"][m], rows["accept"][m].astype(bool)
    keys = {"own": rows["conf"][m], "previous": prev[m], "random": rng.random(int(m.sum()))}
    after_first = lag_within_sequences(rows["seq"], rows["pos"], rows["answer"], fill=0)[m] == 1
    batch_sizes = [int(b) for b in args.batches.split(",")]
    alphas = [float(a) for a in args.alphas.split(",")]
    res = {
        "what": "selective speculation's drop key: each draft's own confidence vs the same "
        "request's previous draft's (known before stage 0's forward) vs random",
        "command": " ".join(recorded_args(["python"] + sys.argv)),
        "model": info["model"],
        "draft_head": repo_relative(head_path),
        "exit_layer": info["exit_layer"],
        "per_category": args.per_category,
        "max_new_tokens": args.max_new_tokens,
        "seed": args.seed,
        "sequences": int(len(np.unique(seq))),
        "rows": int(m.sum()),
        "categories": info["categories"],
        "answers_finished_by_eos": info["answers_finished_by_eos"],
        "generate_vs_teacher_forced_mismatches": info["generate_vs_teacher_forced_mismatches"],
        "keys": {
            "own": "c_p, the draft's own confidence (stage 0 waits for its forward)",
            "previous": "c_(p-1) of the same sequence (on the first answer row: the draft at "
            "the prompt's last-but-one position)",
            "random": "uniform, one draw per row",
        },
        "acceptance": round(float(accept.mean()), 4),
        "acceptance_after_previous": {
            "accepted": round(float(accept[prev_acc[m] == 1].mean()), 4),
            "rejected": round(float(accept[prev_acc[m] == 0].mean()), 4),
        },
        "corr_own_previous": round(float(np.corrcoef(keys["own"], keys["previous"])[0, 1]), 4),
        "auc": {n: round(roc_auc(k, accept), 4) for n, k in keys.items()},
        "auc_ci95": {
            n: [round(x, 4) for x in ci]
            for n, ci in bootstrap_auc(seq, accept, keys, args.bootstrap, rng).items()
        },
        "auc_after_first_answer_row": {
            n: round(roc_auc(keys[n][after_first], accept[after_first]), 4)
            for n in ("own", "previous")
        },
        "drops_note": "per B, alpha and key: acceptance of the dropped and kept rows; "
        "accepted_lost = accepted drafts dropped / all accepted drafts in the batches",
        "trials_per_batch_size": args.trials,
    }
    drops = simulate_drops(accept, keys, seq, batch_sizes, alphas, args.trials, rng)
    res["drops"] = {
        b: {
            a: {n: {f: round(v, 4) for f, v in row.items()} for n, row in per_key.items()}
            for a, per_key in per_alpha.items()
        }
        for b, per_alpha in drops.items()
    }
    res["seconds"] = {"collect": round(t_collect, 1), "total": round(time.time() - t0, 1)}
    res["threads"] = torch.get_num_threads()
    text = json.dumps(res, indent=1)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        f.write(text + "\n")
    logger.info("AUC %s; wrote %s", res["auc"], args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
