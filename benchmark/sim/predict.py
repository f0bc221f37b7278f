"""Predict SP against stock PP and TP on GPUs we cannot measure (H200, H100, B200; 2/4/8).

    python benchmark/sim/predict.py                    # ~30 min on 2 cores
    python benchmark/sim/predict.py --systems h200_sxm --gpus 2 --no-serving   # a quick look

Writes ``benchmark/results/sim_predictions.json`` and ``sim_predictions.png``. For every
system, GPU count and prompt length (128 and 2,048 tokens):

* decode: steady-state tokens/s at the largest batch every split can hold (<= 512), for TP,
  every stock PP x TP split, and every SP x TP split at alpha 0 / 0.2 / 0.3, at Theta 0.6,
  0.76 and 0.9, with the SP loop before its rewrite (``serial``: stage 0's host work on the
  critical path; validated on the emulated box, 2026-12-02) and the overlapped SP loop
  (``overlap``: the current one; host costs from its phase timers on the box, validated
  there where the GPU sets the pace);
* serving: the largest Poisson request rate whose p90 TTFT <= 2 s and p90 TPOT <= 40 ms, for
  TP, the best stock PP split and the best SP split by decode (1,000 requests, at most 256
  running; ShareGPT output lengths, and its prompt lengths for the short case; per-request
  Theta drawn from the measured per-category acceptance, scaled to the scenario's Theta).

Every number carries the system's error bar (``planning/data/calibration.json``: the H200
validation error; wider where the calibration is borrowed or absent; wider again for the
overlapped loop, which the box tested only where its GPU time exceeds its host time, while on
NVLink its host work often sets the pace). NVLink links, CUDA graphs on.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "python"))

from spexis_sglang.core.pipeline_sim import AcceptanceModel, Deployment  # noqa: E402
from spexis_sglang.planning.aic import load_model_shape  # noqa: E402
from spexis_sglang.planning.machines import machine_for  # noqa: E402
from spexis_sglang.planning.presets import LOOPS, load_calibration  # noqa: E402
from spexis_sglang.planning.search import (  # noqa: E402
    deployments,
    rank_deployments,
    serving_capacity,
)

logger = logging.getLogger("predict")
OVERLAP_EXTRA_ERROR = 0.10
SLO = {"ttft_p90_s": 2.0, "tpot_p90_s": 0.04}


def _workload(prompt: int, n: int, seed: int = 0):
    w = json.loads((ROOT / "benchmark/serving/workloads/sharegpt.json").read_text())
    reqs = w["requests"]
    rng = np.random.default_rng(seed)
    pick = rng.choice(len(reqs), n, replace=n > len(reqs))
    out = np.array([reqs[i][4] for i in pick], dtype=np.int64)
    pl = np.array([reqs[i][3] for i in pick], dtype=np.int64) if prompt == 0 else np.full(n, prompt)
    return np.maximum(pl, 1), np.maximum(out, 1)


def _thetas(cal, theta: float, n: int, seed: int = 0) -> np.ndarray:
    cats = cal.raw["acceptance"]["per_category"]
    v = np.array(list(cats.values()))
    rng = np.random.default_rng(seed + 1)
    return np.clip(theta * v[rng.integers(0, v.size, n)] / v.mean(), 0.0, 0.99)


def decode_block(model, system, gpus, prompt, thetas, alphas, cal, err) -> dict:
    out = {"runs": []}
    for loop in ("serial", "overlap"):
        for th in thetas:
            rows = rank_deployments(
                model,
                system,
                gpus,
                theta=th,
                context=prompt,
                alphas=alphas,
                loop=loop,
                iterations=120,
                calibration=cal,
            )
            e = err + (OVERLAP_EXTRA_ERROR if loop == "overlap" else 0.0)
            for r in rows:
                if r.mode != "sp" and (loop == "overlap" or th != thetas[0]):
                    continue  # stock PP and TP do not change with Theta or SP's loop
                d = r.to_json()
                d.update(
                    loop=loop if r.mode == "sp" else "stock", theta=th if r.mode == "sp" else None
                )
                d["error_bar"] = e if r.mode == "sp" else err
                out["runs"].append(d)
    runs = out["runs"]
    best = {}
    for key, sel in (
        ("tp", lambda r: r["mode"] == "tp"),
        ("pp", lambda r: r["mode"] == "pp"),
    ):
        c = [r for r in runs if sel(r)]
        best[key] = max(c, key=lambda r: r["throughput"]) if c else None
    for loop in ("serial", "overlap"):
        for th in thetas:
            c = [r for r in runs if r["mode"] == "sp" and r["loop"] == loop and r["theta"] == th]
            best[f"sp_{loop}_{th}"] = max(c, key=lambda r: r["throughput"]) if c else None
    summary = {}
    for k, b in best.items():
        if not k.startswith("sp_") or b is None:
            continue
        row = {"best_sp": b["label"], "sp_tok_s": round(b["throughput"], 1)}
        for base in ("pp", "tp"):
            if best[base] is not None:
                ratio = b["throughput"] / best[base]["throughput"]
                row[f"sp_over_{base}"] = round(ratio, 3)
                row[f"sp_over_{base}_error"] = round(ratio * (b["error_bar"] + err), 3)
                row[f"best_{base}"] = best[base]["label"]
        summary[k] = row
    out["best"] = {
        k: (v["label"], round(v["throughput"], 1)) if v else None for k, v in best.items()
    }
    out["summary"] = summary
    out["batch"] = runs[0]["batch"] if runs else None
    return out


def serving_block(
    model, system, gpus, prompt, thetas, decode, cal, err, n_req, max_running
) -> dict:
    shape = load_model_shape(model)
    pl, ol = _workload(prompt, n_req)
    b = min(decode["batch"], max_running)
    res = []
    best_label = decode["best"]

    def dep_of(label: str) -> Deployment:
        for d in deployments(gpus, shape, (0.1, 0.2, 0.3)):
            if d.label == label:
                return d
        raise KeyError(label)

    jobs = [("tp", None, "stock", best_label["tp"]), ("pp", None, "stock", best_label["pp"])]
    for th in thetas:
        jobs.append(("sp", th, "serial", best_label.get(f"sp_serial_{th}")))
    jobs.append(("sp", 0.76, "overlap", best_label.get("sp_overlap_0.76")))
    for mode, th, loop, lab in jobs:
        if lab is None:
            continue
        dep = dep_of(lab[0])
        m = machine_for(
            shape,
            system,
            tp=dep.tp,
            loop="overlap" if loop == "overlap" else "serial",
            calibration=cal,
        )
        theta_req = _thetas(cal, th if th is not None else 0.76, n_req)
        prof = cal.raw["acceptance"]["rank_profile"]
        acc = AcceptanceModel(th if th is not None else 0.76, tuple(prof))
        # the rate where decode at the batch cap would be fully loaded, times 1.3
        rate_hi = 1.3 * lab[1] / float(ol.mean())
        cap = serving_capacity(
            m,
            dep,
            pl,
            ol,
            theta_req,
            acc,
            slo_ttft_s=SLO["ttft_p90_s"],
            slo_tpot_s=SLO["tpot_p90_s"],
            max_running=b,
            kv_capacity_tokens=10**9,
            rate_hi=rate_hi,
            steps=5,
            loop=LOOPS["overlap" if loop == "overlap" else "serial"],
        )
        s = cap["at_rate"] or {}
        e = err + (OVERLAP_EXTRA_ERROR if loop == "overlap" else 0.0)
        res.append(
            {
                "mode": mode,
                "deployment": lab[0],
                "theta": th,
                "loop": loop,
                "max_rate_req_s": round(cap["rate"], 3),
                "error_bar": e,
                "output_tok_s_at_rate": round(s.get("output_tok_s", float("nan")), 1),
                "ttft_p90_s": round(s.get("ttft_s", {}).get("p90", float("nan")), 4),
                "tpot_p90_s": round(s.get("tpot_s", {}).get("p90", float("nan")), 5),
                "bracketed": cap["bracketed"],
            }
        )
        logger.info(
            "  serving %s %s theta %s (%s): %.2f req/s", system, lab[0], th, loop, cap["rate"]
        )
    return {"slo": SLO, "requests": n_req, "max_running": b, "results": res}


def plot(data: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    systems = list(data["systems"])
    prompts = data["prompts"]
    fig, axes = plt.subplots(
        len(prompts), len(systems), figsize=(5 * len(systems), 4 * len(prompts)), squeeze=False
    )
    keys = [
        ("tp", "TP", "tab:blue"),
        ("pp", "stock PP", "tab:gray"),
        ("sp_serial_0.76", "SP today", "tab:orange"),
        ("sp_overlap_0.76", "SP overlapped", "tab:green"),
    ]
    for j, sysname in enumerate(systems):
        for i, prompt in enumerate(prompts):
            ax = axes[i][j]
            gl = sorted(data["systems"][sysname])
            x = np.arange(len(gl))
            w = 0.2
            for k, (key, lab, col) in enumerate(keys):
                vals, errs = [], []
                for g in gl:
                    blk = data["systems"][sysname][g].get(str(prompt), {}).get("decode", {})
                    best = blk.get("best", {}).get(key)
                    runs = [
                        r
                        for r in blk.get("runs", [])
                        if best
                        and r["label"] == best[0]
                        and (
                            r["mode"] != "sp"
                            or (r["loop"] in key and abs((r["theta"] or 0) - 0.76) < 1e-9)
                        )
                    ]
                    v = best[1] if best else 0.0
                    e = runs[0]["error_bar"] if runs else 0.0
                    vals.append(v)
                    errs.append(v * e)
                ax.bar(x + (k - 1.5) * w, vals, w, yerr=errs, label=lab, color=col, capsize=2)
            ax.set_xticks(x)
            ax.set_xticklabels([f"{g} GPUs" for g in gl])
            ax.set_title(f"{sysname}, prompt {prompt}, Theta 0.76")
            ax.set_ylabel("decode tok/s (best split)")
            if i == 0 and j == 0:
                ax.legend(fontsize=8)
    fig.suptitle(f"{data['model']}: predicted decode throughput, NVLink, CUDA graphs (bars: error)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=str(ROOT / "benchmark/gpu/configs/llama-3.1-8b"))
    ap.add_argument("--systems", nargs="+", default=["h200_sxm", "h100_sxm", "b200_sxm"])
    ap.add_argument("--gpus", nargs="+", type=int, default=[2, 4, 8])
    ap.add_argument("--prompts", nargs="+", type=int, default=[128, 2048])
    ap.add_argument("--thetas", nargs="+", type=float, default=[0.6, 0.76, 0.9])
    ap.add_argument("--alphas", nargs="+", type=float, default=[0.2, 0.3])
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--max-running", type=int, default=256)
    ap.add_argument("--no-serving", action="store_true")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmark/results/sim_predictions.json")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    for name in ("aiconfigurator_core", "aiconfigurator", "spexis_sglang.planning.machines"):
        logging.getLogger(name).setLevel(logging.ERROR)
    cal = load_calibration()
    shape = load_model_shape(args.model)
    t0 = time.time()
    model_rel = (
        str(Path(args.model).resolve().relative_to(ROOT))
        if Path(args.model).exists()
        else args.model
    )
    data = {
        "about": __doc__.split("\n\n")[0].strip(),
        "command": "python benchmark/sim/predict.py "
        + " ".join(argv if argv is not None else sys.argv[1:]),
        "model": shape.name,
        "model_config": model_rel,
        "prompts": args.prompts,
        "thetas": args.thetas,
        "alphas": [0.0] + args.alphas,
        "decode_output_len_for_kv": 512,
        "loops": {
            "serial": (
                "the SP loop before its rewrite: stage 0's host work on the critical path "
                "(validated on the emulated box, 2026-12-02: benchmark/results/sim_validation.json)"
            ),
            "overlap": cal.raw["host"]["graphs_overlap"]["source"],
        },
        "error_bars": {},
        "systems": {},
    }
    for system in args.systems:
        sc = cal.system(system)
        err = sc.error_bar
        data["error_bars"][system] = {
            "error_bar": err,
            "calibration": sc.source,
            "borrowed_from": sc.borrowed_from,
            "overlap_loop_extra": OVERLAP_EXTRA_ERROR,
        }
        data["systems"][system] = {}
        for g in args.gpus:
            data["systems"][system][g] = {}
            for prompt in args.prompts:
                logger.info("[%4.0f s] %s x%d, prompt %d", time.time() - t0, system, g, prompt)
                blk = {
                    "decode": decode_block(
                        args.model, system, g, prompt, args.thetas, args.alphas, cal, err
                    )
                }
                if not args.no_serving:
                    blk["serving"] = serving_block(
                        args.model,
                        system,
                        g,
                        prompt,
                        args.thetas,
                        blk["decode"],
                        cal,
                        err,
                        args.requests,
                        args.max_running,
                    )
                data["systems"][system][g][str(prompt)] = blk
                args.out.write_text(json.dumps(data, indent=1, default=str) + "\n")
    data["elapsed_s"] = round(time.time() - t0, 1)
    args.out.write_text(json.dumps(data, indent=1, default=str) + "\n")
    plot(data, args.out.with_suffix(".png"))
    logger.info("wrote %s (+ .png) in %.0f s", args.out, data["elapsed_s"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
