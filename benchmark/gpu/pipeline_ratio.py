#!/usr/bin/env python3
"""SP against stock PP per batch size, beside the ideal ratio from the same call's stage times.

With N stages, stock PP runs micro-batches of B/N rows, one stage interval T(B/N) each, and a
request advances one token every N intervals: B / (N·T(B/N)) tokens per second. SP runs all B
rows every interval T(B) and commits 1 / (N − Θ(N−1)) tokens per row (Eq. 2). If both paid
nothing but their stages' GPU time,

    SP / PP = N · T(B/N) / ((N − Θ(N−1)) · T(B)),

the *ideal* ratio: what SP can reach where the host and the transfers stay off the pipeline's
critical path. T is each server's own device time per decode forward, per rank, as
``SPEXIS_GPU_TIMERS`` logs it; a stage's time is the slowest rank's. T(B) comes from the SP
point's own forwards of B rows and T(B/N) from the stock point at the same B whose micro-batches
are B/N rows (async depth 0 first), each over that point's runs only (``gpu_forward_ms`` of the
point); a run without point timers falls back to each server's timers over all its points
(``stage_ms_source``: ``point`` or ``server``). Θ is the
acceptance measured in the SP run (forced in the benchmark mode). Besides the ratios the table
gives stage 0's SP iteration time against its own GPU time (1.0 = its host work is hidden),
and each later stage's loop by phase where the run recorded it (``later_stages``).

The ideal assumes stock PP runs B/N-row micro-batches with every stage busy. Where its best
schedule is another (SGLang's default cap puts B ≤ 256 into one micro-batch and the stages take
turns), the ideal is not what SP can reach against it. SP's *ceiling* is: all B rows every
T(B) at α 0, B / ((N − Θ(N−1)) · T(B)) tokens per second; ``ceiling_over_pp`` sets it against
stock's measured best (where SP could get to, on this machine, against what stock did) and
``of_ceiling`` is SP's measured rate over it (what its host work, bubbles and α left).

Rates are wall-clock (two runs' time difference over their extra steps); where both points
have it, ``sp_over_pp_steady`` sets their steady-state rates side by side (stage 0's tokens
while every request ran, each run's end left out: SP's requests finish over several
iterations under forced acceptance, stock's on one step). Where a point's wall
rate and its own counter rate differ by more than 10 % (one of its runs paid a one-time cost),
the row compares counter rates instead (``ratio_source``: ``counters``; the wall ratio stays
in ``sp_over_pp_wall``). A point whose server cannot hold all B requests at once (KV pool or
running cap) has no ratio (``short_of_batch`` says why).

    python3 benchmark/gpu/pipeline_ratio.py decode_throughput.json [rows.json [plot.png]]

The plot: decode tok/s against B for every configuration (left) and, per SP configuration,
SP / best stock PP beside its ideal ratio (right), one panel per input length.
"""

from __future__ import annotations

import json
import os
import sys
import textwrap
from typing import Any, Dict, List, Optional

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "python"))

from spexis_sglang.srt.stats import GpuForwardTimer  # noqa: E402

STAGE0 = "pp rank 0, tp rank 0"


def ctx_bucket(input_len: int, output_len: int) -> int:
    """The GPU timers' context bucket of a decode sweep's mean context (its keys' ``ctx``)."""
    return GpuForwardTimer.context_bucket(input_len + output_len / 2)


def stage_ms(
    res: Dict[str, Any], rows: int, ctx: int, rank: Optional[str] = None
) -> Optional[float]:
    """Mean device ms of a decode forward of ``rows`` rows: the slowest rank's (or ``rank``'s)."""
    times = res.get("gpu_forward_ms") or {}
    key = f"{rows}@{ctx}"
    vals = [
        by_key[key][1]
        for label, by_key in times.items()
        if key in by_key and (rank is None or label == rank)
    ]
    return max(vals) if vals else None


def point_stage_ms(
    point: Optional[Dict[str, Any]], rows: int, ctx: int, rank: Optional[str] = None
) -> Optional[float]:
    """:func:`stage_ms` over one measured point's own forwards (its ``gpu_forward_ms``: the
    timers' difference across the point's runs), where the benchmark recorded them. A
    server's timers merge every point it ran, among them another configuration's forwards of
    the same rows (stock PP's two micro-batch caps: 64-row forwards at B = 64 with one
    micro-batch, the stages taking turns, and at B = 128 with two, both stages busy)."""
    if not point or not point.get("gpu_forward_ms"):
        return None
    return stage_ms({"gpu_forward_ms": point["gpu_forward_ms"]}, rows, ctx, rank)


