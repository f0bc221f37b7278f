#!/usr/bin/env python3
"""Decode-throughput results from ``decode_throughput.json`` files: ratios, predictions, plot,
table.

Runs anywhere (numpy + matplotlib; no GPU, no SGLang). For every model in the inputs:

* decode throughput per configuration and batch size (the measurement of
  ``benchmark/gpu/decode_throughput.py``: ``B / T_step``, T_step from the 16/128 difference);
* SP / PP and SP / TP per batch size and forced theta (PP = the stronger stock-PP setting);
* the cost model's SP prediction two ways (paper Table 1, Eq. 2, ``core/cost_model.py``):
  - ``pred_from_pp``: ``B*_eff(B, N, Θ) / T_stage(B)`` with ``T_stage`` the *stock PP* stage
    time at a micro-batch of B rows (what the planner predicts before SP exists; beyond the
    largest measured micro-batch the table extrapolates, marked);
  - ``pred_from_sp_latency``: the same with SP's own measured iteration time (isolates Eq. 2);
  and measured / predicted;
* SP's iteration-time excess over stock PP's stage time at the same row count, beside stage
  0's event-loop phase breakdown (scheduling, launch, draft read-back, waiting for the output,
  result processing): where SP's time goes;
* the planner's ranking (``rank_configurations``) of the measured profile.

    python benchmark/gpu/analyze.py RUN1/decode_throughput.json [RUN2/...] \\
        --out benchmark/results/gpu/decode_MODEL_analysis.json \\
        --plot benchmark/results/gpu/decode_MODEL.png \\
        --markdown benchmark/results/gpu/decode_MODEL_analysis.md
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import replace
from typing import Any, Dict, List, Optional, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(HERE)), "python"))

from spexis_sglang.core.cost_model import LatencyTable, b_eff_star  # noqa: E402
from spexis_sglang.core.planner import (  # noqa: E402
    Profile,
    parse_profile,
    rank_configurations,
)

sys.path.insert(0, HERE)
from decode_throughput import build_profiles, monotone_points  # noqa: E402


def _by_batch(res: Dict[str, Any]) -> Dict[int, Dict[str, Any]]:
    return {b["batch"]: b for b in res.get("batches", []) if b.get("decode_tok_s")}


def _best_per_batch(runs: List[Dict[str, Any]]) -> Dict[int, Tuple[float, str]]:
    """Per batch size, the fastest of a baseline's settings (e.g. stock PP with and without
    async batching): the strongest baseline at every point, not only the best peak."""
    best: Dict[int, Tuple[float, str]] = {}
    for r in runs:
        for b, x in _by_batch(r).items():
            if b not in best or x["decode_tok_s"] > best[b][0]:
                best[b] = (x["decode_tok_s"], r["config"])
    return best


def _stage_table(pps: List[Dict[str, Any]]) -> Optional[LatencyTable]:
    """Stock PP's stage time per micro-batch, the shortest over its settings."""
    shortest: Dict[float, float] = {}
    for pp in pps:
        for b in pp.get("batches", []):
            if b.get("stage_time_s") and b["stage_time_s"] > 0:
                k = b["stage_batch"]
                shortest[k] = min(shortest.get(k, float("inf")), b["stage_time_s"])
    mono = monotone_points(list(shortest.items()))
    return LatencyTable(mono, "stock PP stage time") if mono else None


