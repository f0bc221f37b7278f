"""Rank PP x TP x SP x alpha deployments of a model on a system with the pipeline simulator.

For ``G`` GPUs every split ``pp * tp = G`` (TP must divide the attention heads) is tried as
TP (``pp = 1``), stock PP and SP (alpha 0 and a small grid). Each runs at the same number of
resident requests ``B`` (the KV capacity of the tightest deployment, capped by CUDA-graph
and ``max_running`` limits), decoding from ``context`` tokens, in steady state. Beside each
simulated throughput stands today's closed form (``core.cost_model``, Table 1 / Eq. 2, with
the same stage-time tables as its latency function, GPU time only), so a user sees where the
loop's choreography (host phases, transfers, bubbles) moves the ranking.
"""

from __future__ import annotations

import logging
import math
from dataclasses import asdict, dataclass, field
from typing import Optional, Sequence, Union

import numpy as np

from spexis_sglang.core.cost_model import b_eff_star, sp_alpha_exact
from spexis_sglang.core.pipeline_sim import (
    AcceptanceModel,
    DecodeWorkload,
    Deployment,
    ServingWorkload,
    simulate,
)
from spexis_sglang.core.stage_costs import StagePlan

from .aic import ModelShape, load_model_shape
from .machines import bridge_for, machine_for
from .presets import LOOPS, Calibration, load_calibration

logger = logging.getLogger(__name__)

__all__ = [
    "PlanRow",
    "deployments",
    "max_batch",
    "rank_deployments",
    "format_ranking",
    "serving_capacity",
    "DEFAULT_ALPHAS",
]

DEFAULT_ALPHAS = (0.1, 0.2, 0.3)
#: What SGLang reserves besides weights and KV (graphs, activations, NCCL), per GPU, bytes.
RESERVED_BYTES = 6 * 2**30
MEM_FRACTION = 0.85
BATCH_CAP = 512


@dataclass
class PlanRow:
    """One ranked deployment (throughputs in tokens/s)."""

    label: str
    mode: str
    pp: int
    tp: int
    alpha: float
    theta: Optional[float]
    batch: int
    throughput: float
    low: float
    high: float
    closed_form: float
    iteration_ms: float
    rows_per_iteration: float
    stage_utilisation: list
    phases_ms: dict = field(default_factory=dict)
    note: str = ""

    def to_json(self) -> dict:
        return asdict(self)


def deployments(gpus: int, shape: ModelShape, alphas: Sequence[float] = DEFAULT_ALPHAS) -> list:
    """Every TP / PP / SP(alpha) split of ``gpus`` the model allows."""
    out = []
    for pp in range(1, gpus + 1):
        if gpus % pp:
            continue
        tp = gpus // pp
        if shape.num_heads % tp or pp > shape.num_layers:
            continue
        if pp == 1:
            out.append(Deployment("tp", 1, tp))
            continue
        out.append(Deployment("pp", pp, tp))
        out.append(Deployment("sp", pp, tp))
        for a in alphas:
            out.append(Deployment("sp", pp, tp, alpha=a))
    return out


def max_batch(
    shape: ModelShape,
    gpu_bytes: float,
    dep: Deployment,
    tokens_per_seq: int,
    cap: int = BATCH_CAP,
) -> int:
    """Sequences of ``tokens_per_seq`` tokens whose KV fits on the tightest stage."""
    per = StagePlan.for_pipeline(shape.num_layers, dep.pp, dep.mode == "sp")
    best = cap
    for plan in per:
        frac = plan.layers / shape.num_layers
        weights = shape.weight_bytes() * frac / dep.tp
        if "embedding" in plan.extras or "lm_head" in plan.extras:
            weights += 2.0 * shape.vocab_size * shape.hidden_size / dep.tp
        kv_heads = max(1, math.ceil(shape.num_kv_heads / dep.tp))
        layers = plan.layers + (1 if "draft_head" in plan.extras else 0)
        kv_tok = 2.0 * layers * kv_heads * shape.head_dim * 2
        free = gpu_bytes * MEM_FRACTION - weights - RESERVED_BYTES
        if free <= 0:
            return 0
        best = min(best, int(free / kv_tok / tokens_per_seq))
    return max(best, 0)