def forward_rows(point: Optional[Dict[str, Any]], rank: str = STAGE0) -> Optional[int]:
    """The rows of most of a point's decode forwards on ``rank``, from its own GPU timers
    (None without them): B/N for stock PP's balanced micro-batches, B where SGLang's cap
    put every request into one micro-batch and the stages took turns."""
    times = ((point or {}).get("gpu_forward_ms") or {}).get(rank) or {}
    if not times:
        return None
    return GpuForwardTimer.rows_of(max(times, key=lambda k: times[k][0]))


def async_depth(res: Dict[str, Any]) -> int:
    """A stock PP result's (or configuration's) ``--pp-async-batch-depth``, 0 if not given."""
    args = [str(a) for a in res.get("server_args") or res.get("args") or []]
    if "--pp-async-batch-depth" in args[:-1]:
        return int(args[args.index("--pp-async-batch-depth") + 1])
    return 0


def counter_tok_s(point: Dict[str, Any], kind: str, n: int, depth: int = 0) -> Optional[float]:
    """A point's decode tokens per second from stage 0's own counters over the long run less
    the short one: tokens per decode iteration (SP: committed tokens; stock PP: a micro-batch
    of B/(N + ``depth``), its async depth, every request running at once) over its loop's
    busy time per decode iteration. None without phase timers.

    The wall-clock rate divides the two runs' time difference by the extra steps, so a run
    that paid a one-time cost the other did not moves it (a slow first run at a batch size
    once read 1.27x the rate); these counters cover decode iterations only."""
    if kind == "pp":
        phases = point.get("stock_phase_ms_per_iteration") or {}
        per_iteration = point["batch"] / (n + depth)
    elif kind == "sp":
        sp = point.get("sp") or {}
        phases = sp.get("phase_ms_per_iteration") or {}
        short, long = sp.get("short") or {}, sp.get("long") or {}
        iters = long.get("decode_iterations", 0) - short.get("decode_iterations", 0)
        tokens = long.get("tokens_committed", 0) - short.get("tokens_committed", 0)
        per_iteration = tokens / iters if iters > 0 else 0.0
    else:
        return None
    busy = phases.get("busy")
    if not busy or per_iteration <= 0:
        return None
    return per_iteration / (busy / 1e3)


# a point whose wall-clock rate and counter rate differ by more than this paid a one-time
# cost in one of its two runs (seen: a short run 1 s slower at B = 512, read as 1.9x the rate)
WALL_TOLERANCE = 0.1


def wall_agrees(point: Dict[str, Any]) -> bool:
    """Whether a point's wall-clock rate matches its counters' (True without counters)."""
    ratio = point.get("wall_over_counters")
    return ratio is None or abs(ratio - 1.0) <= WALL_TOLERANCE


def compare_rates(
    row: Dict[str, Any],
    sp_point: Dict[str, Any],
    pp_points: Dict[str, Dict[str, Any]],
    pp_results: Dict[str, Dict[str, Any]],
    n: int,
) -> None:
    """SP against the best stock point, into ``row``: by wall clock, the benchmark's rate,
    unless a point's wall rate disagrees with its own counters (``wall_disagrees``); then by
    counters, where every point has them (``ratio_source``). The other ratio stays beside."""
    wall_best = max(pp_points, key=lambda k: pp_points[k]["decode_tok_s"])
    wall_ratio = sp_point["decode_tok_s"] / pp_points[wall_best]["decode_tok_s"]
    row["pp_tok_s"] = {k: round(v["decode_tok_s"]) for k, v in pp_points.items()}
    row.update(
        pp_best=wall_best,
        pp_best_tok_s=row["pp_tok_s"][wall_best],
        sp_over_pp=round(wall_ratio, 3),
        ratio_source="wall",
    )
    steady = {k: v.get("steady_tok_s") for k, v in pp_points.items()}
    if sp_point.get("steady_tok_s") and all(steady.values()):
        # every request running, each run's end left out (decode_throughput.steady_rate)
        steady_best = max(steady, key=steady.get)
        row["sp_over_pp_steady"] = round(sp_point["steady_tok_s"] / steady[steady_best], 3)
    sp_c = counter_tok_s(sp_point, "sp", n)
    pp_c = {k: counter_tok_s(v, "pp", n, async_depth(pp_results[k])) for k, v in pp_points.items()}
    pp_c = {k: v for k, v in pp_c.items() if v}
    if not (sp_c and pp_c):
        return
    ctr_best = max(pp_c, key=pp_c.get)
    row["sp_over_pp_counters"] = round(sp_c / pp_c[ctr_best], 3)
    disagree = [row["config"]] if not wall_agrees(sp_point) else []
    disagree += [k for k, v in pp_points.items() if not wall_agrees(v)]
    if not disagree:
        return
    row["wall_disagrees"] = disagree
    if len(pp_c) == len(pp_points):
        row.update(
            pp_best=ctr_best,
            pp_best_tok_s=round(pp_c[ctr_best]),
            sp_tok_s=round(sp_c),
            sp_wall_tok_s=round(sp_point["decode_tok_s"]),
            sp_over_pp=row["sp_over_pp_counters"],
            sp_over_pp_wall=round(wall_ratio, 3),
            ratio_source="counters",
        )