def analyze_model(
    name: str, results: List[Dict[str, Any]], profile: Optional[dict]
) -> Dict[str, Any]:
    ok = [r for r in results if r.get("status") == "run" and _by_batch(r)]
    out: Dict[str, Any] = {"model": name, "configs": {}, "not_ok": []}
    for r in results:
        if r not in ok:
            out["not_ok"].append(
                {"config": r["config"], "status": r.get("status"), "error": r.get("error")}
            )
    for r in ok:
        out["configs"][r["config"]] = {
            "kind": r["kind"],
            "n": r["n"],
            "theta_forced": r.get("theta_forced"),
            "measured_head_theta": r.get("measured_head_theta", False),
            "ready_after_s": r.get("ready_after_s"),
            "max_total_num_tokens": r.get("max_total_num_tokens"),
            "decode_tok_s": {
                str(b): round(x["decode_tok_s"], 1) for b, x in sorted(_by_batch(r).items())
            },
        }
    pps = [r for r in ok if r["kind"] == "pp"]
    tps = [r for r in ok if r["kind"] == "tp"]
    sps = [r for r in ok if r["kind"] == "sp"]
    out["sp"] = {}
    for sp in sps:
        n = sp["n"]
        pp_runs = [r for r in pps if r["n"] == n]
        tp_runs = [r for r in tps if r["n"] == n]
        pp_best, tp_best = _best_per_batch(pp_runs), _best_per_batch(tp_runs)
        stage = _stage_table(pp_runs) if pp_runs else None
        rows = []
        for b, x in sorted(_by_batch(sp).items()):
            s = x.get("sp") or {}
            theta = s.get("acceptance")
            row: Dict[str, Any] = {
                "batch": b,
                "sp_tok_s": round(x["decode_tok_s"], 1),
                "acceptance": None if theta is None else round(theta, 4),
                "rows_per_iteration": s.get("rows_per_iteration"),
                "iter_time_ms": (
                    None if not s.get("iter_time_s") else round(1e3 * s["iter_time_s"], 3)
                ),
                "phase_ms_per_iteration": s.get("phase_ms_per_iteration"),
            }
            if b in pp_best:
                row["pp_tok_s"], row["pp_config"] = round(pp_best[b][0], 1), pp_best[b][1]
                row["sp_over_pp"] = round(x["decode_tok_s"] / pp_best[b][0], 3)
            if b in tp_best:
                row["tp_tok_s"], row["tp_config"] = round(tp_best[b][0], 1), tp_best[b][1]
                row["sp_over_tp"] = round(x["decode_tok_s"] / tp_best[b][0], 3)
            if theta is not None:
                beff = b_eff_star(b, n, theta)
                if stage is not None:
                    t_stage = stage(b)
                    row["pred_from_pp_tok_s"] = round(beff / t_stage, 1)
                    row["measured_over_pred_from_pp"] = round(
                        x["decode_tok_s"] / (beff / t_stage), 3
                    )
                    row["pred_from_pp_extrapolated"] = stage.extrapolates(b)
                    if s.get("iter_time_s"):
                        row["pp_stage_ms_same_rows"] = round(1e3 * t_stage, 3)
                        row["sp_iter_excess_ms"] = round(1e3 * (s["iter_time_s"] - t_stage), 3)
                if s.get("iter_time_s"):
                    pred = beff / s["iter_time_s"]
                    row["pred_from_sp_latency_tok_s"] = round(pred, 1)
                    row["measured_over_pred_from_sp_latency"] = round(x["decode_tok_s"] / pred, 3)
            rows.append(row)
        out["sp"][sp["config"]] = {
            "pp_baseline": sorted({r["config"] for r in pp_runs}) or None,
            "tp_baseline": sorted({r["config"] for r in tp_runs}) or None,
            "theta_forced": sp.get("theta_forced"),
            "measured_head_theta": sp.get("measured_head_theta", False),
            "rows": rows,
        }
    if profile:
        try:
            ranked = rank_configurations(parse_profile(profile))
            out["planner_ranking"] = [
                {
                    "label": r.label,
                    "mode": r.mode,
                    "batch": r.batch,
                    "theta": r.theta,
                    "predicted_tok_s": round(r.throughput, 1),
                    "extrapolated": r.extrapolated,
                }
                for r in ranked
            ]
            out["planner_vs_measured"] = planner_vs_measured(parse_profile(profile), ok)
        except Exception as e:  # noqa: BLE001
            out["planner_ranking_error"] = repr(e)
    return out


