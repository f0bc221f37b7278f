"""Validate the pipeline simulator against every measurement we have, side by side.

    python benchmark/sim/validate.py            # ~3 min on 2 cores; needs spexis-sglang[planner]

Writes ``benchmark/results/sim_validation.json`` and ``sim_validation.png``, and the error
bar of H200 predictions into ``python/spexis_sglang/planning/data/calibration.json``.
Sections (each point is marked ``fit`` when it was used to set a parameter):

1. ``h200_pp1``: stock PP=1 on one H200, graphs on (B=64 set the H200 correction when no
   per-stage timings were measured; with them, all three points validate).
1b. ``h100_pp1``: stock PP=1 on one whole H100 (the anchor of four box calls, inputs 128 and
   2,048), through the H200's correction, which the H100 borrows; points SGLang ran short of
   their batch are marked ``short_of_batch``. Reported, not in the H200 error bar.
2. ``box``: the emulated two-GPU box with the old SP loop (2026-12-02; stage 0's host work
   serial with its forward, ``graphs_serial``), stock PP2 (the fit of the loopback bandwidth
   where the link was not measured) and SP2 (validation), plus SP2's stage-0 phase timers
   beside the simulated ones.
2b. ``box_new_loop``: the same box with the overlapped SP loop (2026-12-03 / 04, three
   committed files): SP2 at alpha 0, Theta 0.76 and 0.6, inputs 128 (B = 16..512) and 2,048
   (B = 16..64), simulated with the overlapped loop (``LoopSpec.send_after_launch``, the
   verdicts taken on the device, host costs ``graphs_overlap``); stock PP2 from the same
   calls (SGLang's micro-batch cap and balanced micro-batches, async depth 0 and 1).
   Validation but SP2 in the file its host costs are fit on; stage 0's iteration and GPU
   time beside the simulated ones.
2c. ``box_qwen3_32b``: the same box and loop with the Qwen3-32B shape (2026-12-04 and, stock
   PP2 only, 2026-12-05), a model nothing was fit on; points whose requests exceed the run's
   KV budget (B = 512) are marked ``kv_bound`` (SGLang runs fewer at once and retracts some;
   the simulator does not).
2d. ``box_ipc``: the same box, the stages linked through the same-GPU CUDA IPC link instead of
   NCCL over sockets (2026-12-05; stock PP2 four ways and SP2 at alpha 0, inputs 128 and
   2,048), simulated with that link as its probe measured it; every point validation.
2e. ``box_h100``: the same box on an H100 over the IPC link (four calls of 2026-12-07): stock
   PP2 at both micro-batch caps, and SP2 ``auto`` points whose alpha stayed 0 throughout,
   simulated as SP2 at alpha 0 (their probes, a few iterations of B/N rows, are not); the
   H100 borrows the H200's correction and MPS sharing model. Reported, not in the error bar.
3. ``box_gemm_ratio``: the GEMM-only ideal SP2/PP2 ratio on the box beside the same ratio from
   AIConfigurator's GEMM tables under the MPS sharing model.
4. ``real_2xh200_graphs_off``: the committed real 2 x H200 runs 3 (Qwen3-8B) and 4
   (Llama-3.1-8B), graphs off: host-bound, simulated with the runs' own phase timers.
5. ``aic_vs_sim``: AIConfigurator's own static estimate for stock PP2 / TP2 / PP1 on H200
   NVLink beside the simulator's, for the same configuration.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "python"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import measurements as M  # noqa: E402
from calibrate import OVERLAP_FIT_FILE  # noqa: E402

from spexis_sglang.core.pipeline_sim import (  # noqa: E402
    AcceptanceModel,
    DecodeWorkload,
    Deployment,
    LoopSpec,
    Machine,
    simulate,
    simulate_decode_benchmark,
)
from spexis_sglang.core.stage_costs import HostCosts, HostPhase, StagePlan  # noqa: E402
from spexis_sglang.planning.aic import aic_static_prediction, load_model_shape  # noqa: E402
from spexis_sglang.planning.machines import machine_for, stage_costs_for  # noqa: E402
from spexis_sglang.planning.presets import CALIBRATION_PATH, LOOPS, load_calibration  # noqa: E402
from spexis_sglang.srt.stats import GpuForwardTimer  # noqa: E402

logger = logging.getLogger("validate")
MS = 1e-3
LLAMA = ROOT / "benchmark/gpu/configs/llama-3.1-8b"
QWEN = ROOT / "benchmark/gpu/configs/qwen3-8b"
QWEN32 = ROOT / "benchmark/gpu/configs/qwen3-32b"
TARGET = 0.10
#: how a section's points name their run (``config``)
SECTION_LABEL = {"box_new_loop": "new loop", "box_ipc": "IPC link", "box_h100": "H100 box"}


def _point(section, config, batch, measured, simulated, role, **extra) -> dict:
    err = simulated / measured - 1.0 if measured else float("nan")
    d = {
        "section": section,
        "config": config,
        "batch": batch,
        "measured_tok_s": round(float(measured), 1),
        "simulated_tok_s": round(float(simulated), 1),
        "error": round(err, 4),
        "role": role,
    }
    d.update(extra)
    return d


def _short_forwards(point: dict, rows: int) -> int:
    """Forwards of fewer than ``rows`` rows in a PP=1 point's GPU timers: SGLang ran fewer
    than B requests at once for part of it (the point is then no rate at B)."""
    timers = (point.get("gpu_forward_ms") or {}).get("pp rank 0, tp rank 0") or {}
    return sum(int(v[0]) for k, v in timers.items() if GpuForwardTimer.rows_of(k) < rows)


# ---------------------------------------------------------------------------------------
def h100_pp1(cal) -> list:
    """Stock PP=1 on one whole H100, each point of the committed runs; a point whose GPU
    timers show forwards of fewer than B rows is marked ``short_of_batch``."""
    m = machine_for(LLAMA, "h100_sxm", tp=1, calibration=cal)
    out = []
    for f, _, d in _box_files(M.COMMITTED["h100_pp1"]):
        for x in d["models"]["llama-3.1-8b"]["results"]:
            if x["kind"] != "pp1" or x.get("status") != "run":
                continue
            for bt in x["batches"]:
                b, il = bt["batch"], bt.get("input_len", d["input_len"])
                thr, _, _ = simulate_decode_benchmark(Deployment("tp", 1, 1), m, b, input_len=il)
                short = _short_forwards(bt, b)
                role = "short_of_batch" if short else "validation"
                out.append(
                    _point(
                        "h100_pp1",
                        "sglang_pp1",
                        b,
                        bt["decode_tok_s"],
                        thr,
                        role,
                        kind="pp",
                        input_len=il,
                        file=f,
                        short_forwards=short,
                    )
                )
    return out


def h200_pp1(cal) -> list:
    m = machine_for(LLAMA, "h200_sxm", tp=1, calibration=cal)
    # B=64 set the correction only when no per-stage timings were there (one factor)
    fit_b = 64 if cal.system("h200_sxm").source.startswith("one factor") else None
    out = []
    for b, meas in M.H200_PP1_GRAPHS_2026_12_01["tok_s"].items():
        thr, _, _ = simulate_decode_benchmark(Deployment("tp", 1, 1), m, b)
        aic = M.AIC_CLI_PP1["tok_s"][b]
        role = "fit" if b == fit_b else "validation"
        out.append(
            _point(
                "h200_pp1",
                "sglang_pp1",
                b,
                meas,
                thr,
                role,
                aic_tok_s=aic,
                aic_error=round(aic / meas - 1, 4),
            )
        )
    return out


def box(cal) -> tuple[list, list]:
    m = machine_for(
        LLAMA, "h200_sxm", tp=1, link="loopback_box", sharing="mps_box", calibration=cal
    )
    box = M.BOX_2026_12_02
    acc = AcceptanceModel(box["theta"])
    pts, phases = [], []
    # stock PP2 here set the loopback bandwidth until the link was measured (transport probe)
    link_fit = "fit on stock PP2" in cal.raw["links"]["loopback_box"]["source"]
    stock_role = "fit" if link_fit else "validation"
    for mode, key, role in (
        ("pp", "stock_pp2_tok_s", stock_role),
        ("sp", "sp2_tok_s", "validation"),
    ):
        for b, runs in box[key].items():
            thr, _, long_run = simulate_decode_benchmark(
                Deployment(mode, 2), m, b, acc, input_len=box["input_len"]
            )
            meas = statistics.mean(runs)
            spread = (max(runs) - min(runs)) / meas if len(runs) > 1 else None
            pts.append(
                _point(
                    "box",
                    f"old loop: {'spexis_sp2_theta0.76' if mode == 'sp' else 'sglang_pp2'}",
                    b,
                    meas,
                    thr,
                    role,
                    runs=runs,
                    run_spread=round(spread, 4) if spread is not None else None,
                    sim_iteration_ms=round(long_run.iteration_s * 1e3, 3),
                    sim_stage_gpu_ms=[round(x, 3) for x in long_run.stage_gpu_ms],
                    sim_stage_utilisation=[round(x, 3) for x in long_run.stage_utilisation],
                )
            )
            if mode == "sp" and b in box["sp2_phase_ms"]:
                # the timers average steady decode iterations: compare a steady-state run
                st = simulate(
                    Deployment("sp", 2),
                    m,
                    DecodeWorkload(b, box["input_len"], iterations=200, warmup=50),
                    acc,
                )
                phases.append(
                    {
                        "batch": b,
                        "measured_ms": box["sp2_phase_ms"][b],
                        "simulated_ms": {
                            "iteration": round(st.iteration_s * 1e3, 3),
                            **{k: round(v, 3) for k, v in st.phases_ms["stage0"].items()},
                        },
                        "simulated_stage_gpu_ms": [round(x, 3) for x in st.stage_gpu_ms],
                        "simulated_stage1_ms": {
                            k: round(v, 3) for k, v in st.phases_ms["stage1"].items()
                        },
                    }
                )
    return pts, phases


def _box_files(files: list) -> list:
    out = []
    for f in files:
        d = json.loads((ROOT / f).read_text())
        out.append((f, d["started"][:10], d))
    return out


def _kv_bound(d: dict, batch: int, input_len: int) -> bool:
    """The point's requests need more KV than the run's budget (SGLang then runs fewer of them
    at once and retracts some, which the simulator's decode benchmark does not model)."""
    budget = (d.get("kv_budget") or {}).get("max_total_tokens")
    return bool(budget) and batch * (input_len + d["output_len"]) > budget


def _box_role(d: dict, f: str, batch: int, input_len: int, sp: bool) -> str:
    """``kv_bound`` over the run's KV budget, else ``fit`` for SP2 in the file the overlapped
    loop's host costs come from, else ``validation``."""
    if _kv_bound(d, batch, input_len):
        return "kv_bound"
    return "fit" if sp and f == OVERLAP_FIT_FILE else "validation"


def box_new_loop(cal) -> tuple[list, list]:
    """The box with the overlapped SP loop, Llama-3.1-8B shape: every SP2 alpha-0 and stock
    PP2 point (validation but SP2 in the file its host costs were fit on)."""
    return _box_runs(cal, "box_new_loop", M.COMMITTED["box_new_loop"], "llama-3.1-8b", LLAMA)


def box_qwen3_32b(cal) -> tuple[list, list]:
    """The box with the overlapped SP loop, Qwen3-32B shape: a model no part of the calibration
    saw (its stage-time correction comes from the 8B-shaped stages); every point validation
    but those whose requests exceed the KV budget (``kv_bound``)."""
    return _box_runs(cal, "box_qwen3_32b", M.COMMITTED["box_qwen3_32b"], "qwen3-32b", QWEN32)


def box_ipc(cal) -> tuple[list, list]:
    """The box with its stages linked through CUDA IPC (stock PP and SP alike), Llama-3.1-8B
    shape: a link no part of the calibration was fit on but its probe; every point
    validation."""
    return _box_runs(cal, "box_ipc", M.COMMITTED["box_ipc"], "llama-3.1-8b", LLAMA, link="ipc_box")


def box_h100(cal) -> tuple[list, list]:
    """The box on an H100 over the IPC link: stock PP2 both ways, and SP2 ``auto`` points
    whose alpha stayed 0 (as SP2 at alpha 0; their probes are not simulated)."""
    return _box_runs(
        cal,
        "box_h100",
        M.COMMITTED["box_h100"],
        "llama-3.1-8b",
        LLAMA,
        link="ipc_box",
        system="h100_sxm",
        auto_at_zero=True,
    )


def _auto_stayed_at_zero(point: dict) -> bool:
    """An ``auto`` point whose alpha was 0 from its first iteration to its last."""
    long = (point.get("sp") or {}).get("long") or {}
    return long.get("alpha_changes") == 0 and long.get("alpha_end") == 0.0


def _box_runs(
    cal,
    section: str,
    files: list,
    model: str,
    config_dir: Path,
    link: str = "loopback_box",
    system: str = "h200_sxm",
    auto_at_zero: bool = False,
) -> tuple[list, list]:
    """SP2 alpha-0 and stock PP2 points of the box runs in ``files`` beside the simulator.

    SP2 runs the overlapped loop (``LOOPS['overlap']``, host ``graphs_overlap``); stock PP2
    runs SGLang's loop (``graphs_serial``), at the point's micro-batch cap (SGLang's
    max_running / 2, or balanced B / 2: ``max_running`` = 2 x the cap) and async depth.
    ``link``: the calibrated link between the stages; ``system``: the GPU the box splits;
    ``auto_at_zero``: SP2 ``auto`` points whose alpha stayed 0 count as SP2 at alpha 0.
    """
    kw = dict(link=link, sharing="mps_box", calibration=cal)
    m_sp = machine_for(config_dir, system, tp=1, loop="overlap", **kw)
    m_pp = machine_for(config_dir, system, tp=1, loop="serial", **kw)
    memo: dict = {}

    def sim(key):
        if key not in memo:
            mode, theta, b, il, cap, depth = key
            if mode == "sp":
                memo[key] = simulate_decode_benchmark(
                    Deployment("sp", 2),
                    m_sp,
                    b,
                    AcceptanceModel(theta),
                    LOOPS["overlap"],
                    input_len=il,
                )
            else:
                memo[key] = simulate_decode_benchmark(
                    Deployment("pp", 2),
                    m_pp,
                    b,
                    None,
                    LoopSpec(async_depth=depth),
                    input_len=il,
                    max_running=2 * cap,
                )
        return memo[key]

    pts, phases = [], []
    steady: dict = {}
    for f, day, d in _box_files(files):
        for x in d["models"][model]["results"]:
            cfg, kind = x["config"], x["kind"]
            if x.get("status") != "run" or kind not in ("pp", "sp"):
                continue
            auto = "alphaauto" in cfg
            if auto and not auto_at_zero:
                continue
            for bt in x["batches"]:
                b, il = bt["batch"], bt.get("input_len", d["input_len"])
                if auto and not _auto_stayed_at_zero(bt):
                    continue
                if kind == "sp":
                    key = ("sp", x["theta_forced"], b, il, None, 0)
                    label = cfg + (" (alpha stayed 0)" if auto else "")
                else:
                    cap = int(bt.get("pp_max_micro_batch_size") or 256)
                    depth = 1 if "async1" in cfg else 0
                    key = ("pp", None, b, il, cap, depth)
                    label = f"sglang_pp2 (micro-batch cap {cap}" + (", depth 1)" if depth else ")")
                thr, _, lr = sim(key)
                role = _box_role(d, f, b, il, sp=kind == "sp")
                pts.append(
                    _point(
                        section,
                        f"{SECTION_LABEL.get(section, model)}, {day}: {label}",
                        b,
                        bt["decode_tok_s"],
                        thr,
                        role,
                        input_len=il,
                        file=f,
                        date=day,
                        kind=kind,
                        theta=x.get("theta_forced"),
                        sim_stage_utilisation=[round(u, 3) for u in lr.stage_utilisation],
                    )
                )
        for c in d.get("comparison", []):
            if "alphaauto" in c["config"] or c.get("model", model) != model:
                continue
            theta = float(c["config"].rsplit("theta", 1)[1])
            key = (theta, c["batch"], c["input_len"])
            if key not in steady:  # the timers average steady decode iterations
                st = simulate(
                    Deployment("sp", 2),
                    m_sp,
                    DecodeWorkload(c["batch"], c["input_len"], iterations=200, warmup=50),
                    AcceptanceModel(theta),
                    LOOPS["overlap"],
                )
                steady[key] = st
            st = steady[key]
            phases.append(
                {
                    "date": day,
                    "file": f,
                    "theta": theta,
                    "input_len": c["input_len"],
                    "batch": c["batch"],
                    "measured_iteration_ms": c["stage0_iter_ms"],
                    "measured_stage0_gpu_ms": c["stage0_gpu_ms"],
                    "measured_iter_over_gpu": c["iter_over_gpu"],
                    "measured_phase_ms": c["phase_ms"],
                    "simulated_iteration_ms": round(st.iteration_s * 1e3, 3),
                    "simulated_stage0_gpu_ms": round(st.stage_gpu_ms[0], 3),
                    "simulated_stage1_gpu_ms": round(st.stage_gpu_ms[1], 3),
                    "simulated_iter_over_gpu": round(st.iteration_s * 1e3 / st.stage_gpu_ms[0], 3),
                    "simulated_phase_ms": {
                        k: round(v, 3) for k, v in st.phases_ms["stage0"].items()
                    },
                    "gpu_error": round(st.stage_gpu_ms[0] / c["stage0_gpu_ms"] - 1, 4),
                    "iteration_error": round(st.iteration_s * 1e3 / c["stage0_iter_ms"] - 1, 4),
                    "role": _box_role(d, f, c["batch"], c["input_len"], sp=True),
                }
            )
    return pts, phases


def box_new_loop_means(points: list) -> list:
    """Each configuration of the new-loop box runs at its mean over the runs that made it
    (the box's run-to-run spread for one configuration is up to 20 %)."""
    by: dict = {}
    for p in points:
        if p["section"] != "box_new_loop":
            continue
        cfg = p["config"].split(": ", 1)[1]
        by.setdefault((cfg, p["input_len"], p["batch"]), []).append(p)
    out = []
    for (cfg, il, b), ps in sorted(by.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][2])):
        meas = [q["measured_tok_s"] for q in ps]
        mean = statistics.mean(meas)
        sim = ps[0]["simulated_tok_s"]
        out.append(
            {
                "config": cfg,
                "input_len": il,
                "batch": b,
                "runs": len(ps),
                "dates": sorted({q["date"] for q in ps}),
                "measured_tok_s": [q["measured_tok_s"] for q in ps],
                "measured_mean_tok_s": round(mean, 1),
                "run_spread": round((max(meas) - min(meas)) / mean, 4),
                "simulated_tok_s": sim,
                "error": round(sim / mean - 1, 4),
                "errors_per_run": [q["error"] for q in ps],
                "roles": sorted({q["role"] for q in ps}),
            }
        )
    return out


