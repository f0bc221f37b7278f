"""Remaining-length predictor study on the CPU-preset data: why recall is low, what
helps.

Trains every variant on ``train``, calibrates the cutoffs on ``val`` (precision >= 0.8) and
reports precision / recall on ``sharegpt_test``, ``specbench`` and both pooled, under two label
masks (see ``spexis_sglang.train.length``):

* ``known``: the pipeline's mask (censored labels dropped). Past ``tokens_generated > cap + 1 - t``
  only answers that ended are left and all of them are positive, so a model that knows the
  position scores well there for free.
* ``window``: per threshold only rows with ``tokens_generated + t <= cap + 1``, whose label is
  known whatever the answer did. The unbiased one; the study ranks variants on it.

``oracle`` = the best recall at precision >= 0.8 with a cutoff chosen on the test set itself (a
calibration-free measure of how well the model separates the classes).

Uses one CPU thread. Data: ``~/.cache/spexis/train/cpu/data`` (``python -m spexis_sglang.train
collect --preset cpu``).

    OMP_NUM_THREADS=1 .venv/bin/python benchmark/quality/length_predictor_study.py
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import numpy as np
import torch

from spexis_sglang.core.lookahead import DEFAULT_THRESHOLDS
from spexis_sglang.models.length_predictor import LengthPredictor, LengthPredictorConfig
from spexis_sglang.train.collect import load_collected
from spexis_sglang.train.length import (
    LengthTrainConfig,
    calibrate_cutoffs,
    length_rows,
    precision_recall,
    predict_probs,
    train_length_predictor,
)

EXIT = 15
THRESHOLDS = DEFAULT_THRESHOLDS
HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(os.path.dirname(HERE), "results")

# name -> (model config overrides, train config overrides, calibration min_predicted)
BASE_TRAIN = dict(epochs=10, lr=1e-3)  # the cpu preset's train-length
VARIANTS: dict[str, tuple[dict, dict, int]] = {
    "paper (cpu preset as shipped)": ({}, {}, 20),
    "calibration min_predicted 5": ({}, {}, 5),
    "window mask": ({}, dict(mask="window"), 5),
    "window + pos_weight sqrt": ({}, dict(mask="window", pos_weight="sqrt"), 5),
    "window + pos_weight balanced": ({}, dict(mask="window", pos_weight="balanced"), 5),
    "window + cumulative": (dict(output="cumulative"), dict(mask="window"), 5),
    "window + 30 epochs lr 3e-4": ({}, dict(mask="window", epochs=30, lr=3e-4), 5),
    "window + cumulative + sqrt": (
        dict(output="cumulative"),
        dict(mask="window", pos_weight="sqrt"),
        5,
    ),
    "window + tokens_generated": (dict(features=("tokens_generated",)), dict(mask="window"), 5),
    "window + tokens_generated + prompt_len": (
        dict(features=("tokens_generated", "prompt_len")),
        dict(mask="window"),
        5,
    ),
    "window + cumulative + both features": (
        dict(output="cumulative", features=("tokens_generated", "prompt_len")),
        dict(mask="window"),
        5,
    ),
    "known mask + both features (biased)": (
        dict(features=("tokens_generated", "prompt_len")),
        {},
        5,
    ),
}
TESTS = {"ShareGPT": "sharegpt_test", "SpecBench-like": "specbench"}


def cat_rows(a, b):
    from spexis_sglang.train.length import LengthRows

    return LengthRows(
        *[
            torch.cat([x, y])
            for x, y in zip(
                (a.hidden, a.remaining, a.finished, a.seq + 0, a.generated, a.prompt_len, a.cap),
                (
                    b.hidden,
                    b.remaining,
                    b.finished,
                    b.seq + 10**6,
                    b.generated,
                    b.prompt_len,
                    b.cap,
                ),
            )
        ]
    )


def oracle_recall(p: np.ndarray, y: np.ndarray, target: float = 0.8, min_pred: int = 5) -> float:
    order = np.argsort(-p, kind="stable")
    ps, ys = p[order], y[order]
    tp = np.cumsum(ys)
    n = np.arange(1, len(ys) + 1)
    distinct = np.r_[ps[1:] < ps[:-1], True]
    ok = distinct & (tp / n >= target) & (n >= min_pred)
    return float(tp[ok].max() / max(1, ys.sum())) if ok.any() else 0.0


def evaluate(model, cal_rows, test_sets, min_predicted, target=0.8):
    out = {}
    for mask in ("known", "window"):
        cal_probs = predict_probs(model, cal_rows)
        cutoffs, val_stats = calibrate_cutoffs(
            cal_probs, cal_rows, THRESHOLDS, target, min_predicted, mask=mask
        )
        res = {"cutoffs": cutoffs, "val": val_stats, "test": {}}
        for name, rows in test_sets.items():
            probs = predict_probs(model, rows).numpy()
            y, known = rows.labels(THRESHOLDS, mask)
            per = []
            for k, t in enumerate(THRESHOLDS):
                st = precision_recall(probs[:, k], y[:, k].numpy(), known[:, k].numpy(), cutoffs[k])
                kn = known[:, k].numpy()
                st["oracle_recall"] = oracle_recall(probs[kn, k], y[kn, k].numpy())
                st["threshold"] = t
                per.append(st)
            res["test"][name] = per
        out[mask] = res
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", default=os.path.expanduser("~/.cache/spexis/train/cpu/data"))
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--variants", nargs="*", default=None, help="names (default: all)")
    ap.add_argument("--out", default=os.path.join(RESULTS, "length_predictor_cpu_study.json"))
    args = ap.parse_args()
    torch.set_num_threads(1)
    keys = (f"hidden_{EXIT}",)
    load = lambda n: length_rows(load_collected(os.path.join(args.data, n), keys), EXIT)  # noqa
    train, val = load("train"), load("val")
    tests = {label: load(n) for label, n in TESTS.items()}
    tests["pooled"] = cat_rows(tests["ShareGPT"], tests["SpecBench-like"])
    data = {}
    for name, rows in [("train", train), ("val", val)] + list(tests.items()):
        seqs = {int(s) for s in rows.seq}
        fin = {int(s) for s in rows.seq[rows.finished]}
        data[name] = {
            "rows": len(rows.remaining),
            "sequences": len(seqs),
            "ended_with_eos": len(fin),
        }
    t_start = time.time()
    variants = {k: VARIANTS[k] for k in (args.variants or VARIANTS)}
    out = {
        "command": "OMP_NUM_THREADS=1 .venv/bin/python " + " ".join(sys.argv),
        "data_dir": args.data,
        "data": data,
        "cap": int(train.cap[0]),
        "thresholds": list(THRESHOLDS),
        "target_precision": 0.8,
        "threads": torch.get_num_threads(),
        "machine": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "variants": {},
    }
    if os.path.isfile(args.out) and args.variants:
        with open(args.out) as f:
            prev = json.load(f)
        out["variants"] = prev.get("variants", {})
    for name, (mcfg, tcfg, min_pred) in variants.items():
        runs = []
        for seed in args.seeds:
            torch.manual_seed(seed)
            model = LengthPredictor(
                LengthPredictorConfig(hidden_size=train.hidden.shape[1], **mcfg)
            )
            tc = LengthTrainConfig(exit_layer=EXIT, seed=seed, **{**BASE_TRAIN, **tcfg})
            t0 = time.time()
            model, info = train_length_predictor(model, train, tc, val)
            secs = time.time() - t0
            ev = evaluate(model, val, tests, min_pred)
            runs.append(
                {
                    "seed": seed,
                    "train_seconds": secs,
                    "eval": ev,
                    "best_epoch": int(np.argmin([h["val_bce"] for h in info["history"]])) + 1,
                }
            )
            rec = [round(r["recall"], 3) for r in ev["window"]["test"]["pooled"]]
            prec = [round(r["precision"], 3) for r in ev["window"]["test"]["pooled"]]
            print(
                f"{name} seed {seed}: {secs:.0f}s pooled window recall {rec} precision {prec}",
                flush=True,
            )
        out["variants"][name] = {
            "model": {k: list(v) if isinstance(v, tuple) else v for k, v in mcfg.items()},
            "train": {**BASE_TRAIN, **tcfg},
            "min_predicted": min_pred,
            "runs": runs,
            "summary": summarize(runs),
        }
        out["wall_seconds"] = time.time() - t_start
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
    with open(os.path.splitext(args.out)[0] + "_tables.md", "w") as f:
        f.write(tables(out))


def summarize(runs):
    """Mean over seeds per mask / test set / threshold (nan precision = nothing predicted)."""
    s = {}
    for mask in ("known", "window"):
        s[mask] = {}
        for ts in runs[0]["eval"][mask]["test"]:
            per = []
            for k in range(len(THRESHOLDS)):
                vals = [r["eval"][mask]["test"][ts][k] for r in runs]
                pr = [v["precision"] for v in vals if v["precision"] == v["precision"]]
                per.append(
                    {
                        "threshold": THRESHOLDS[k],
                        "precision": float(np.mean(pr)) if pr else None,
                        "recall": float(np.mean([v["recall"] for v in vals])),
                        "oracle_recall": float(np.mean([v["oracle_recall"] for v in vals])),
                        "positives": vals[0]["positives"],
                        "rows": vals[0]["rows"],
                    }
                )
            s[mask][ts] = per
    s["train_seconds"] = float(np.mean([r["train_seconds"] for r in runs]))
    return s


def _f(x, pct=False):
    return "–" if x is None or x != x else (f"{100 * x:.0f}%" if pct else f"{x:.2f}")


def tables(out: dict) -> str:
    """Per variant, mean over seeds: precision / recall per threshold (pooled test sets)."""
    lines = []
    for mask in ("window", "known"):
        for ts in ("pooled", "ShareGPT", "SpecBench-like"):
            lines += [
                f"### {ts}, `{mask}` mask: precision / recall (oracle recall) per threshold",
                "",
                "| variant | train s | " + " | ".join(f"L<{t}" for t in out["thresholds"]) + " |",
                "|---|---|" + "---|" * len(out["thresholds"]),
            ]
            for name, v in out["variants"].items():
                per = v["summary"][mask][ts]
                cells = [
                    f"{_f(p['precision'])} / {_f(p['recall'])} ({_f(p['oracle_recall'])})"
                    for p in per
                ]
                lines.append(
                    f"| {name} | {v['summary']['train_seconds']:.0f} | " + " | ".join(cells) + " |"
                )
            per = next(iter(out["variants"].values()))["summary"][mask][ts]
            lines += [
                "| positives / rows | | "
                + " | ".join(f"{p['positives']} / {p['rows']}" for p in per)
                + " |",
                "",
            ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