def kept_acceptance(acc: AcceptanceModel, alpha: float) -> float:
    """Theta_alpha: mean acceptance of the drafts that survive dropping the alpha least sure."""
    if acc.rank_profile is None or alpha <= 0:
        return acc.theta
    prof = acc.profile_at(acc.theta)  # most confident bin first
    u = np.linspace(alpha, 1.0, 2001)[1:]  # confidence quantiles of the kept drafts
    b = np.minimum(((1.0 - u) * prof.size).astype(int), prof.size - 1)
    return float(prof[b].mean())


def closed_form(machine, dep: Deployment, batch: int, ctx: float, theta: float) -> float:
    """Table 1 with the stage tables as latency (the slowest stage; GPU time only).

    ``theta`` is the acceptance of the drafts that ride (Theta_alpha when alpha > 0)."""
    costs = machine.costs
    plans = StagePlan.for_pipeline(costs.num_layers, dep.pp, dep.mode == "sp")

    def t(rows: float) -> float:
        return max(costs.stage_time(p, rows, ctx) for p in plans)

    if dep.mode == "tp":
        return batch / t(batch)
    if dep.mode == "pp":
        mb = batch / dep.pp
        return mb / t(mb)
    if dep.alpha > 0:
        ss = sp_alpha_exact(batch, dep.pp, theta, dep.alpha)
        return ss.effective / t(ss.rows)
    return b_eff_star(batch, dep.pp, theta) / t(batch)


def _acceptance(cal: Calibration, theta: float) -> AcceptanceModel:
    prof = cal.raw.get("acceptance", {}).get("rank_profile")
    return AcceptanceModel(theta, tuple(prof) if prof else None)


def rank_deployments(
    model: Union[str, ModelShape],
    system: str,
    gpus: int,
    theta: float = 0.76,
    theta_by_pp: Optional[dict] = None,
    batch: Optional[int] = None,
    context: int = 128,
    output_len: int = 512,
    alphas: Sequence[float] = DEFAULT_ALPHAS,
    loop: str = "serial",
    iterations: int = 160,
    calibration: Optional[Calibration] = None,
    seed: int = 0,
) -> list[PlanRow]:
    """Simulate every deployment of ``model`` on ``gpus`` GPUs of ``system``; best first."""
    cal = calibration or load_calibration()
    shape = model if isinstance(model, ModelShape) else load_model_shape(model)
    bridge = bridge_for(system)
    if gpus > bridge.gpus_per_node:
        raise ValueError(f"{system} has {bridge.gpus_per_node} GPUs per node; got --gpus {gpus}")
    deps = deployments(gpus, shape, alphas)
    if not deps:
        raise ValueError(f"no TP/PP split of {gpus} GPUs fits {shape.name}")
    if batch is None:
        caps = [max_batch(shape, bridge.gpu_memory_bytes, d, context + output_len) for d in deps]
        batch = min(caps)
        if batch < 1:
            raise ValueError(f"{shape.name} does not fit on {gpus} x {system} at every split")
    err = cal.system(system).error_bar
    rows = []
    for dep in deps:
        th = (theta_by_pp or {}).get(dep.pp, theta) if dep.mode == "sp" else None
        # only SP's loop changes: stock PP and TP always run today's loop
        dep_loop = loop if dep.mode == "sp" else "serial"
        m = machine_for(shape, system, tp=dep.tp, loop=dep_loop, calibration=cal)
        wl = DecodeWorkload(
            batch,
            context,
            iterations=iterations,
            warmup=iterations // 4,
            prefill_chunk=None,  # stock PP at its best: balanced micro-batches
            max_running=max(batch, 512),
        )
        acc = _acceptance(cal, th if th is not None else theta)
        r = simulate(dep, m, wl, acc, LOOPS[dep_loop], seed)
        th_kept = kept_acceptance(acc, dep.alpha) if th is not None else 0.0
        cf = closed_form(m, dep, batch, context + iterations / 2, th_kept)
        rows.append(
            PlanRow(
                label=dep.label,
                mode=dep.mode,
                pp=dep.pp,
                tp=dep.tp,
                alpha=dep.alpha,
                theta=th,
                batch=batch,
                throughput=r.throughput_tok_s,
                low=r.throughput_tok_s * (1 - err),
                high=r.throughput_tok_s * (1 + err),
                closed_form=cf,
                iteration_ms=r.iteration_s * 1e3,
                rows_per_iteration=r.rows_per_iteration,
                stage_utilisation=[round(u, 3) for u in r.stage_utilisation],
                phases_ms={k: round(v, 3) for k, v in r.phases_ms.get("stage0", {}).items()},
            )
        )
    mode_rank = {"tp": 0, "pp": 1, "sp": 2}
    rows.sort(key=lambda r: (-r.throughput, r.pp, r.tp, mode_rank[r.mode], r.alpha))
    cf_order = sorted(rows, key=lambda r: -r.closed_form)
    cf_rank = {id(r): i for i, r in enumerate(cf_order)}
    for i, r in enumerate(rows):
        j = cf_rank[id(r)]
        if j != i:
            r.note = f"closed form ranks it #{j + 1}"
        if max(r.stage_utilisation) < 0.8:
            r.note = (r.note + "; " if r.note else "") + "GPU idle >20 %: host/transfer bound"
    return rows