def gemm_ratio(cal) -> list:
    """Ideal SP2/PP2 = 2/(2-Theta) * T(B/2)/T(B) for a GEMM-only stage, both clients busy."""
    costs = stage_costs_for(LLAMA, "h200_sxm", 1)
    sh = cal.sharing["mps_box"]
    corr = cal.system("h200_sxm").correction
    plan = StagePlan(16, ())
    theta = M.BOX_2026_12_02["theta"]

    def t(rows: float) -> float:
        g = costs.decode["gemm"](rows, 1) * plan.layers + costs.decode["lm_head"](rows, 1)
        mf = (
            costs.decode["gemm"].mem_frac_at(rows) * plan.layers * costs.decode["gemm"](rows, 1)
            + costs.decode["lm_head"].mem_frac_at(rows) * costs.decode["lm_head"](rows, 1)
        ) / g
        f = corr(rows, 1) if corr is not None else 1.0
        return g * f * sh.shared(mf)

    out = []
    for b, meas in M.BOX_2026_12_02["gemm_only_ideal_sp2_over_pp2"].items():
        ratio = 2.0 / (2.0 - theta) * t(b / 2) / t(b)
        out.append(
            {
                "section": "box_gemm_ratio",
                "batch": b,
                "measured_ratio": meas,
                "aic_ratio": round(ratio, 4),
                "error": round(ratio / meas - 1, 4),
                "role": "validation",
            }
        )
    return out


