"""evaluate: acceptance per category, acceptance vs confidence rank, alpha, predictor quality.

Writes ``quality.json``, ``quality.md`` (tables in the style of the paper's Tables 3 and 4) and
``quality_fig9.png`` (acceptance against confidence rank within a batch, as in Figure 9).
"""

from __future__ import annotations

import json
import logging
import math
import os
from typing import Callable

import numpy as np
import torch

from spexis_sglang.data.mix import CATEGORIES, CATEGORY_LABELS

logger = logging.getLogger(__name__)

RANK_BINS = 10


def acceptance_by_category(pred: dict[str, torch.Tensor], meta: list[dict]) -> dict[str, dict]:
    """Token-weighted acceptance per category; ``avg`` is the mean over categories (as Table 3)."""
    seq_cat = np.array([m.get("category") or m.get("source") for m in meta])
    cats = seq_cat[pred["seq"].numpy()] if len(pred["seq"]) else np.array([])
    acc = pred["accept"].numpy()
    out = {}
    for c in [c for c in CATEGORIES if c in set(cats)] + sorted(set(cats) - set(CATEGORIES)):
        sel = cats == c
        out[c] = {
            "acceptance": float(acc[sel].mean()),
            "rows": int(sel.sum()),
            "sequences": int(len(set(pred["seq"].numpy()[sel]))),
        }
    # the evaluation mix's categories, or (the user's prompts) every category present
    present = [c for c in CATEGORIES if c in out] or list(out)
    out["avg"] = {
        "acceptance": (
            float(np.mean([out[c]["acceptance"] for c in present])) if present else float("nan")
        ),
        "rows": int(len(acc)),
        "micro": float(acc.mean()) if len(acc) else float("nan"),
    }
    return out


def rank_profile(
    confidence: np.ndarray,
    accept: np.ndarray,
    batch: int = 64,
    bins: int = RANK_BINS,
    seed: int = 0,
    repeats: int = 4,
) -> dict:
    """Acceptance per confidence-rank bin within random batches of ``batch`` rows (rank 0 = most
    confident).

    Rows are shuffled into batches (``repeats`` different shuffles), each batch is sorted by
    confidence, and rank ``r`` falls in bin ``floor(r * bins / batch)``.
    """
    rng = np.random.default_rng(seed)
    batch = max(1, min(batch, len(confidence)))
    bins = max(1, min(bins, batch))
    hits = np.zeros(bins)
    counts = np.zeros(bins)
    n = len(confidence)
    for _ in range(repeats):
        perm = rng.permutation(n)
        for s in range(0, n - batch + 1, batch):
            idx = perm[s : s + batch]
            order = idx[np.argsort(-confidence[idx], kind="stable")]
            b = (np.arange(batch) * bins) // batch
            np.add.at(hits, b, accept[order])
            np.add.at(counts, b, 1)
    return {
        "batch": batch,
        "bins": bins,
        "acceptance": [float(h / c) if c else float("nan") for h, c in zip(hits, counts)],
        "rows": int(n),
    }


def _latency_models(batch: int) -> dict[str, Callable[[float], float]]:
    return {
        # decode of a large model at moderate batch: fixed weight-streaming cost plus a part that
        # grows with the rows (equal at the reference batch); our headline assumption
        "affine": lambda rows: 1.0 + rows / batch,
        # purely weight-bound decode: dropping rows saves no time
        "flat": lambda rows: 1.0,
    }