def format_ranking(rows: Sequence[PlanRow], err: float) -> str:
    if not rows:
        return "(no deployments)"
    best = rows[0].throughput
    head = (
        f"{'rank':>4}  {'deployment':<18} {'theta':>5} {'B':>5} {'tok/s':>9} "
        f"{'+-':>6} {'vs best':>7} {'closed form':>11} {'sim/cf':>6} {'ms/it':>6}  note"
    )
    lines = [head, "-" * len(head)]
    for i, r in enumerate(rows, 1):
        th = f"{r.theta:.2f}" if r.theta is not None else "-"
        lines.append(
            f"{i:>4}  {r.label:<18} {th:>5} {r.batch:>5} {r.throughput:>9.0f} "
            f"{r.throughput * err:>6.0f} {r.throughput / best:>7.3f} {r.closed_form:>11.0f} "
            f"{r.throughput / r.closed_form:>6.2f} {r.iteration_ms:>6.2f}  {r.note}"
        )
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------
# Serving: the largest Poisson rate that meets an SLO
# ---------------------------------------------------------------------------------------


def serving_capacity(
    machine,
    dep: Deployment,
    prompt_len: np.ndarray,
    output_len: np.ndarray,
    theta: np.ndarray,
    acceptance: AcceptanceModel,
    slo_ttft_s: float = 2.0,
    slo_tpot_s: float = 0.05,
    max_running: int = 256,
    kv_capacity_tokens: int = 10**9,
    rate_hi: float = 64.0,
    steps: int = 6,
    seed: int = 0,
    loop=None,
) -> dict:
    """Largest request rate (req/s) whose p90 TTFT and p90 TPOT meet the SLO (bisection)."""
    n = len(prompt_len)
    rng = np.random.default_rng(seed)
    gaps = rng.exponential(1.0, n)

    def run(rate: float):
        arrivals = np.cumsum(gaps) / rate
        wl = ServingWorkload(
            arrival_s=arrivals,
            prompt_len=prompt_len,
            output_len=output_len,
            theta=theta,
            max_running=max_running,
            kv_capacity_tokens=kv_capacity_tokens,
        )
        r = simulate(dep, machine, wl, acceptance, loop, seed)
        s = r.serving
        ok = s["ttft_s"]["p90"] <= slo_ttft_s and s["tpot_s"]["p90"] <= slo_tpot_s
        return ok, s

    lo, hi = 0.0, rate_hi
    ok, s = run(hi)
    if ok:
        return {"rate": hi, "at_rate": s, "bracketed": False}
    best = None
    for _ in range(steps):
        mid = (lo + hi) / 2
        ok, s = run(mid)
        if ok:
            lo, best = mid, s
        else:
            hi = mid
    return {"rate": lo, "at_rate": best, "bracketed": True}