def short_of_batch(res: Dict[str, Any], batch: int, input_len: int, output_len: int) -> str:
    """Why a server cannot run all ``batch`` requests at once ("" where it can): its KV pool
    is short of their full lengths, or its running cap below B. Such a point runs fewer than
    B requests at a time, and its rate is no decode rate at B."""
    pool, cap = res.get("max_total_num_tokens"), res.get("max_running_requests")
    if pool and batch * (input_len + output_len) > int(pool):
        return f"{res['config']}: KV pool {pool} tokens < {batch} x {input_len + output_len}"
    if cap and batch > int(cap):
        return f"{res['config']}: --max-running-requests {cap} < {batch}"
    return ""


def _point(res: Dict[str, Any], batch: int, input_len: int) -> Optional[Dict[str, Any]]:
    for x in res.get("batches", []):
        if x.get("batch") == batch and x.get("input_len") == input_len and x.get("decode_tok_s"):
            return x
    return None


def compare(summary: Dict[str, Any]) -> List[Dict[str, Any]]:
    """One row per (model, SP configuration, input length, B)."""
    out: List[Dict[str, Any]] = []
    out_len = int(summary.get("output_len", 128))
    for model, m in summary.get("models", {}).items():
        results = m.get("results", [])
        pp1 = next((r for r in results if r["kind"] == "pp1"), None)
        for sp in results:
            if sp["kind"] != "sp":
                continue
            n = int(sp["n"])
            pps = [r for r in results if r["kind"] == "pp" and int(r["n"]) == n]
            pp0 = next((r for r in pps if "async" not in r["config"]), pps[0] if pps else None)
            for x in sp["batches"]:
                if not x.get("decode_tok_s"):
                    continue
                b, in_len = x["batch"], x.get("input_len")
                ctx = ctx_bucket(in_len or 0, out_len)
                row: Dict[str, Any] = {
                    "model": model,
                    "config": sp["config"],
                    "input_len": in_len,
                    "batch": b,
                    "sp_tok_s": round(x["decode_tok_s"]),
                }
                spx = x.get("sp") or {}
                theta = spx.get("acceptance")
                row["theta"] = None if theta is None else round(theta, 3)
                pp_points = {r["config"]: _point(r, b, in_len) for r in pps}
                pp_points = {k: v for k, v in pp_points.items() if v}
                short = [
                    why
                    for res in [sp] + [r for r in pps if r["config"] in pp_points]
                    if (why := short_of_batch(res, b, in_len or 0, out_len))
                ]
                if short:  # the rates stay in the results; no ratio is drawn from them
                    row["short_of_batch"] = short
                    out.append(row)
                    continue
                if pp_points:
                    compare_rates(row, x, pp_points, {r["config"]: r for r in pps}, n)
                if pp1 is not None and _point(pp1, b, in_len):
                    row["pp1_tok_s"] = round(_point(pp1, b, in_len)["decode_tok_s"])
                # T(B) from this point's forwards of B rows, T(B/N) from a stock point at this B
                # whose micro-batches are B/N rows (at async depth 0 first); where the run
                # recorded no point timers, from the servers' timers over all their points
                t_sp = point_stage_ms(x, b, ctx)
                t_pp = None
                for r in sorted(pps, key=async_depth):
                    t_pp = point_stage_ms(_point(r, b, in_len), b // n, ctx)
                    if t_pp:
                        break
                row["stage_ms_source"] = "point" if t_sp and t_pp else "server"
                if not (t_sp and t_pp):
                    t_sp = stage_ms(sp, b, ctx)
                    t_pp = stage_ms(pp0, b // n, ctx) if pp0 is not None else None
                row["stage_ms_sp"] = t_sp
                row["stage_ms_pp"] = t_pp
                if t_sp and t_pp and theta is not None:
                    ideal = n * t_pp / ((n - theta * (n - 1)) * t_sp)
                    row["ideal"] = round(ideal, 3)
                    if "sp_over_pp" in row:
                        row["of_ideal"] = round(row["sp_over_pp"] / ideal, 3)
                if t_sp and theta is not None:
                    # SP's own ceiling: all B rows every T(B), 1 / (N - Θ(N-1)) tokens a row
                    ceiling = b * 1e3 / ((n - theta * (n - 1)) * t_sp)
                    row["ceiling_tok_s"] = round(ceiling)
                    row["of_ceiling"] = round(row["sp_tok_s"] / ceiling, 3)
                    if row.get("pp_best_tok_s"):
                        row["ceiling_over_pp"] = round(ceiling / row["pp_best_tok_s"], 3)
                it = spx.get("iter_time_s")
                t0 = point_stage_ms(x, b, ctx, STAGE0) or stage_ms(sp, b, ctx, STAGE0)
                if it and t0:
                    row["stage0_iter_ms"] = round(1e3 * it, 3)
                    row["stage0_gpu_ms"] = t0
                    row["iter_over_gpu"] = round(1e3 * it / t0, 3)
                row["phase_ms"] = spx.get("phase_ms_per_iteration")
                later = {}
                for label, st in (x.get("later_stages") or {}).items():
                    later[label] = {
                        "phase_ms": st.get("phase_ms_per_iteration"),
                        "gpu_ms": point_stage_ms(x, b, ctx, f"{label}, tp rank 0")
                        or stage_ms(sp, b, ctx, f"{label}, tp rank 0"),
                    }
                if later:
                    row["later_stages"] = later
                if spx.get("rows_per_iteration") is not None:
                    row["rows_per_iteration"] = round(spx["rows_per_iteration"], 1)
                if spx.get("alpha_end") is not None:
                    row["alpha_end"] = spx["alpha_end"]
                out.append(row)
    return out


def print_table(rows: List[Dict[str, Any]]) -> None:
    if not rows:
        print("no SP rows to compare")
        return
    head = (
        f"{'model':<14} {'config':<34} {'in':>5} {'B':>4} {'theta':>5} {'SP tok/s':>9} "
        f"{'PP best':>9} {'SP/PP':>7} {'ideal':>6} {'of id.':>6} {'T(B/N)':>7} {'T(B)':>7} "
        f"{'it/gpu':>6} {'ctr':>6} {'steady':>6} {'ceil/PP':>7} {'of ceil':>7}"
    )
    print(head)
    for r in rows:

        def f(k, fmt="{:.3f}"):
            v = r.get(k)
            return fmt.format(v) if isinstance(v, (int, float)) else "-"

        mark = "*" if r.get("ratio_source") == "counters" else " "
        print(
            f"{r['model']:<14} {r['config']:<34} {r['input_len'] or 0:>5} {r['batch']:>4} "
            f"{f('theta', '{:.2f}'):>5} {r['sp_tok_s']:>9} {f('pp_best_tok_s', '{}'):>9} "
            f"{f('sp_over_pp')}{mark} {f('ideal'):>6} {f('of_ideal'):>6} "
            f"{f('stage_ms_pp', '{:.2f}'):>7} {f('stage_ms_sp', '{:.2f}'):>7} "
            f"{f('iter_over_gpu', '{:.2f}'):>6} {f('sp_over_pp_counters'):>6} "
            f"{f('sp_over_pp_steady'):>6} {f('ceiling_over_pp'):>7} {f('of_ceiling'):>7}"
        )
    if any(r.get("ratio_source") == "counters" for r in rows):
        print(
            "* a point's wall-clock rate disagreed with its counters by more than "
            f"{WALL_TOLERANCE:.0%}: SP/PP, SP and PP tok/s from the counters"
        )
    for r in rows:
        if r.get("short_of_batch"):
            print(
                f"no ratio at in={r['input_len'] or 0} B={r['batch']} ({r['config']}), not all "
                f"B requests run at once: {'; '.join(r['short_of_batch'])}"
            )
    later = [r for r in rows if r.get("later_stages")]
    if later:
        print("\nlater stages, ms per SP iteration by phase (their GPU ms per forward):")
        for r in later:
            for label, st in r["later_stages"].items():
                phases = st.get("phase_ms") or {}
                gpu = st.get("gpu_ms")
                print(
                    f"  {r['config']} in={r['input_len'] or 0} B={r['batch']} {label}: "
                    + " ".join(f"{k} {v:.2f}" for k, v in phases.items())
                    + (f" (gpu {gpu:.2f})" if gpu else "")
                )


def plot(summary: Dict[str, Any], rows: List[Dict[str, Any]], path: str, title: str = "") -> None:
    """Throughput per configuration and SP / PP beside the ideal, per model and input length."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = sorted({(r["model"], r["input_len"]) for r in rows})
    fig, axes = plt.subplots(len(panels), 2, figsize=(12, 4.2 * len(panels)), squeeze=False)
    for (model, in_len), (ax_tp, ax_ratio) in zip(panels, axes):
        for res in summary["models"][model]["results"]:
            pts, hollow = [], []
            for x in res.get("batches", []):
                if not x.get("decode_tok_s") or x.get("input_len") != in_len:
                    continue
                rate = x["decode_tok_s"]
                # a point whose wall rate is off its counters: the counter rate, drawn hollow
                if not wall_agrees(x) and x.get("counter_tok_s"):
                    rate = x["counter_tok_s"]
                    hollow.append((x["batch"], rate))
                pts.append((x["batch"], rate))
            if pts:
                style = "-o" if res["kind"] == "sp" else "--s"
                line = ax_tp.plot(*zip(*pts), style, label=res["config"], markersize=4)[0]
                if hollow:
                    ax_tp.plot(*zip(*hollow), "o", mfc="white", color=line.get_color(), ms=7)
        ax_tp.set(
            xscale="log", xlabel="batch B (requests)", ylabel="decode tok/s (hollow: counters)"
        )
        ax_tp.set_title(f"{model}, input {in_len}")
        ax_tp.legend(fontsize=7)
        for cfg in sorted(
            {r["config"] for r in rows if (r["model"], r["input_len"]) == (model, in_len)}
        ):
            mine = [
                r for r in rows if (r["model"], r["input_len"], r["config"]) == (model, in_len, cfg)
            ]
            got = [(r["batch"], r["sp_over_pp"]) for r in mine if "sp_over_pp" in r]
            ideal = [(r["batch"], r["ideal"]) for r in mine if "ideal" in r]
            ceiling = [(r["batch"], r["ceiling_over_pp"]) for r in mine if "ceiling_over_pp" in r]
            by_counters = [
                (r["batch"], r["sp_over_pp"]) for r in mine if r.get("ratio_source") == "counters"
            ]
            if got:
                line = ax_ratio.plot(*zip(*got), "-o", markersize=4, label=f"{cfg}: measured")[0]
                color = line.get_color()
                if by_counters:
                    ax_ratio.plot(
                        *zip(*by_counters), "o", mfc="white", color=color, markersize=7,
                        label=f"{cfg}: from counters (wall clock off)",
                    )  # fmt: skip
                if ideal:
                    ax_ratio.plot(*zip(*ideal), ":", color=color, label=f"{cfg}: ideal")
                if ceiling:
                    ax_ratio.plot(
                        *zip(*ceiling), "--", lw=0.8, color=color,
                        label=f"{cfg}: SP ceiling / stock's best",
                    )  # fmt: skip
        ax_ratio.axhline(1.0, color="grey", lw=0.8)
        ax_ratio.set(xscale="log", xlabel="batch B (requests)", ylabel="SP / best stock PP")
        ax_ratio.legend(fontsize=7)
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=80)


def main(argv: List[str]) -> int:
    with open(argv[0]) as fh:
        summary = json.load(fh)
    rows = compare(summary)
    print_table(rows)
    if len(argv) > 1:
        with open(argv[1], "w") as fh:
            json.dump(rows, fh, indent=1)
    if len(argv) > 2:
        plot(summary, rows, argv[2], textwrap.fill(summary.get("note", "").split(". ")[0], 150))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