def choose_alpha_for(profile_acc: list[float], num_stages: int, batch: int) -> dict:
    """alpha from the core's chooser (Eq. 3-4 + Table 1) if present, else Eq. 4 directly."""
    results: dict = {"num_stages": num_stages, "batch": batch}
    if not profile_acc or any(not (0.0 <= a <= 1.0) for a in profile_acc):  # NaN: too few rows
        results["chooser"] = "none (too few rows)"
        for name in _latency_models(batch):
            results[name] = {
                "alpha": 0.0,
                "theta_alpha": float("nan"),
                "theta_0": float("nan"),
                "throughput_gain_vs_alpha0": 1.0,
                "curve": [],
            }
        return results
    try:
        from spexis_sglang.core.selection import RankAcceptanceProfile, choose_alpha

        prof = RankAcceptanceProfile(tuple(profile_acc))
        results["chooser"] = "spexis_sglang.core.selection.choose_alpha"
        for name, lat in _latency_models(batch).items():
            best, allc = choose_alpha(num_stages, batch, prof, lat)
            base = allc[0]
            results[name] = {
                "alpha": best.alpha,
                "theta_alpha": best.theta_alpha,
                "theta_0": prof.theta,
                "throughput_gain_vs_alpha0": (
                    best.throughput / base.throughput if base.throughput else float("nan")
                ),
                "curve": [[c.alpha, c.theta_alpha, c.throughput / base.throughput] for c in allc],
            }
    except ImportError:
        results["chooser"] = "Eq. 4 (core.selection unavailable)"
        acc = np.asarray(profile_acc)
        k = len(acc)
        for name, lat in _latency_models(batch).items():
            curve = []
            for a in np.round(np.arange(0, 0.51, 0.01), 2):
                keep = (1 - a) * k
                full = int(math.floor(keep + 1e-9))
                th = (acc[:full].sum() + (keep - full) * (acc[full] if full < k else 0)) / keep
                rows = batch / (1 + a * (num_stages - 1))
                eff = a * rows + (1 - a) * rows / (num_stages - th * (num_stages - 1))
                curve.append([float(a), float(th), eff / lat(rows)])
            base = curve[0][2]
            best = max(curve, key=lambda c: (c[2] > base * (1 + 1e-12), c[2], -c[0]))
            results[name] = {
                "alpha": best[0],
                "theta_alpha": best[1],
                "theta_0": curve[0][1],
                "throughput_gain_vs_alpha0": best[2] / base,
                "curve": [[c[0], c[1], c[2] / base] for c in curve],
            }
    return results


def write_report(results: dict, results_dir: str, stem: str = "quality") -> list[str]:
    os.makedirs(results_dir, exist_ok=True)
    paths = []
    jpath = os.path.join(results_dir, f"{stem}.json")
    with open(jpath, "w") as f:
        json.dump(results, f, indent=2, sort_keys=True)
    paths.append(jpath)
    mpath = os.path.join(results_dir, f"{stem}.md")
    with open(mpath, "w") as f:
        f.write(render_markdown(results))
    paths.append(mpath)
    ppath = os.path.join(results_dir, f"{stem}_fig9.png")
    plot_fig9(results, ppath)
    paths.append(ppath)
    return paths


def _fmt(x: float, pct: bool = False) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "–"
    return f"{100 * x:.1f}%" if pct else f"{x:.3f}".lstrip("0") if 0 <= x < 1 else f"{x:.3f}"