# ---------------------------------------------------------------------------------------
def _runs(files: list) -> list:
    res = []
    for f in files:
        d = json.loads((ROOT / f).read_text())
        for mname, m in d["models"].items():
            for x in m["results"]:
                res.append((mname, x))
    return res


def _eager_host(serial: HostCosts, sp_phase_ms: dict, per_layer_s: float, ar_s: float) -> HostCosts:
    """Graphs off: SP's phases as its stage 0 timed them at this point; every stage launches
    its layers at the rate stage 0 did (its launch phase / its 16 or 18 layers); stock PP and
    PP=1 pay the same eager schedule / process / send as SP at this batch (no stock timers
    exist for graphs off); TP adds ``ar_s`` of host time per layer for its two all-reduces."""
    sp = {
        p: HostPhase(fixed=sp_phase_ms[p] * MS)
        for p in ("schedule", "draft_sync", "process", "send")
    }
    sp["launch"] = HostPhase(per_layer=per_layer_s)
    sp["recv_output"] = serial.phases["sp"]["recv_output"]
    pp = {p: HostPhase(fixed=sp_phase_ms[p] * MS) for p in ("schedule", "process", "send")}
    pp["launch"] = HostPhase(per_layer=per_layer_s)
    pp["recv_output"] = serial.phases["pp"]["recv_output"]
    tp = {p: HostPhase(fixed=sp_phase_ms[p] * MS) for p in ("schedule", "process")}
    tp["launch"] = HostPhase(per_layer=per_layer_s + ar_s)
    return HostCosts({"sp": sp, "pp": pp, "tp": tp}, source="graphs off, per point")


