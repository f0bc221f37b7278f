"""Markdown tables from ``sim_validation.json`` and ``sim_predictions.json``.

python benchmark/sim/report.py            # writes benchmark/results/sim_report.md
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmark" / "results"


def _pct(x: float) -> str:
    return f"{100 * x:+.1f} %"


def calibration_tables(c: dict) -> str:
    out = [
        "## Calibration (`benchmark/results/sim_calibration.json`)",
        "",
        c["h200_correction"],
        "",
    ]
    out += [
        "| stock PP=1, one H200, B | measured tok/s | AIConfigurator | error | "
        "calibrated simulator | error |",
        "|---|---|---|---|---|---|",
    ]
    for r in c["stock_pp1_one_h200"]:
        out.append(
            f"| {r['batch']} ({r['role']}) | {r['measured_tok_s']} | {r['aic_cli_tok_s']} | "
            f"{_pct(r['aic_error'])} | {r['calibrated_sim_tok_s']:.0f} | "
            f"{_pct(r['calibrated_error'])} |"
        )
    if isinstance(c["per_stage"], list):
        out += [
            "",
            "| stage | B | context | measured ms | AIConfigurator ms | error |",
            "|---|---|---|---|---|---|",
        ]
        for r in c["per_stage"]:
            out.append(
                f"| {r['model']} {r['layers']} layers | {r['batch']} | {r['context']} | "
                f"{r['measured_ms']:.3f} | {r['aic_ms']:.3f} | {_pct(r['aic_error'])} |"
            )
    else:
        out += ["", f"Per-stage timings: {c['per_stage']}."]
    lk = c["loopback_link"]
    out += [
        "",
        f"Loopback link of the emulated box: {lk['bandwidth_Bps'] / 1e9:.2f} GB/s, "
        f"{1e6 * lk['latency_s']:.0f} us ({lk['source']}).",
    ]
    return "\n".join(out)


def validation_tables(v: dict) -> str:
    out = ["## Validation (`benchmark/results/sim_validation.json`)", ""]
    s = v["summary"]
    out.append(
        f"Graphs on: {s['graphs_on_within_target']} of {s['graphs_on_validation_points']} "
        f"validation points within {100 * s['target']:.0f} %, largest |error| "
        f"{100 * s['graphs_on_max_abs_error']:.1f} %, "
        f"mean {100 * s['graphs_on_mean_abs_error']:.1f} %. "
        "Graphs off: median |error| "
        f"{100 * s.get('graphs_off_median_abs_error', float('nan')):.1f} % "
        f"({s.get('graphs_off_within_target', 0)} of {s.get('graphs_off_points', 0)} within "
        f"{100 * s['target']:.0f} %)."
    )
    if "new_loop_sp2_validation_points" in s:
        out.append(
            f"\nNew SP loop on the box: SP2 {s['new_loop_sp2_within_target']} of "
            f"{s['new_loop_sp2_validation_points']} validation points within "
            f"{100 * s['target']:.0f} % "
            f"(largest |error| {100 * s['new_loop_sp2_max_abs_error']:.1f} %, "
            f"mean {100 * s['new_loop_sp2_mean_abs_error']:.1f} %); stock PP2 from the same runs "
            f"{s['new_loop_stock_pp2_within_target']} of {s['new_loop_stock_pp2_points']} "
            f"(largest {100 * s['new_loop_stock_pp2_max_abs_error']:.1f} %); against each "
            f"configuration's mean over its runs {s['new_loop_means_within_target']} of "
            f"{s['new_loop_means']}. H200 error bar: +-{100 * s['h200_error_bar']:.0f} %."
        )
    for name, what in (
        ("qwen3_32b", "The Qwen3-32B shape on the box (no fit saw it)"),
        ("ipc", "The box with the same-GPU CUDA IPC link (no fit saw it but the link's probe)"),
        (
            "h100_box",
            "The box on an H100 over the IPC link (the H200's correction and sharing model; "
            "SP2: `auto` points whose alpha stayed 0, their probes not simulated)",
        ),
    ):
        if f"{name}_sp2_points" in s:
            out.append(
                f"\n{what}: SP2 {s[f'{name}_sp2_within_target']} of {s[f'{name}_sp2_points']} "
                f"validation points within {100 * s['target']:.0f} % (largest |error| "
                f"{100 * s[f'{name}_sp2_max_abs_error']:.1f} %), stock PP2 "
                f"{s[f'{name}_stock_pp2_within_target']} of {s[f'{name}_stock_pp2_points']} "
                f"(largest {100 * s[f'{name}_stock_pp2_max_abs_error']:.1f} %)."
            )
    out += [
        "",
        "| section | configuration | input | B | measured tok/s | simulated tok/s | error | role |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for p in v["points"]:
        if p["section"] in ("real_2xh200_graphs_off", "box_new_loop"):
            continue
        out.append(
            f"| {p['section']} | {p['config']} | {p.get('input_len', '')} | {p['batch']} | "
            f"{p['measured_tok_s']:.0f} | {p['simulated_tok_s']:.0f} | {_pct(p['error'])} | "
            f"{p['role']} |"
        )
    new = [p for p in v["points"] if p["section"] == "box_new_loop"]
    if new:
        out += [
            "",
            "The emulated box with the overlapped SP loop (new loop), every run: SP2 at alpha 0 "
            "with the overlapped loop's choreography and host costs; stock PP2 with SGLang's loop "
            "at the run's micro-batch cap and async depth. `fit`: the run whose stage-0 timers "
            "set the overlapped loop's host costs.",
            "",
            "| run | configuration | input | B | measured tok/s | simulated tok/s | error | role |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for p in new:
            day, cfg = p["config"].split(": ", 1)
            out.append(
                f"| {day.replace('new loop, ', '')} | {cfg} | {p['input_len']} | {p['batch']} | "
                f"{p['measured_tok_s']:.0f} | {p['simulated_tok_s']:.0f} | {_pct(p['error'])} | "
                f"{p['role']} |"
            )
    means = v.get("box_new_loop_means") or []
    if means:
        out += [
            "",
            "The same, each configuration at its mean over the runs that made it (spread: "
            "(max - min) / mean of those runs):",
            "",
            "| configuration | input | B | runs | spread | mean tok/s | simulated tok/s | error |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for m in means:
            out.append(
                f"| {m['config']} | {m['input_len']} | {m['batch']} | {m['runs']} | "
                f"{100 * m['run_spread']:.0f} % | {m['measured_mean_tok_s']:.0f} | "
                f"{m['simulated_tok_s']:.0f} | {_pct(m['error'])} |"
            )
    st = v.get("box_new_loop_sp2_stage0") or []
    if st:
        out += [
            "",
            "SP2 with the new loop, stage 0 per iteration (steady state), measured / simulated:",
            "",
            "| run | Theta | input | B | iteration ms | stage-0 GPU ms | iteration / GPU |",
            "|---|---|---|---|---|---|---|",
        ]
        for q in st:
            out.append(
                f"| {q['date']} ({q['role']}) | {q['theta']} | {q['input_len']} | {q['batch']} | "
                f"{q['measured_iteration_ms']:.2f} / {q['simulated_iteration_ms']:.2f} | "
                f"{q['measured_stage0_gpu_ms']:.2f} / {q['simulated_stage0_gpu_ms']:.2f} | "
                f"{q['measured_iter_over_gpu']:.2f} / {q['simulated_iter_over_gpu']:.2f} |"
            )
    out += [
        "",
        "Stage 0's phase timers of SP2 on the box with the old loop (2026-12-02), ms per "
        "iteration (measured / simulated, steady state):",
        "",
    ]
    out += [
        "| B | iteration | schedule | launch | wait_output | process | send |",
        "|---|---|---|---|---|---|---|",
    ]
    for p in v["box_sp2_phases"]:
        m, s_ = p["measured_ms"], p["simulated_ms"]

        def cell(k: str) -> str:
            a = m.get(k)
            return f"{a:.2f} / {s_.get(k, 0):.2f}" if a is not None else f"- / {s_.get(k, 0):.2f}"

        out.append(
            f"| {p['batch']} | {cell('iteration')} | {cell('schedule')} | {cell('launch')} | "
            f"{cell('wait_output')} | {cell('process')} | {cell('send')} |"
        )
    out += [
        "",
        "GEMM-only ideal SP2/PP2 ratio on the box (measured / from AIConfigurator's GEMM tables "
        "under the MPS model):",
        "",
    ]
    out += ["| B | measured | model | error |", "|---|---|---|---|"]
    for r in v["box_gemm_ratio"]:
        out.append(
            f"| {r['batch']} | {r['measured_ratio']:.2f} | {r['aic_ratio']:.2f} | "
            f"{_pct(r['error'])} |"
        )
    out += ["", "Real 2 x H200, CUDA graphs off (runs 3 and 4), |error| by configuration:", ""]
    by: dict = {}
    for p in v["points"]:
        if p["section"] == "real_2xh200_graphs_off" and p["role"] == "validation":
            by.setdefault(p["config"], []).append(p)
    out += ["| configuration | errors by B, 16 … 512 (fit points left out) |", "|---|---|"]
    for cfg, ps in by.items():
        out.append(
            f"| {cfg} | "
            f"{', '.join(_pct(p['error']) for p in sorted(ps, key=lambda q: q['batch']))} |"
        )
    out += [
        "",
        "AIConfigurator's own static estimate vs the simulator, H200 NVLink, graphs on (tok/s):",
        "",
    ]
    out += [
        "| configuration | B | AIConfigurator | simulator | sim / AIC |",
        "|---|---|---|---|---|",
    ]
    for r in v["aic_vs_sim"]:
        out.append(
            f"| {r['config']} | {r['batch']} | {r['aic_tok_s']:.0f} | {r['simulated_tok_s']:.0f} | "
            f"{r['sim_over_aic']:.2f} |"
        )
    return "\n".join(out)


def prediction_tables(p: dict) -> str:
    out = ["## Predictions (`benchmark/results/sim_predictions.json`)", ""]
    out.append(
        f"{p['model']}, NVLink, CUDA graphs on; best split per family at B = the largest batch "
        "every split holds (<= 512). SP old loop = the SP loop before its rewrite (stage 0's "
        "host work on the critical path); SP new loop = the overlapped SP loop, host costs from "
        "its phase timers on the emulated box. Error bars per system: "
        + ", ".join(f"{k} +-{100 * v['error_bar']:.0f} %" for k, v in p["error_bars"].items())
        + " (new loop: +10 points more)."
    )
    out += [
        "",
        "| system | GPUs | prompt | Theta | best TP tok/s | best stock PP | best SP, old loop | "
        "SP/PP | SP/TP | best SP, new loop | SP/TP, new loop |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for sysname, by_g in p["systems"].items():
        for g, by_p in by_g.items():
            for prompt, blk in by_p.items():
                d = blk["decode"]
                best, summ = d["best"], d["summary"]
                for th in p["thetas"]:
                    ser = summ.get(f"sp_serial_{th}")
                    ov = summ.get(f"sp_overlap_{th}")
                    if not ser:
                        continue
                    tp = best.get("tp")
                    pp = best.get("pp")
                    out.append(
                        f"| {sysname} | {g} | {prompt} | {th} | "
                        f"{tp[1]:.0f} ({tp[0]}) | {pp[1]:.0f} ({pp[0]}) | "
                        f"{ser['sp_tok_s']:.0f} ({ser['best_sp']}) | "
                        f"{ser.get('sp_over_pp', float('nan')):.2f} +- "
                        f"{ser.get('sp_over_pp_error', float('nan')):.2f} | "
                        f"{ser.get('sp_over_tp', float('nan')):.2f} +- "
                        f"{ser.get('sp_over_tp_error', float('nan')):.2f} | "
                        f"{ov['sp_tok_s']:.0f} ({ov['best_sp']}) | "
                        f"{ov.get('sp_over_tp', float('nan')):.2f} +- "
                        f"{ov.get('sp_over_tp_error', float('nan')):.2f} |"
                    )
    rows = []
    for sysname, by_g in p["systems"].items():
        for g, by_p in by_g.items():
            for prompt, blk in by_p.items():
                for r in blk.get("serving", {}).get("results", []):
                    rows.append((sysname, g, prompt, r))
    if rows:
        slo = next(iter(next(iter(p["systems"].values())).values()))
        slo = next(iter(slo.values()))["serving"]["slo"]
        out += [
            "",
            f"Serving: largest Poisson rate with p90 TTFT <= {slo['ttft_p90_s']} s and p90 TPOT <= "
            f"{1e3 * slo['tpot_p90_s']:.0f} ms (req/s; ShareGPT outputs):",
            "",
            "| system | GPUs | prompt | deployment | Theta | loop | max rate req/s | +- | "
            "output tok/s there |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for sysname, g, prompt, r in rows:
            out.append(
                f"| {sysname} | {g} | {prompt} | {r['deployment']} | "
                f"{r['theta'] if r['theta'] is not None else '-'} | "
                f"{r['loop']} | {r['max_rate_req_s']:.1f} | "
                f"{r['max_rate_req_s'] * r['error_bar']:.1f} | "
                f"{r['output_tok_s_at_rate']:.0f} |"
            )
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=RESULTS / "sim_report.md")
    args = ap.parse_args(argv)
    parts = [
        "# Pipeline simulator: validation and predictions",
        "",
        "Generated by `python benchmark/sim/report.py`.",
        "",
    ]
    c = RESULTS / "sim_calibration.json"
    if c.is_file():
        parts += [calibration_tables(json.loads(c.read_text())), ""]
    v = RESULTS / "sim_validation.json"
    if v.is_file():
        parts += [validation_tables(json.loads(v.read_text())), ""]
    p = RESULTS / "sim_predictions.json"
    if p.is_file():
        parts += [prediction_tables(json.loads(p.read_text())), ""]
    args.out.write_text("\n".join(parts))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