def render_markdown(r: dict) -> str:
    lines = [f"# Draft head and length predictor quality — {r.get('base_model', '')}", ""]
    run = r.get("run", {})
    if run:
        lines += [
            f"Run: preset `{run.get('preset')}`, device `{run.get('device')}`, "
            f"seed {run.get('seed')}. "
            f"Command: `{run.get('command')}`",
            "",
        ]
    lines += [
        "## Table 3 style: first-draft acceptance on the SpecBench-like mix",
        "",
        "Acceptance = the head's greedy draft at row p equals the base model's greedy token at p "
        "(same verified prefix), over every answer row. Avg. = mean over categories.",
        "",
    ]
    cats = [c for c in CATEGORIES]
    lines.append("| Model | Exit | " + " | ".join(CATEGORY_LABELS[c] for c in cats) + " | Avg. |")
    lines.append("|---|---|" + "---|" * (len(cats) + 1))
    for ex in r.get("draft", {}).values():
        acc = ex["acceptance"]
        row = [r.get("model_short", "S135"), f"{ex['exit_fraction']} (layer {ex['exit_layer']})"]
        row += [_fmt(acc.get(c, {}).get("acceptance", float("nan"))) for c in cats]
        row.append(f"**{_fmt(acc['avg']['acceptance'])}**")
        lines.append("| " + " | ".join(row) + " |")
    for ex in r.get("draft", {}).values():
        if "logit_lens" in ex:
            acc = ex["logit_lens"]
            row = ["untrained (logit lens)", f"{ex['exit_fraction']} (layer {ex['exit_layer']})"]
            row += [_fmt(acc.get(c, {}).get("acceptance", float("nan"))) for c in cats]
            row.append(_fmt(acc["avg"]["acceptance"]))
            lines.append("| " + " | ".join(row) + " |")
    lines.append("")
    rows_line = (
        ", ".join(
            f"{CATEGORY_LABELS[c]} "
            f"{r['draft'][next(iter(r['draft']))]['acceptance'].get(c, {}).get('rows', 0)}"
            for c in cats
        )
        if r.get("draft")
        else ""
    )
    lines += [f"Rows per category: {rows_line}.", ""]
    lines += [
        "## Figure 9 style: acceptance vs confidence rank within a batch",
        "",
        "Batches of {} random rows of the mix, sorted by draft confidence "
        "(rank 0 = most confident); "
        "acceptance per tenth of the rank. alpha = drop ratio chosen by `{}`.".format(
            next(iter(r["draft"].values()))["rank_profile"]["batch"] if r.get("draft") else 64,
            next(iter(r["draft"].values()))["alpha"]["chooser"] if r.get("draft") else "",
        ),
        "",
    ]
    lines.append(
        "| Exit | N | "
        + " | ".join(f"r{j}" for j in range(RANK_BINS))
        + " | alpha (affine T) | Theta_alpha | gain | alpha (flat T) |"
    )
    lines.append("|---|---|" + "---|" * (RANK_BINS + 4))
    for ex in r.get("draft", {}).values():
        a = ex["alpha"]
        row = [f"{ex['exit_fraction']} ({ex['exit_layer']})", str(a["num_stages"])]
        accs = list(ex["rank_profile"]["acceptance"]) + [float("nan")] * RANK_BINS
        row += [_fmt(x) for x in accs[:RANK_BINS]]
        row += [
            f"{a['affine']['alpha']:.2f}",
            _fmt(a["affine"]["theta_alpha"]),
            f"{a['affine']['throughput_gain_vs_alpha0']:.3f}x",
            f"{a['flat']['alpha']:.2f}",
        ]
        lines.append("| " + " | ".join(row) + " |")
    lines += [
        "",
        "Latency models for the chooser: affine T(rows) = 1 + rows/B (B = batch), flat T = 1. "
        "Theta_alpha = acceptance of the kept drafts; gain = SP_alpha throughput / SP_0.",
        "",
    ]
    lp = r.get("length")
    if lp:
        sets = list(lp["eval"].keys())
        lines += [
            "## Table 4 style: remaining-length prediction",
            "",
            f"Exit layer {lp['exit_layer']}; cutoffs calibrated on the validation split to "
            f"precision >= {lp['target_precision']}.",
            "",
        ]
        if "features" in lp:
            feats = ", ".join(lp["features"]) or "none (hidden state only)"
            lines += [
                f"Inputs: exit-layer hidden state + scalar features: {feats}; output "
                f"{lp.get('output', 'independent')}; label mask `{lp.get('mask', 'known')}` "
                "(`window`: per threshold t only rows with tokens generated + t <= answer cap + 1, "
                "whose label is known whether or not the answer ended; `known`: every row whose "
                "label is not censored, biased towards answers that ended).",
                "",
            ]
        lines.append(
            "| Thresh. | cutoff | " + " | ".join(f"{s} Prec. | {s} Recall" for s in sets) + " |"
        )
        lines.append("|---|---|" + "---|---|" * len(sets))
        for k, t in enumerate(lp["thresholds"]):
            row = [f"L<{t}", f"{lp['cutoffs'][k]:.3f}"]
            for s in sets:
                st = lp["eval"][s][k]
                row += [_fmt(st["precision"], True), _fmt(st["recall"], True)]
            lines.append("| " + " | ".join(row) + " |")
        lines.append("")
        lines.append(
            "Rows (known labels) / positives per set at L<64: "
            + ", ".join(
                f"{s} {lp['eval'][s][-1]['rows']}/{lp['eval'][s][-1]['positives']}" for s in sets
            )
            + "."
        )
        lines.append("")
    if r.get("timings"):
        lines += (
            ["## Wall times", ""] + [f"- {k}: {v:.0f} s" for k, v in r["timings"].items()] + [""]
        )
    if r.get("data"):
        lines += ["## Data", ""] + [f"- {k}: {v}" for k, v in r["data"].items()] + [""]
    if r.get("notes"):
        lines += ["## Notes", ""] + [f"- {n}" for n in r["notes"]] + [""]
    return "\n".join(lines)