def planner_vs_measured(profile: Profile, ok: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """The planner's prediction at every measured batch size beside the measurement.

    ``rank_configurations`` evaluates each configuration at its ``max_batch``; setting that to
    B gives its prediction at B. Measured: TP (or PP=1) at B; stock PP = the faster setting at
    B; SP = the forced-Θ run whose acceptance the profile's ``theta`` holds.
    """
    batches = sorted({b for r in ok for b in _by_batch(r)})
    sps = [r for r in ok if r["kind"] == "sp" and not r.get("measured_head_theta")]
    out = []
    for b in batches:
        at_b = replace(profile, configs=tuple(replace(c, max_batch=b) for c in profile.configs))
        for r in rank_configurations(at_b):
            if r.mode == "TP":
                kind, n = ("tp", r.tp) if r.tp > 1 else ("pp1", 1)
                runs = [x for x in ok if x["kind"] == kind and x["n"] == n]
            elif r.mode == "PP":
                runs = [x for x in ok if x["kind"] == "pp" and x["n"] == r.pp]
            elif r.mode == "SP":
                cand = [x for x in sps if x["n"] == r.pp]
                runs = (
                    [min(cand, key=lambda x: abs((x["theta_forced"] or 0) - r.theta))]
                    if cand
                    else []
                )
            else:  # SP_alpha needs a rank-acceptance profile: none measured here
                continue
            best = _best_per_batch(runs).get(b)
            row: Dict[str, Any] = {
                "batch": b,
                "label": r.label,
                "mode": r.mode,
                "theta": r.theta,
                "predicted_tok_s": round(r.throughput, 1),
                "extrapolated": r.extrapolated,
            }
            if best:
                row["measured_tok_s"] = round(best[0], 1)
                row["measured_config"] = best[1]
                row["error"] = round(r.throughput / best[0] - 1.0, 3)
            out.append(row)
    return out


def plot(models: Dict[str, Dict[str, Any]], path: str, batches: List[int]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(models), figsize=(6.5 * len(models), 4.6), squeeze=False)
    for ax, (name, m) in zip(axes[0], models.items()):
        for cfg, c in m["configs"].items():
            xs = [int(b) for b in c["decode_tok_s"]]
            ys = list(c["decode_tok_s"].values())
            style = "-o" if c["kind"] != "sp" else "--s"
            label = cfg + (" (measured head Θ)" if c.get("measured_head_theta") else "")
            ax.plot(xs, ys, style, label=label, markersize=4)
        ax.set_xscale("log", base=2)
        ax.set_xticks(batches)
        ax.set_xticklabels([str(b) for b in batches])
        ax.set_xlabel("batch size (concurrent requests)")
        ax.set_ylabel("decode throughput (tokens/s)")
        ax.set_title(f"{name}, dummy weights")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _names(configs: Optional[List[str]]) -> str:
    return ", ".join(configs) if configs else "none"


def markdown(summary: Dict[str, Any]) -> str:
    lines: List[str] = []
    for name, m in summary["models"].items():
        batches = sorted({int(b) for c in m["configs"].values() for b in c["decode_tok_s"]})
        lines += [
            f"### {name}",
            "",
            "Decode throughput, tokens/s:",
            "",
            "| config | " + " | ".join(f"B={b}" for b in batches) + " |",
            "|---|" + "---|" * len(batches),
        ]
        for cfg, c in m["configs"].items():
            cells = [f"{c['decode_tok_s'].get(str(b), '-')}" for b in batches]
            lines.append(f"| {cfg} | " + " | ".join(cells) + " |")
        lines.append("")
        for spname, s in m["sp"].items():
            lines += [
                f"{spname} (PP baseline: the faster per batch of {_names(s['pp_baseline'])}; "
                f"TP baseline: {_names(s['tp_baseline'])}):",
                "",
                "| B | Θ meas. | SP/PP | SP/TP | pred. from PP stage | meas./pred. | "
                "meas./pred. (SP latency) | SP iter ms | PP stage ms (same rows) |",
                "|---|---|---|---|---|---|---|---|---|",
            ]
            for r in s["rows"]:
                ext = "*" if r.get("pred_from_pp_extrapolated") else ""
                lines.append(
                    f"| {r['batch']} | {r.get('acceptance')} | {r.get('sp_over_pp', '-')} | "
                    f"{r.get('sp_over_tp', '-')} | {r.get('pred_from_pp_tok_s', '-')}{ext} | "
                    f"{r.get('measured_over_pred_from_pp', '-')} | "
                    f"{r.get('measured_over_pred_from_sp_latency', '-')} | "
                    f"{r.get('iter_time_ms', '-')} | "
                    f"{r.get('pp_stage_ms_same_rows', '-')} |"
                )
            lines.append("")
        pvm = m.get("planner_vs_measured")
        if pvm:
            lines += [
                "Planner (`core.planner.rank_configurations` on this run's profile, evaluated at "
                "each B) vs measured, tokens/s:",
                "",
                "| B | configuration | predicted | measured | error |",
                "|---|---|---|---|---|",
            ]
            for r in pvm:
                ext = "*" if r["extrapolated"] else ""
                th = f" (Θ {r['theta']:.3f})" if r.get("theta") is not None else ""
                meas = r.get("measured_tok_s", "-")
                err = f"{100 * r['error']:+.1f}%" if "error" in r else "-"
                lines.append(
                    f"| {r['batch']} | {r['label']}{th} | {r['predicted_tok_s']}{ext} | "
                    f"{meas} | {err} |"
                )
            lines.append("")
        if m.get("not_ok"):
            lines += [
                "Not measured: "
                + "; ".join(f"{x['config']} ({x['status']}: {x['error']})" for x in m["not_ok"]),
                "",
            ]
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("inputs", nargs="+", help="decode_throughput.json files")
    p.add_argument("--out", required=True)
    p.add_argument("--plot", default=None)
    p.add_argument("--markdown", default=None)
    a = p.parse_args(argv)
    summary: Dict[str, Any] = {"inputs": [], "models": {}, "not_run": []}
    batches: List[int] = []
    runs: Dict[str, Dict[str, Any]] = {}
    for path in a.inputs:
        with open(path) as f:
            d = json.load(f)
        summary["inputs"].append(
            {
                "file": path,
                "num_gpus": d.get("num_gpus"),
                "gpu": d.get("gpu"),
                "kv_budget": d.get("kv_budget"),
                "argv": d.get("argv"),
                "input_len": d.get("input_len"),
                "output_len": d.get("output_len"),
                "started": d.get("started"),
            }
        )
        summary["not_run"] += d.get("not_run", [])
        batches = sorted(set(batches) | set(d.get("batches", [])))
        for name, m in d["models"].items():
            prev = runs.get(name)
            if prev is not None:
                for k in ("input_len", "output_len", "short_output_len", "kv_budget"):
                    if prev["file"].get(k) != d.get(k):
                        p.error(f"{path}: {k} differs from an earlier input of {name}")
            runs.setdefault(name, {"file": d, "results": []})["results"] += m["results"]
    for name, run in runs.items():
        # one run of the sweep may not hold every configuration: inputs of the same model (same
        # workload and KV budget, back-to-back calls of one machine) are one run; the
        # planner's profiles are rebuilt from all of them
        d = run["file"]
        ns = argparse.Namespace(
            input_len=d["input_len"],
            output_len=d["output_len"],
            short_output_len=d["short_output_len"],
            batches=batches,
        )
        profiles = build_profiles(name, run["results"], ns)
        prof = profiles[max(profiles)] if profiles else None
        summary["models"][name] = analyze_model(name, run["results"], prof)
    ran = {(n, r["config"]) for n, run in runs.items() for r in run["results"]}
    summary["not_run"] = [x for x in summary["not_run"] if (x["model"], x["config"]) not in ran]
    with open(a.out, "w") as f:
        json.dump(summary, f, indent=1)
    md = markdown(summary)
    if a.markdown:
        with open(a.markdown, "w") as f:
            f.write(md + "\n")
    if a.plot and summary["models"]:
        plot(summary["models"], a.plot, batches)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