def graphs_off(cal) -> list:
    """Runs 3 and 4: real 2 x H200, graphs off, custom all-reduce off (NCCL)."""
    out = []
    serial = cal.host_for("serial")
    for run, files, cfg in (
        ("run4", M.COMMITTED["run4_llama"], LLAMA),
        ("run3", M.COMMITTED["run3_qwen"], QWEN),
    ):
        shape = load_model_shape(str(cfg))
        results = _runs(files)
        sp_runs = [x for _, x in results if x["kind"] == "sp"]
        # eager launch per decoder layer: stage 0's SP launch phase over its layers (the
        # draft head's few kernels ride along; the last stage's LM head likewise)
        half = shape.num_layers // 2
        per_layer_at = {
            bb: statistics.median(
                b["sp"]["phase_ms_per_iteration"]["launch"] / half
                for x in sp_runs
                for b in x["batches"]
                if b["batch"] == bb
            )
            * MS
            for bb in (b["batch"] for b in sp_runs[0]["batches"])
        }
        sp_phase = {
            x["config"]: {b["batch"]: b["sp"]["phase_ms_per_iteration"] for b in x["batches"]}
            for x in sp_runs
        }
        median_phase = {
            bb: {
                p: statistics.median(sp_phase[c][bb][p] for c in sp_phase)
                for p in ("schedule", "draft_sync", "launch", "process", "send")
            }
            for bb in next(iter(sp_phase.values()))
        }
        # per-all-reduce host cost under eager TP2: fit on TP2 at its smallest batch
        tp2 = next(x for _, x in results if x["config"] == "sglang_tp2")
        b0 = tp2["batches"][0]
        ar_s = _fit_eager(
            shape, 2, b0["batch"], b0["decode_tok_s"], serial, median_phase, per_layer_at, cal
        )
        pp1 = next(x for _, x in results if x["config"] == "sglang_pp1")
        p0 = pp1["batches"][0]
        pp1_layer = _fit_eager(
            shape, 1, p0["batch"], p0["decode_tok_s"], serial, median_phase, per_layer_at, cal
        )
        for _, x in results:
            kind, cfgname = x["kind"], x["config"]
            for b in x["batches"]:
                bb = b["batch"]
                phases = sp_phase.get(cfgname, {}).get(bb, median_phase[bb])
                if kind == "sp":
                    per_layer = phases["launch"] * MS / half
                elif kind == "pp1":
                    per_layer = pp1_layer
                else:
                    per_layer = per_layer_at[bb]
                host = _eager_host(serial, phases, per_layer, ar_s if kind == "tp" else 0.0)
                if kind == "sp":
                    dep, tp = Deployment("sp", 2), 1
                    acc = AcceptanceModel(x["theta_forced"])
                elif kind == "pp":
                    dep, tp = Deployment("pp", 2), 1
                    acc = None
                elif kind == "pp1":
                    dep, tp = Deployment("tp", 1, 1), 1
                    acc = None
                elif kind == "tp":
                    dep, tp = Deployment("tp", 1, 2), 2
                    acc = None
                else:
                    continue
                costs = stage_costs_for(shape, "h200_sxm", tp)
                corr = cal.system("h200_sxm").correction
                m = Machine(costs.with_correction(corr), host, _nvlink(), None, name="2xH200 eager")
                loop = LoopSpec(graphs=False, async_depth=1 if "async1" in cfgname else 0)
                thr, _, lr = simulate_decode_benchmark(dep, m, bb, acc, loop)
                fitted = (cfgname == "sglang_tp2" and bb == b0["batch"]) or (
                    cfgname == "sglang_pp1" and bb == p0["batch"]
                )
                role = "fit" if fitted else "validation"
                out.append(
                    _point(
                        "real_2xh200_graphs_off",
                        f"{run}:{cfgname}",
                        bb,
                        b["decode_tok_s"],
                        thr,
                        role,
                        model=shape.name,
                        sim_iteration_ms=round(lr.iteration_s * 1e3, 3),
                        eager_launch_ms_per_layer=round(per_layer * 1e3, 4),
                        tp_allreduce_host_ms_per_layer=(
                            round(ar_s * 1e3, 4) if kind == "tp" else None
                        ),
                    )
                )
    return out