def plot_fig9(r: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    ax = axes[0]
    colors = ["tab:blue", "tab:orange", "tab:green"]
    for (name, ex), col in zip(r.get("draft", {}).items(), colors):
        acc = ex["rank_profile"]["acceptance"]
        x = (np.arange(len(acc)) + 0.5) / len(acc)
        ax.plot(
            x,
            acc,
            marker="o",
            color=col,
            label=f"exit {ex['exit_fraction']} (layer {ex['exit_layer']}), "
            f"Θ={ex['acceptance']['avg']['micro']:.2f}",
        )
        a = ex["alpha"]["affine"]["alpha"]
        if a > 0:
            ax.axvline(1 - a, color=col, linestyle=":", label=f"α={a:.2f} (drop right of line)")
    ax.set_xlabel(
        "confidence rank within a batch of %d (0 = most confident)"
        % (next(iter(r["draft"].values()))["rank_profile"]["batch"] if r.get("draft") else 64)
    )
    ax.set_ylabel("acceptance ratio")
    ax.set_ylim(0, 1.02)
    ax.set_xlim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower left")
    ax.set_title("Acceptance vs confidence rank (cf. paper Fig. 9)")
    ax = axes[1]
    cats = list(CATEGORIES)
    width = 0.8 / max(1, len(r.get("draft", {})))
    for i, ((name, ex), col) in enumerate(zip(r.get("draft", {}).items(), colors)):
        vals = [ex["acceptance"].get(c, {}).get("acceptance", np.nan) for c in cats] + [
            ex["acceptance"]["avg"]["acceptance"]
        ]
        ax.bar(
            np.arange(len(cats) + 1) + i * width,
            vals,
            width,
            color=col,
            label=f"exit {ex['exit_fraction']}",
        )
    ax.set_xticks(np.arange(len(cats) + 1) + width * (len(r.get("draft", {})) - 1) / 2)
    ax.set_xticklabels([CATEGORY_LABELS[c] for c in cats] + ["Avg."])
    ax.set_ylim(0, 1)
    ax.set_ylabel("first-draft acceptance")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title("Acceptance per category (cf. paper Table 3)")
    fig.suptitle(
        f"{r.get('base_model', '')}: draft-head quality ({r.get('run', {}).get('preset', '')} run)"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _pr(st: dict | None) -> str:
    if not st:
        return "–"
    return (
        f"{_fmt(st.get('precision', float('nan')), True)} / "
        f"{_fmt(st.get('recall', float('nan')), True)}"
    )


def _meets(st: dict | None, precision: float, recall: float) -> bool:
    if not st:
        return False
    p, r = st.get("precision", float("nan")), st.get("recall", float("nan"))
    return p == p and r == r and p >= precision and r >= recall


def render_compare(c: dict) -> str:
    """Markdown for ``step_compare``: new vs shipped acceptance and length precision / recall."""
    cap, view = c.get("max_new_tokens"), c.get("compare_cap")
    views = [("", f"answers capped at {cap} (this collection)")]
    if view and cap and view < cap:
        views.append(
            (
                f"_cap{view}",
                f"the same data cut to {view}-token answers (comparable with a {view}-cap run; "
                "multi-turn turn-2 contexts keep their longer turn-1 answers)",
            )
        )
    shipped, new = c["shipped"], c["new"]
    heads = next(iter(new.values()))  # every variant evaluates the same draft heads
    tp, tr = c.get("target_precision", 0.8), c.get("target_recall", 0.4)
    lines = [
        f"# New vs shipped — preset `{c.get('preset')}`",
        "",
        "Shipped = the committed artifacts (`python/spexis_sglang/artifacts/`), evaluated by "
        "`check-artifacts` on this run's data; new = trained in this run. Same rows for both.",
        "",
        "## First-draft acceptance on the SpecBench-like mix (target avg >= "
        f"{c.get('target_acceptance', 0.7):.2f} at the 1/2 exit)",
        "",
    ]
    cats = list(CATEGORIES)
    for suffix, label in views:
        lines += [f"{label}:", ""]
        lines.append("| Head | " + " | ".join(CATEGORY_LABELS[k] for k in cats) + " | Avg. |")
        lines.append("|---|" + "---|" * (len(cats) + 1))
        for name, ex in heads.get("draft", {}).items():
            for who, acc in (
                ("shipped", shipped.get(f"draft-{name}{suffix}")),
                ("new", ex.get(f"acceptance{suffix}")),
            ):
                if not acc:
                    continue
                row = [f"{who} {name}"] + [
                    _fmt(acc.get(k, {}).get("acceptance", float("nan"))) for k in cats
                ]
                row.append(f"**{_fmt(acc['avg']['acceptance'])}**")
                lines.append("| " + " | ".join(row) + " |")
        lines.append("")
    lines += [
        "## Remaining-length prediction: precision / recall at the calibrated cutoffs "
        f"(target: recall >= {tr:.2f} at precision >= {tp:.2f} for L<16, L<32, L<64)",
        "",
        "Shipped predictor with its own cutoffs; new ones calibrated on this run's validation "
        "set. Label mask as in the run (`window`). ✓ = target met.",
        "",
    ]
    predictors = [("shipped", shipped.get("length_eval", {}), shipped.get("length_features", []))]
    for tag, ev in new.items():
        lp = ev.get("length", {})
        # the ceiling variant reads the final hidden state, not an exit's
        src = ["final state"] if lp.get("input") == "final" else []
        predictors.append((f"new ({tag})", lp, src + list(lp.get("features", []))))
    for suffix, label in views:
        key = f"eval{suffix}"
        sets = []
        for _, lp, _ in predictors:
            for s in lp.get(key, {}):
                if s not in sets:
                    sets.append(s)
        for s in sets:
            lines += [f"{s}, {label}:", ""]
            lines.append(
                "| Predictor (features) | "
                + " | ".join(
                    f"L<{st['threshold']}"
                    for st in next(lp[key][s] for _, lp, _ in predictors if s in lp.get(key, {}))
                )
                + " |"
            )
            n = len(next(lp[key][s] for _, lp, _ in predictors if s in lp.get(key, {})))
            lines.append("|---|" + "---|" * n)
            for name, lp, feats in predictors:
                rows = lp.get(key, {}).get(s)
                if not rows:
                    continue
                cells = []
                for st in rows:
                    mark = " ✓" if st["threshold"] in (16, 32, 64) and _meets(st, tp, tr) else ""
                    cells.append(_pr(st) + mark)
                lines.append(
                    f"| {name} ({', '.join(feats) or 'hidden only'}) | " + " | ".join(cells) + " |"
                )
            lines.append("")
    if c.get("data"):
        lines += ["## Data", ""] + [f"- {k}: {v}" for k, v in c["data"].items()] + [""]
    if c.get("timings"):
        lines += (
            ["## Wall times", ""]
            + [f"- {k}: {v:.0f} s" for k, v in c["timings"].items() if isinstance(v, (int, float))]
            + [""]
        )
    return "\n".join(lines)


def write_compare(c: dict, results_dir: str, stem: str) -> list[str]:
    os.makedirs(results_dir, exist_ok=True)
    jpath = os.path.join(results_dir, f"{stem}.json")
    with open(jpath, "w") as f:
        json.dump(c, f, indent=2, sort_keys=True)
    mpath = os.path.join(results_dir, f"{stem}.md")
    with open(mpath, "w") as f:
        f.write(render_compare(c))
    return [jpath, mpath]
