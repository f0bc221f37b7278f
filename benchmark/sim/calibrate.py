"""Write ``python/spexis_sglang/planning/data/calibration.json`` from committed measurements.

Also ``benchmark/results/sim_calibration.json``: AIConfigurator's estimates beside our H200
measurements (the calibration's error table).

    python benchmark/sim/calibrate.py                 # from the repository's measurements
    python benchmark/sim/calibrate.py --stage-times benchmark/results/gpu/stage_times_h200.json

What it fits, and on what (every entry of the output names its source):

* H200 correction of AIConfigurator's stage times. With per-stage GPU measurements
  (``benchmark/gpu/stage_times.sh``): measured / AIConfigurator per (batch, KV length).
  Without: one factor, fit on stock PP=1 at B=64 on one H200 (graphs on); B=16 and 256 stay
  for validation.
* Host time per loop phase with CUDA graphs (``graphs_serial``): SP from stage 0's phase
  timers on the emulated box (8B model); stock PP (and PP=1) from the tiny-model loop runs
  (stock PP2's over the same-GPU IPC link, where no phase waits for the device).
  ``graphs_overlap``: the overlapped SP loop, from its stage-0 phase timers on the box
  (``OVERLAP_FIT_FILE``, 2026-12-03; the later box runs with that loop stay out of the fit).
* The box: MPS slowdowns from the MPS probe; the loopback link's bandwidth from the
  stage-times run's p2p probe if there is one, else fit on stock PP2's four points (SP2 is
  left out of the fit: it is what the validation predicts).
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "python"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import measurements as M  # noqa: E402

from spexis_sglang.core.pipeline_sim import Deployment, simulate_decode_benchmark  # noqa: E402
from spexis_sglang.core.stage_costs import (  # noqa: E402
    CostGrid,
    HostCosts,
    HostPhase,
    StagePlan,
)
from spexis_sglang.planning.presets import CALIBRATION_PATH, parse_calibration  # noqa: E402

logger = logging.getLogger("calibrate")
MS = 1e-3
RECV_OUTPUT_S = 0.1 * MS  # receiving an output message (metadata + NCCL recv post): assumed
LOOPBACK_LATENCY_S = 100e-6  # NCCL socket transport on one host: assumed
META_LATENCY_S = 50e-6  # the gloo metadata message before each tensor dict: assumed


def _rel(p: Path) -> str:
    return str(Path(p).resolve().relative_to(ROOT))


def stock_host_points(files) -> dict:
    """Stage 0's stock-PP phases (thread CPU ms) by micro-batch rows, mean of the runs of
    ``files`` (tiny-model loop runs: ``sp_loop_overhead.py``'s records)."""
    acc: dict = {}
    for f in files:
        d = json.loads((ROOT / f).read_text())
        for rec in d["records"]:
            if rec["loop"] != "stock":
                continue
            rows = rec["rows_per_iteration"]
            for ph, v in rec["cpu_ms_per_iteration"].items():
                acc.setdefault(ph, {}).setdefault(rows, []).append(v)
    return {ph: sorted((r, statistics.mean(v)) for r, v in by.items()) for ph, by in acc.items()}


def host_graphs_serial() -> dict:
    box = M.BOX_2026_12_02["sp2_phase_ms"]
    sp = {}
    for ph in ("schedule", "draft_sync", "launch", "process", "send"):
        pts = [(b, box[b][ph] * MS) for b in sorted(box) if ph in box[b]]
        sp[ph] = HostPhase.table(pts)
    sp["recv_output"] = HostPhase(fixed=RECV_OUTPUT_S)
    tiny = stock_host_points(M.COMMITTED["loop_overhead"])
    ipc = stock_host_points([M.COMMITTED["loop_overhead_ipc"]])
    # stock PP: its loop's host work per micro-batch, measured where the GPU's time is
    # negligible (a tiny model), so no phase holds a wait for the device (its phase timers on
    # the box hold such waits and made it up to 20 % slow over the IPC link); a line by rows
    # through the two micro-batch sizes measured, so a larger one costs more
    pp = {
        ph: HostPhase.fit([(r, v * MS) for r, v in ipc[ph]])
        for ph in ("schedule", "launch", "process", "send")
    }
    pp["recv_output"] = HostPhase(fixed=RECV_OUTPUT_S)
    # PP=1 (one GPU, no box run of it): the tiny model's loop, as validated on one H200
    tp = {ph: HostPhase.table([(r, v * MS) for r, v in tiny[ph]]) for ph in ("schedule", "launch")}
    # result processing grows with the rows; a line extrapolates to small micro-batches
    tp["process"] = HostPhase.fit([(r, v * MS) for r, v in tiny["process"]])
    src = (
        "SP: stage 0's phase timers on the emulated two-GPU box (2026-12-02, 8B-shaped, "
        "graphs on); stock PP: stage 0's thread CPU per phase of stock PP2, tiny model, graphs "
        f"on, same-GPU CUDA IPC link, an H100 machine's host ({M.COMMITTED['loop_overhead_ipc']}; "
        "per micro-batch by its rows, 32 and 128); PP=1: stage 0's thread CPU per phase, tiny "
        "model, graphs on, "
        f"{', '.join(M.COMMITTED['loop_overhead'])}; receiving an output message "
        f"{RECV_OUTPUT_S / MS} ms (assumed)"
    )
    return HostCosts({"sp": sp, "pp": pp, "tp": tp}, source=src).to_json()


def _probe_line(one_way: dict) -> tuple:
    """A link's latency + bytes / bandwidth, least squares over a probe mode's one-way times
    (``{bytes: seconds}``) from 128 KB up (the sizes of decode proxies and outputs): the
    intercept, the slope, and the times fitted."""
    pts = [(int(k), v) for k, v in one_way.items() if k.isdigit() and int(k) >= 128 << 10]
    t = np.array([p[1] for p in pts])
    slope, icpt = np.polyfit(np.array([p[0] for p in pts], dtype=float), t, 1)
    return float(icpt), float(slope), t


def loopback_from_probe(path: str = M.COMMITTED["box_transport_probe"]) -> dict:
    """The box's NCCL-over-loopback link (:func:`_probe_line`; latency at least the smallest
    message's)."""
    nccl = json.loads((ROOT / path).read_text())["one_way_s"]["nccl"]
    icpt, slope, t = _probe_line(nccl)
    small = min(v for k, v in nccl.items() if int(k) <= 1024)
    return {
        "latency_s": float(max(icpt, small)),
        "bandwidth_Bps": 1.0 / slope,
        "source": (
            f"NCCL send/recv over loopback sockets between the box's two MPS clients, measured: "
            f"{path} (one way, {len(t)} sizes from 128 KB to 16 MB, a line; latency at least "
            "the smallest message's)"
        ),
    }


def ipc_from_probe(path: str = M.COMMITTED["box_transport_probe_with_ipc"]) -> dict:
    """The box's same-GPU CUDA IPC link (``srt/stage_link.py``; :func:`_probe_line`, latency
    at least the fastest fitted message's). Its layout travels in the message over a local
    pipe (no separate gloo metadata message: ``meta_latency_s`` 0)."""
    icpt, slope, t = _probe_line(json.loads((ROOT / path).read_text())["one_way_s"]["ipc"])
    return {
        "latency_s": float(max(icpt, t.min())),
        "bandwidth_Bps": 1.0 / slope if slope > 0 else float("inf"),
        "meta_latency_s": 0.0,
        "name": "same-GPU CUDA IPC link (emulated box)",
        "source": (
            f"the same-GPU CUDA IPC link between the box's two MPS clients, measured: {path} "
            f"(one way, {len(t)} sizes from 128 KB to 16 MB, a line; latency at least the "
            "fastest of them; its layout rides in the message)"
        ),
    }


#: the run whose stage-0 phase timers set the overlapped loop's host costs; the other box
#: runs with that loop (2026-12-03 14:24 and 2026-12-04) stay out of the fit
OVERLAP_FIT_FILE = "benchmark/results/gpu/box_decode_llama-3.1-8b.json"


def overlap_host_points(path: str = OVERLAP_FIT_FILE) -> dict:
    """Stage 0's host phases of the overlapped SP loop, ms per iteration by batch.

    The mean over Theta 0.76 and 0.6 at 128-token inputs (SP2, alpha 0). ``schedule``,
    ``draft_sync``, ``launch`` and ``send`` are host work; negative readings (the launch
    timer at B = 128, where the phases' boundaries cross) are left out. ``wait_output``
    (the outputs' metadata) is a wait, and ``process`` holds the wait for the device, so
    neither sets a host cost here; ``forced`` is the benchmark's forced acceptance.
    """
    d = json.loads((ROOT / path).read_text())
    acc: dict = {}
    for c in d["comparison"]:
        if "alphaauto" in c["config"] or c["input_len"] != d["input_len"]:
            continue
        for ph in ("schedule", "draft_sync", "launch", "send"):
            v = c["phase_ms"].get(ph)
            if v is not None and v > 0:
                acc.setdefault(ph, {}).setdefault(c["batch"], []).append(v)
    return {ph: sorted((b, statistics.mean(v)) for b, v in by.items()) for ph, by in acc.items()}


def host_graphs_overlap(serial: dict) -> dict:
    """The overlapped SP loop (stage 0's host work off the critical path): host time per phase
    from its phase timers on the emulated box (``OVERLAP_FIT_FILE``); verifying a batch
    (``process``) as the serial loop's measured processing; stock PP and PP=1 as
    ``graphs_serial`` (SGLang's own loop is unchanged)."""
    hc = HostCosts.from_json(serial)
    pts = overlap_host_points()
    sp = {ph: HostPhase.table([(b, v * MS) for b, v in pts[ph]]) for ph in pts}
    sp["process"] = hc.phases["sp"]["process"]
    sp["recv_output"] = HostPhase(fixed=RECV_OUTPUT_S)
    phases = dict(hc.phases)
    phases["sp"] = sp
    src = (
        f"SP: stage 0's phase timers of the overlapped SP loop on the emulated two-GPU box, "
        f"{OVERLAP_FIT_FILE} (2026-12-03, 8B-shaped, graphs on, alpha 0, mean of Theta 0.76 and "
        "0.6 at 128-token inputs): schedule, draft_sync, launch, send per batch; process (the "
        "host's verification, its timer holds the wait for the device) as graphs_serial's; "
        "stock PP and PP=1 as graphs_serial"
    )
    return HostCosts(phases, source=src).to_json()


def acceptance() -> dict:
    """The draft head's measured acceptance: by confidence decile, and per dataset category."""
    q = json.loads((ROOT / M.COMMITTED["quality"]).read_text())
    rp = q["draft"]["exit15"]["rank_profile"]
    a = json.loads((ROOT / M.COMMITTED["sp_acceptance"]).read_text())
    head = next(iter(a["per_head"].values()))
    cats = {k: v["acceptance"] for k, v in head.items() if isinstance(v, dict)}
    return {
        "rank_profile": [round(x, 4) for x in rp["acceptance"]],
        "rank_profile_source": (
            f"{M.COMMITTED['quality']}: draft exit 15 of the default model, acceptance by "
            f"confidence decile (most confident first), {rp['rows']} rows"
        ),
        "per_category": cats,
        "per_category_source": (
            f"{M.COMMITTED['sp_acceptance']}: in-server acceptance per SpecBench-like "
            "category, real weights, bf16, graphs on"
        ),
    }


def mps_sharing() -> dict:
    p = M.MPS_PROBE_2026_12_02
    w, a, b = p["whole_gpu"], p["one_client_alone"], p["two_clients_each"]
    return {
        "compute": [1.0, w["tflops"] / a["tflops"], w["tflops"] / b["tflops"]],
        "memory": [1.0, w["tbps"] / a["tbps"], w["tbps"] / b["tbps"]],
        "name": "one H200, two 50 % MPS clients",
        "source": p["provenance"],
    }


def _machine(cal_json: dict, system: str, link: str, sharing=None, loop="serial", tp=1):
    from spexis_sglang.planning.machines import machine_for

    cal = parse_calibration(cal_json)
    return machine_for(
        ROOT / M.BOX_2026_12_02["model_config"],
        system,
        tp=tp,
        loop=loop,
        link=link,
        sharing=sharing,
        calibration=cal,
    )


def fit_pp1_factor(cal_json: dict) -> float:
    """One factor so that simulated stock PP=1 at B=64 matches the H200 measurement."""
    meas = M.H200_PP1_GRAPHS_2026_12_01["tok_s"][64]
    f = 1.0
    for _ in range(3):
        cal_json["systems"]["h200_sxm"]["correction"] = CostGrid.constant(f).to_json()
        m = _machine(cal_json, "h200_sxm", "nvlink")
        thr, _, _ = simulate_decode_benchmark(Deployment("tp", 1, 1), m, 64)
        f *= thr / meas
    return f


def error_table_pp1(cal_json: dict, fit_b=64) -> list:
    """AIConfigurator's estimate and the calibrated simulator beside stock PP=1 on one H200.

    ``fit_b``: the batch the correction was fit on (None when per-stage timings set it)."""
    rows = []
    m = _machine(cal_json, "h200_sxm", "nvlink")
    for b, meas in M.H200_PP1_GRAPHS_2026_12_01["tok_s"].items():
        aic = M.AIC_CLI_PP1["tok_s"][b]
        thr, _, _ = simulate_decode_benchmark(Deployment("tp", 1, 1), m, b)
        rows.append(
            {
                "batch": b,
                "measured_tok_s": meas,
                "aic_cli_tok_s": aic,
                "aic_error": round(aic / meas - 1, 4),
                "calibrated_sim_tok_s": round(thr, 1),
                "calibrated_error": round(thr / meas - 1, 4),
                "role": "fit" if b == fit_b else "check",
            }
        )
    return rows


def fit_stage_times(path: Path, cal_json: dict, table: list) -> dict:
    """Correction grid = measured / AIConfigurator for the measured stages, by (batch, ctx)."""
    from spexis_sglang.planning.aic import load_model_shape
    from spexis_sglang.planning.machines import stage_costs_for

    data = json.loads(path.read_text())
    ratios: dict = {}
    for st in data["stages"]:
        shape = load_model_shape(str(ROOT / st["config_dir"]))
        try:
            costs = stage_costs_for(shape, "h200_sxm", 1)
        except ValueError as e:
            logger.warning("skipping %s: %s", st["model"], e)
            continue
        plan = StagePlan(st["layers"], ("embedding", "lm_head", "sampling"))
        for pt in st["points"]:
            meas = pt.get("decode_ms_pipelined") or pt.get("decode_ms_sync")
            if not meas:
                continue
            pred = costs.stage_time(plan, pt["batch"], pt["kv_len_mean"]) * 1e3
            ratios.setdefault((pt["batch"], pt["input_len"]), []).append(meas / pred)
            table.append(
                {
                    "model": st["model"],
                    "layers": st["layers"],
                    "batch": pt["batch"],
                    "context": pt["input_len"],
                    "measured_ms": meas,
                    "aic_ms": round(pred, 4),
                    "aic_error": round(pred / meas - 1, 4),
                }
            )
    if not ratios:
        raise SystemExit(f"{path}: no stage AIConfigurator can price; nothing to fit")
    rows = sorted({b for b, _ in ratios})
    ctx = sorted({c for _, c in ratios})
    grid = np.full((len(rows), len(ctx)), np.nan)
    for (b, c), v in ratios.items():
        grid[rows.index(b), ctx.index(c)] = float(np.median(v))
    for i in range(len(rows)):  # missing (batch, ctx) cells: the batch's mean over contexts
        row = grid[i]
        fill = np.nanmean(row) if np.any(~np.isnan(row)) else np.nanmean(grid)
        row[np.isnan(row)] = fill
    cal = CostGrid(rows, ctx, grid).to_json()
    measured = sorted({f"{t['model']} ({t['layers']} layers)" for t in table})
    src = (
        f"measured / AIConfigurator per-stage decode time, {_rel(path)}: "
        f"{', '.join(measured)}, B {rows[0]}..{rows[-1]}, contexts "
        f"{', '.join(str(c) for c in ctx)}; unmeasured (batch, context) cells take the "
        "batch's mean over its measured contexts"
    )
    not_run = [
        n.get("stage", str(n)) if isinstance(n, dict) else str(n) for n in data.get("not_run") or []
    ]
    if not_run:
        src += f"; stages not run: {', '.join(not_run)}"
        logger.info("stages not in %s (not run): %s", path.name, ", ".join(not_run))
    probe = data.get("p2p_loopback")
    if not probe:  # fallback: main() fits the loopback bandwidth on stock PP2, as without a file
        logger.info(
            "no p2p probe in %s: the loopback link falls back to the fit on stock PP2", path.name
        )
    else:
        b = np.array([p["bytes"] for p in probe], dtype=float)
        t = np.array([p["ms"] for p in probe]) * MS
        slope, icpt = np.polyfit(b, t, 1)
        cal_json["links"]["loopback_box"].update(
            latency_s=max(float(icpt), 0.0),
            bandwidth_Bps=float(1.0 / slope),
            source=f"NCCL p2p over loopback sockets, measured: {_rel(path)}",
        )
    return {"correction": cal, "source": src}


def fit_loopback(cal_json: dict) -> float:
    """Bandwidth minimising the squared log error of simulated stock PP2 on the box (B=64..512).

    Stock PP2 is the baseline; SP2 on the same box stays out of the fit (validation).
    """
    box = M.BOX_2026_12_02

    def sse(bw: float) -> float:
        cal_json["links"]["loopback_box"]["bandwidth_Bps"] = bw
        m = _machine(cal_json, "h200_sxm", "loopback_box", sharing="mps_box")
        err = 0.0
        for b, meas in box["stock_pp2_tok_s"].items():
            thr, _, _ = simulate_decode_benchmark(
                Deployment("pp", 2), m, b, input_len=box["input_len"]
            )
            err += float(np.log(thr / statistics.mean(meas))) ** 2
        return err

    grid = [g * 1e9 for g in (0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 16.0)]
    errs = [sse(g) for g in grid]
    i = int(np.argmin(errs))
    lo, hi = grid[max(i - 1, 0)], grid[min(i + 1, len(grid) - 1)]
    for _ in range(8):  # golden-section refinement in log space
        a = lo * (hi / lo) ** 0.382
        b = lo * (hi / lo) ** 0.618
        if sse(a) < sse(b):
            hi = b
        else:
            lo = a
    return (lo * hi) ** 0.5


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--stage-times", type=Path, default=ROOT / M.COMMITTED["stage_times"])
    ap.add_argument("--out", type=Path, default=CALIBRATION_PATH)
    ap.add_argument(
        "--errors-out", type=Path, default=ROOT / "benchmark/results/sim_calibration.json"
    )
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    for name in ("aiconfigurator_core", "aiconfigurator"):
        logging.getLogger(name).setLevel(logging.ERROR)

    old = json.loads(args.out.read_text()) if args.out.is_file() else {}
    serial = host_graphs_serial()
    cal = {
        "format": 1,
        "about": (
            "Inputs of the pipeline simulator (spexis_sglang.planning.presets); written by "
            "benchmark/sim/calibrate.py; error bars written by benchmark/sim/validate.py"
        ),
        "host": {"graphs_serial": serial, "graphs_overlap": host_graphs_overlap(serial)},
        "links": {
            "loopback_box": {
                "latency_s": LOOPBACK_LATENCY_S,
                "bandwidth_Bps": 2e9,
                "meta_latency_s": META_LATENCY_S,
                "name": "NCCL over loopback sockets (emulated box)",
                "source": "",
            }
        },
        "sharing": {"mps_box": mps_sharing()},
        "acceptance": acceptance(),
        "systems": {
            "h200_sxm": {
                "correction": None,
                "error_bar": old.get("systems", {}).get("h200_sxm", {}).get("error_bar", 0.1),
                "source": "",
            }
        },
        "borrow": {"h100_sxm": "h200_sxm"},
        "borrow_error_bar_extra": 0.05,
        "default_error_bar": old.get("default_error_bar", 0.2),
    }
    for k in ("error_bar_source",):
        if k in old.get("systems", {}).get("h200_sxm", {}):
            cal["systems"]["h200_sxm"][k] = old["systems"]["h200_sxm"][k]
    stage_table: list = []
    fit_b = None
    if args.stage_times.is_file():
        logger.info("fitting the H200 correction on %s", args.stage_times)
        cal["systems"]["h200_sxm"].update(fit_stage_times(args.stage_times, cal, stage_table))
    else:
        logger.info("no %s: one factor fit on stock PP=1 at B=64", args.stage_times)
        fit_b = 64
        f = fit_pp1_factor(cal)
        logger.info("H200 correction (stock PP=1 at B=64): x%.4f", f)
        cal["systems"]["h200_sxm"]["correction"] = CostGrid.constant(f).to_json()
        cal["systems"]["h200_sxm"]["source"] = (
            f"one factor (x{f:.3f}) fit on stock SGLang PP=1 at B=64 on one H200 with CUDA "
            "graphs (2026-12-01); per-stage timings (benchmark/gpu/stage_times.sh) replace it "
            "once measured"
        )
    if (
        not cal["links"]["loopback_box"]["source"]
        and (ROOT / M.COMMITTED["box_transport_probe"]).is_file()
    ):
        link = loopback_from_probe()
        cal["links"]["loopback_box"].update(link)
        logger.info(
            "loopback link from the transport probe: %.0f us + %.2f GB/s",
            link["latency_s"] * 1e6,
            link["bandwidth_Bps"] / 1e9,
        )
    if (ROOT / M.COMMITTED["box_transport_probe_with_ipc"]).is_file():
        cal["links"]["ipc_box"] = ipc_from_probe()
        logger.info(
            "same-GPU IPC link from its probe: %.0f us + %.1f GB/s",
            cal["links"]["ipc_box"]["latency_s"] * 1e6,
            cal["links"]["ipc_box"]["bandwidth_Bps"] / 1e9,
        )
    if not cal["links"]["loopback_box"]["source"]:
        bw = fit_loopback(cal)
        logger.info("loopback bandwidth fit on stock PP2 (B=64..512): %.2f GB/s", bw / 1e9)
        cal["links"]["loopback_box"]["bandwidth_Bps"] = bw
        cal["links"]["loopback_box"]["source"] = (
            f"latency {LOOPBACK_LATENCY_S * 1e6:.0f} us assumed; bandwidth fit on stock PP2 "
            "on the emulated box (B=64..512, least squares on log throughput) until measured "
            "by stage_times.sh's p2p probe; SP2 stays out of the fit"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(cal, indent=1) + "\n")
    logger.info("wrote %s", args.out)
    errors = {
        "about": (
            "AIConfigurator's estimates beside our H200 measurements (graphs on), and the "
            "calibrated simulator; written by benchmark/sim/calibrate.py"
        ),
        "h200_correction": cal["systems"]["h200_sxm"]["source"],
        "stock_pp1_one_h200": error_table_pp1(cal, fit_b),
        "per_stage": stage_table
        or "not measured yet: run benchmark/gpu/stage_times.sh (benchmark/gpu/README.md)",
        "loopback_link": cal["links"]["loopback_box"],
        "host_phases_graphs_serial": cal["host"]["graphs_serial"],
    }
    args.errors_out.write_text(json.dumps(errors, indent=1) + "\n")
    logger.info("wrote %s", args.errors_out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