def _nvlink():
    from spexis_sglang.planning.machines import bridge_for

    return bridge_for("h200_sxm").link()


def _fit_eager(shape, tp, batch, meas, serial, median_phase, per_layer_at, cal) -> float:
    """One host cost of eager PP=1 / TP2, fit on its smallest batch (bisection).

    TP2: host time per layer of its two NCCL all-reduces (custom all-reduce was off);
    PP=1: its own launch time per layer (the PP ranks' rate does not carry over).
    """
    costs = stage_costs_for(shape, "h200_sxm", tp).with_correction(
        cal.system("h200_sxm").correction
    )
    lo, hi = (0.0, 3e-3) if tp > 1 else (0.05e-3, 3e-3)
    for _ in range(22):
        mid = (lo + hi) / 2
        if tp > 1:
            host = _eager_host(serial, median_phase[batch], per_layer_at[batch], mid)
        else:
            host = _eager_host(serial, median_phase[batch], mid, 0.0)
        m = Machine(costs, host, _nvlink(), None)
        thr, _, _ = simulate_decode_benchmark(
            Deployment("tp", 1, tp), m, batch, loop=LoopSpec(graphs=False)
        )
        if thr > meas:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


# ---------------------------------------------------------------------------------------
def aic_vs_sim(cal) -> list:
    out = []
    model = "meta-llama/Meta-Llama-3.1-8B"
    for mode, gpus in (("pp", 2), ("tp", 2), ("tp", 1)):
        tp = gpus if mode == "tp" else 1
        m = machine_for(LLAMA, "h200_sxm", tp=tp, calibration=cal)
        dep = Deployment("pp", 2) if mode == "pp" else Deployment("tp", 1, tp)
        for b in (16, 64, 256, 512):
            aic = aic_static_prediction(model, "h200_sxm", mode, gpus, b)
            thr, _, lr = simulate_decode_benchmark(dep, m, b)
            out.append(
                {
                    "section": "aic_vs_sim",
                    "config": f"{'PP2' if mode == 'pp' else f'TP{gpus}'} H200 NVLink, graphs on",
                    "batch": b,
                    "aic_tok_s": round(aic["tok_s"], 1),
                    "aic_batch_argument": aic["aic_batch_arg"],
                    "simulated_tok_s": round(thr, 1),
                    "sim_over_aic": round(thr / aic["tok_s"], 4),
                    "sim_stage_utilisation": [round(u, 3) for u in lr.stage_utilisation],
                }
            )
    return out


# ---------------------------------------------------------------------------------------
def plot(points: list, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(18, 6), gridspec_kw={"width_ratios": [1, 2]})
    ax = axes[0]
    colors = {
        "h200_pp1": "tab:blue",
        "h100_pp1": "tab:cyan",
        "box": "tab:orange",
        "box_new_loop": "tab:green",
        "box_qwen3_32b": "tab:purple",
        "box_ipc": "tab:red",
        "box_h100": "tab:olive",
        "real_2xh200_graphs_off": "tab:gray",
    }
    for sec, c in colors.items():
        roles = (("validation", "o"), ("fit", "x"), ("kv_bound", "^"), ("short_of_batch", "v"))
        for role, mk in roles:
            p = [q for q in points if q["section"] == sec and q["role"] == role]
            if not p:
                continue
            ax.scatter(
                [q["measured_tok_s"] for q in p],
                [q["simulated_tok_s"] for q in p],
                c=c,
                marker=mk,
                label=f"{sec} ({role})",
                s=28,
            )
    lo, hi = 200, 40000
    ax.plot([lo, hi], [lo, hi], "k-", lw=0.8)
    ax.fill_between([lo, hi], [lo * 0.9, hi * 0.9], [lo * 1.1, hi * 1.1], color="k", alpha=0.08)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("measured decode tok/s")
    ax.set_ylabel("simulated decode tok/s")
    ax.set_title("Simulator vs measurement (band: +-10 %)")
    ax.legend(fontsize=7)
    ax = axes[1]
    # the bars: every PP=1 and old-loop point, and the SP points of the new loop's sections
    # (in their scatter colour; the others green)
    sp_sections = ("box_new_loop", "box_qwen3_32b", "box_ipc", "box_h100")
    p = [
        q
        for q in points
        if q["section"] in ("h200_pp1", "box")
        or (q["section"] == "h100_pp1" and q["role"] == "validation")
        or (q["section"] in sp_sections and q["kind"] == "sp" and q["role"] != "kv_bound")
    ]
    labels = [
        f"{q['config'].replace('spexis_', '').replace('sglang_', '').replace('new loop, ', '')}"
        f"{' in ' + str(q['input_len']) if q.get('input_len', 128) != 128 else ''}\nB={q['batch']}"
        for q in p
    ]
    errs = [100 * q["error"] for q in p]
    cols = [
        (
            "tab:gray"
            if q["role"] == "fit"
            else colors[q["section"]] if q["section"] in sp_sections else "tab:green"
        )
        for q in p
    ]
    ax.bar(range(len(p)), errs, color=cols)
    ax.axhline(10, color="r", lw=0.8, ls="--")
    ax.axhline(-10, color="r", lw=0.8, ls="--")
    ax.set_xticks(range(len(p)))
    ax.set_xticklabels(labels, fontsize=5, rotation=90)
    ax.set_ylabel("error, %")
    ax.set_title(
        "Graphs on: H200 PP=1, the box's old loop, SP2 with the new loop (purple: Qwen3-32B; "
        "red: the same-GPU IPC link; olive: the box on an H100; grey: fit)",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _section_summary(name: str, pts: list) -> dict:
    """Validation points of a section by kind: how many, how many within the target, the
    largest error."""
    out: dict = {}
    for kind, label in (("sp", "sp2"), ("pp", "stock_pp2")):
        v = [p for p in pts if p["role"] == "validation" and p["kind"] == kind]
        out[f"{name}_{label}_points"] = len(v)
        out[f"{name}_{label}_within_target"] = sum(abs(p["error"]) <= TARGET for p in v)
        out[f"{name}_{label}_max_abs_error"] = round(max(abs(p["error"]) for p in v), 4)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=ROOT / "benchmark/results/sim_validation.json")
    ap.add_argument("--no-update-calibration", action="store_true")
    ap.add_argument("--skip-graphs-off", action="store_true")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    for name in ("aiconfigurator_core", "aiconfigurator"):
        logging.getLogger(name).setLevel(logging.ERROR)
    t0 = time.time()
    cal = load_calibration()
    points = h200_pp1(cal)
    h100 = h100_pp1(cal)
    points += h100
    bp, phases = box(cal)
    points += bp
    np_, new_phases = box_new_loop(cal)
    points += np_
    means = box_new_loop_means(points)
    q32, q32_phases = box_qwen3_32b(cal)
    points += q32
    ipc, ipc_phases = box_ipc(cal)
    points += ipc
    h100_box, _ = box_h100(cal)
    points += h100_box
    logger.info("graphs-on sections done (%.0f s)", time.time() - t0)
    ratios = gemm_ratio(cal)
    if not args.skip_graphs_off:
        points += graphs_off(cal)
        logger.info("graphs-off section done (%.0f s)", time.time() - t0)
    versus = aic_vs_sim(cal)
    on = [
        p
        for p in points
        if p["section"] in ("h200_pp1", "box", "box_new_loop") and p["role"] == "validation"
    ]
    new = [p for p in points if p["section"] == "box_new_loop" and p["role"] == "validation"]
    new_sp = [p for p in new if p["kind"] == "sp"]
    new_pp = [p for p in new if p["kind"] == "pp"]
    # the error bar: configurations the predictions run (PP=1, stock PP at depth 0, SP), a
    # configuration the box ran more than once at its mean over the runs
    bar_pts = [abs(p["error"]) for p in on if p["section"] != "box_new_loop"] + [
        abs(m["error"]) for m in means if "depth 1" not in m["config"]
    ]
    off = [
        p for p in points if p["section"] == "real_2xh200_graphs_off" and p["role"] == "validation"
    ]
    summary = {
        "graphs_on_validation_points": len(on),
        "graphs_on_max_abs_error": round(max(abs(p["error"]) for p in on), 4),
        "graphs_on_mean_abs_error": round(statistics.mean(abs(p["error"]) for p in on), 4),
        "graphs_on_within_target": sum(abs(p["error"]) <= TARGET for p in on),
        "gemm_ratio_max_abs_error": round(max(abs(r["error"]) for r in ratios), 4),
        "target": TARGET,
        "old_loop_box_validation_points": sum(
            1 for p in on if p["section"] == "box" and p["config"].startswith("old loop: spexis")
        ),
        "new_loop_sp2_validation_points": len(new_sp),
        "new_loop_sp2_within_target": sum(abs(p["error"]) <= TARGET for p in new_sp),
        "new_loop_sp2_max_abs_error": round(max(abs(p["error"]) for p in new_sp), 4),
        "new_loop_sp2_mean_abs_error": round(statistics.mean(abs(p["error"]) for p in new_sp), 4),
        "new_loop_stock_pp2_points": len(new_pp),
        "new_loop_stock_pp2_within_target": sum(abs(p["error"]) <= TARGET for p in new_pp),
        "new_loop_stock_pp2_max_abs_error": round(max(abs(p["error"]) for p in new_pp), 4),
        "new_loop_means_within_target": sum(abs(m["error"]) <= TARGET for m in means),
        "new_loop_means": len(means),
        "error_bar_basis_max_abs_error": round(max(bar_pts), 4),
        # another model than the predictions': reported, not in the error bar
        **_section_summary("qwen3_32b", q32),
        "qwen3_32b_kv_bound_points": sum(p["role"] == "kv_bound" for p in q32),
        # another link than the predictions' (and than the fits'): reported, not in the bar
        **_section_summary("ipc", ipc),
        # another GPU than the error bar's (H100: the H200's correction, borrowed)
        "h100_pp1_points": sum(p["role"] == "validation" for p in h100),
        "h100_pp1_within_target": sum(
            abs(p["error"]) <= TARGET for p in h100 if p["role"] == "validation"
        ),
        "h100_pp1_errors": [p["error"] for p in h100 if p["role"] == "validation"],
        "h100_pp1_short_of_batch_points": sum(p["role"] == "short_of_batch" for p in h100),
        # the box on an H100: another GPU (the H200's correction and MPS sharing, borrowed)
        **_section_summary("h100_box", h100_box),
    }
    if off:
        summary.update(
            graphs_off_points=len(off),
            graphs_off_median_abs_error=round(statistics.median(abs(p["error"]) for p in off), 4),
            graphs_off_within_target=sum(abs(p["error"]) <= TARGET for p in off),
        )
    # the error bar of an H200 prediction: the largest graphs-on validation error, rounded up,
    # over the configurations the predictions run (repeated box configurations at their mean)
    bar = math.ceil(summary["error_bar_basis_max_abs_error"] * 100) / 100
    summary["h200_error_bar"] = bar
    result = {
        "about": __doc__.split("\n\n")[0].strip(),
        "command": "python benchmark/sim/validate.py",
        "calibration": {
            "h200_correction": cal.system("h200_sxm").source,
            "loopback_link": cal.raw["links"]["loopback_box"],
            "ipc_link": cal.raw["links"].get("ipc_box"),
            "mps_sharing": cal.raw["sharing"]["mps_box"],
            "host_graphs_serial": cal.raw["host"]["graphs_serial"]["source"],
            "host_graphs_overlap": cal.raw["host"]["graphs_overlap"]["source"],
        },
        "measurements": {
            "box": M.BOX_2026_12_02,
            "box_new_loop": M.COMMITTED["box_new_loop"],
            "box_qwen3_32b": M.COMMITTED["box_qwen3_32b"],
            "box_ipc": M.COMMITTED["box_ipc"],
            "h100_pp1": M.COMMITTED["h100_pp1"],
            "box_h100": M.COMMITTED["box_h100"],
            "mps_probe": M.MPS_PROBE_2026_12_02,
            "h200_pp1": M.H200_PP1_GRAPHS_2026_12_01,
            "aic_cli_pp1": M.AIC_CLI_PP1,
            "committed": {k: M.COMMITTED[k] for k in ("run4_llama", "run3_qwen", "loop_overhead")},
        },
        "summary": summary,
        "points": points,
        "box_sp2_phases": phases,
        "box_new_loop_means": means,
        "box_new_loop_sp2_stage0": new_phases,
        "box_qwen3_32b_sp2_stage0": q32_phases,
        "box_ipc_sp2_stage0": ipc_phases,
        "box_gemm_ratio": ratios,
        "aic_vs_sim": versus,
        "elapsed_s": round(time.time() - t0, 1),
    }
    args.out.write_text(json.dumps(result, indent=1, default=str) + "\n")
    plot(points, args.out.with_suffix(".png"))
    logger.info("wrote %s (+ .png); summary %s", args.out.relative_to(ROOT), summary)
    if not args.no_update_calibration:
        data = json.loads(CALIBRATION_PATH.read_text())
        data["systems"]["h200_sxm"]["error_bar"] = bar
        data["systems"]["h200_sxm"]["error_bar_source"] = (
            "largest |error| of the graphs-on validation points in "
            "benchmark/results/sim_validation.json (PP=1, stock PP at async depth 0, SP; a "
            "configuration the emulated box ran more than once at its mean over the runs)"
        )
        CALIBRATION_PATH.write_text(json.dumps(data, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
