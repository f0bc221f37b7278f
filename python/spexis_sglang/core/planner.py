"""Deployment planner: rank PP x TP x SP x alpha configurations by predicted throughput.

Throughputs follow Table 1 (paper §4-5.1): for every profiled ``(pp, tp)`` with ``pp * tp``
GPUs and a KV capacity of ``B`` sequences,

* ``pp == 1``  TP      ``B / T(B)``
* ``pp >= 2``  PP      ``(B/N) / T(B/N)``                   N = pp micro-batches
* ``pp >= 2``  SP      ``B*_eff / T_sp(B)``                 Eq. 2
* ``pp >= 2``  SP_a    ``B*_eff,a / T_sp(B*_a)``            Eq. 3-4, alpha chosen by
  :func:`selection.choose_alpha` from the acceptance-by-rank profile

``T`` is the time of one iteration: one forward pass for ``pp == 1``, one *stage* time for
``pp >= 2`` (the interval between batches entering stage 0).

Profile JSON (documented in ``benchmark/profiles/README.md``)::

    {
      "name": "optional text", "description": "optional text",
      "num_gpus": 8,
      "tokens_per_seq": 1536,              # only needed with kv_capacity_tokens
      "theta": {"2": 0.785, "4": 0.634},   # draft acceptance for exit after stage 0 of pp
      "acceptance_by_rank": {"2": [0.97, ..., 0.31]},   # optional, rank 0 = most confident
      "alpha_grid": [0.0, 0.05, 0.1],      # optional (default 0.00 .. 0.50 by 0.01)
      "configs": [
        {"pp": 1, "tp": 8, "max_batch": 480, "latency": [[1, 0.021], [64, 0.024]]},
        {"pp": 2, "tp": 4, "kv_capacity_tokens": 700000,
         "latency": [[1, 0.011], [64, 0.012]], "latency_sp": [[1, 0.0115], [64, 0.0126]]}
      ]
    }

``latency`` lists ``[batch, seconds per iteration]`` points (batches strictly increasing,
latency non-decreasing); ``latency_sp`` (optional, ``pp >= 2``) is the stage time with the
draft head on stage 0 and defaults to ``latency``. ``theta`` is required for every ``pp >= 2``
in ``configs``: the draft exits after stage 0, i.e. at depth ``1/pp`` of the model. When
``acceptance_by_rank`` is given for a ``pp`` its mean must agree with ``theta`` within 0.02.

Every validation failure raises :class:`ProfileError` naming the offending field.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from .cost_model import (
    LatencyTable,
    b_eff_star,
    throughput_pp,
    throughput_sp,
    throughput_tp,
)
from .selection import DEFAULT_ALPHA_GRID, RankAcceptanceProfile, choose_alpha

__all__ = [
    "ProfileError",
    "ConfigProfile",
    "Profile",
    "PlanRow",
    "load_profile",
    "parse_profile",
    "rank_configurations",
    "format_table",
    "THETA_PROFILE_TOLERANCE",
]

#: Largest allowed gap between ``theta[pp]`` and the mean of ``acceptance_by_rank[pp]``.
THETA_PROFILE_TOLERANCE = 0.02

_TOP_KEYS = {
    "name",
    "description",
    "num_gpus",
    "tokens_per_seq",
    "theta",
    "acceptance_by_rank",
    "alpha_grid",
    "configs",
}
_CFG_KEYS = {
    "pp",
    "tp",
    "max_batch",
    "kv_capacity_tokens",
    "latency",
    "latency_sp",
    "note",
}


class ProfileError(ValueError):
    """An invalid profile; the message names the field (e.g. ``configs[1].latency[3]``)."""


@dataclass(frozen=True)
class ConfigProfile:
    """One profiled (pp, tp) deployment."""

    pp: int
    tp: int
    max_batch: int
    latency: LatencyTable
    latency_sp: LatencyTable

    @property
    def label(self) -> str:
        return f"PP{self.pp}xTP{self.tp}"


@dataclass(frozen=True)
class Profile:
    """A validated profile."""

    name: str
    num_gpus: int
    configs: tuple[ConfigProfile, ...]
    theta: Mapping[int, float]
    acceptance_by_rank: Mapping[int, RankAcceptanceProfile]
    alpha_grid: tuple[float, ...]


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_num(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _int_field(obj: Mapping[str, Any], key: str, path: str, minimum: int = 1) -> int:
    if key not in obj:
        raise ProfileError(f"{path}.{key}: missing required key")
    v = obj[key]
    if not _is_int(v):
        raise ProfileError(f"{path}.{key}: expected an integer, got {type(v).__name__} {v!r}")
    if v < minimum:
        raise ProfileError(f"{path}.{key}: must be >= {minimum}, got {v}")
    return v


def _prob(v: Any, path: str) -> float:
    if not _is_num(v):
        raise ProfileError(f"{path}: expected a number in [0, 1], got {type(v).__name__} {v!r}")
    if not 0.0 <= v <= 1.0:
        raise ProfileError(f"{path}: {v} is outside [0, 1]")
    return float(v)


def _pp_key(k: Any, path: str) -> int:
    try:
        pp = int(k)
    except (TypeError, ValueError):
        raise ProfileError(f"{path}: key {k!r} is not a pipeline depth (an integer >= 2)") from None
    if str(pp) != str(k).strip() or pp < 2:
        raise ProfileError(f"{path}: key {k!r} is not a pipeline depth (an integer >= 2)")
    return pp


def _latency(v: Any, path: str) -> LatencyTable:
    if not isinstance(v, list):
        raise ProfileError(f"{path}: expected a list of [batch, seconds] points, got {v!r}")
    if not v:
        raise ProfileError(f"{path}: the latency table is empty")
    for i, p in enumerate(v):
        if not isinstance(p, list) or len(p) != 2:
            raise ProfileError(f"{path}[{i}]: expected [batch, seconds], got {p!r}")
        if not _is_num(p[0]) or not _is_num(p[1]):
            raise ProfileError(f"{path}[{i}]: batch and seconds must be numbers, got {p!r}")
    try:
        return LatencyTable(v, name=path)
    except ValueError as e:
        raise ProfileError(str(e)) from None


def parse_profile(data: Any) -> Profile:
    """Validate a decoded profile JSON object and build a :class:`Profile`."""
    if not isinstance(data, dict):
        raise ProfileError(f"profile: expected a JSON object, got {type(data).__name__}")
    unknown = sorted(set(data) - _TOP_KEYS)
    if unknown:
        raise ProfileError(
            f"profile.{unknown[0]}: unknown key (expected one of {', '.join(sorted(_TOP_KEYS))})"
        )
    name = data.get("name", "profile")
    if not isinstance(name, str):
        raise ProfileError(f"profile.name: expected a string, got {name!r}")
    num_gpus = _int_field(data, "num_gpus", "profile")
    tps = data.get("tokens_per_seq")
    if tps is not None and (not _is_num(tps) or tps <= 0):
        raise ProfileError(f"profile.tokens_per_seq: expected a number > 0, got {tps!r}")

    theta_raw = data.get("theta", {})
    if not isinstance(theta_raw, dict):
        raise ProfileError(f"profile.theta: expected an object {{pp: theta}}, got {theta_raw!r}")
    theta = {
        _pp_key(k, f"profile.theta[{k!r}]"): _prob(v, f"profile.theta[{k!r}]")
        for k, v in theta_raw.items()
    }

    acc_raw = data.get("acceptance_by_rank", {})
    if not isinstance(acc_raw, dict):
        raise ProfileError(
            f"profile.acceptance_by_rank: expected an object {{pp: [acceptance, ...]}}, "
            f"got {acc_raw!r}"
        )
    acc: dict[int, RankAcceptanceProfile] = {}
    for k, v in acc_raw.items():
        path = f"profile.acceptance_by_rank[{k!r}]"
        pp = _pp_key(k, path)
        if not isinstance(v, list) or not v:
            raise ProfileError(f"{path}: expected a non-empty list of acceptance rates")
        prof = RankAcceptanceProfile(tuple(_prob(a, f"{path}[{i}]") for i, a in enumerate(v)))
        if pp in theta and abs(prof.theta - theta[pp]) > THETA_PROFILE_TOLERANCE:
            raise ProfileError(
                f"{path}: mean acceptance {prof.theta:.4f} disagrees with profile.theta"
                f"[{k!r}] = {theta[pp]:.4f} (allowed gap {THETA_PROFILE_TOLERANCE})"
            )
        acc[pp] = prof

    grid_raw = data.get("alpha_grid", list(DEFAULT_ALPHA_GRID))
    if not isinstance(grid_raw, list) or not grid_raw:
        raise ProfileError(f"profile.alpha_grid: expected a non-empty list, got {grid_raw!r}")
    grid = []
    for i, a in enumerate(grid_raw):
        if not _is_num(a) or not 0.0 <= a < 1.0:
            raise ProfileError(f"profile.alpha_grid[{i}]: expected a number in [0, 1), got {a!r}")
        grid.append(float(a))

    cfgs_raw = data.get("configs")
    if cfgs_raw is None:
        raise ProfileError("profile.configs: missing required key")
    if not isinstance(cfgs_raw, list) or not cfgs_raw:
        raise ProfileError("profile.configs: expected a non-empty list of configurations")
    configs: list[ConfigProfile] = []
    seen: dict[tuple[int, int], int] = {}
    for ci, c in enumerate(cfgs_raw):
        path = f"configs[{ci}]"
        if not isinstance(c, dict):
            raise ProfileError(f"{path}: expected an object, got {c!r}")
        unknown = sorted(set(c) - _CFG_KEYS)
        if unknown:
            raise ProfileError(
                f"{path}.{unknown[0]}: unknown key (expected one of {', '.join(sorted(_CFG_KEYS))})"
            )
        pp = _int_field(c, "pp", path)
        tp = _int_field(c, "tp", path)
        if pp * tp != num_gpus:
            raise ProfileError(
                f"{path}: pp * tp = {pp} * {tp} = {pp * tp} does not use profile.num_gpus = "
                f"{num_gpus} GPUs"
            )
        if (pp, tp) in seen:
            raise ProfileError(f"{path}: duplicate of configs[{seen[(pp, tp)]}] (pp={pp}, tp={tp})")
        seen[(pp, tp)] = ci
        has_b, has_kv = "max_batch" in c, "kv_capacity_tokens" in c
        if has_b == has_kv:
            raise ProfileError(
                f"{path}: give exactly one of max_batch (sequences) or kv_capacity_tokens"
            )
        if has_b:
            batch = _int_field(c, "max_batch", path)
        else:
            kv = c["kv_capacity_tokens"]
            if not _is_num(kv) or kv <= 0:
                raise ProfileError(f"{path}.kv_capacity_tokens: expected a number > 0, got {kv!r}")
            if tps is None:
                raise ProfileError(
                    f"{path}.kv_capacity_tokens: needs profile.tokens_per_seq to convert "
                    "tokens into sequences"
                )
            batch = int(kv // tps)
            if batch < 1:
                raise ProfileError(
                    f"{path}.kv_capacity_tokens: {kv} tokens hold no sequence of " f"{tps} tokens"
                )
        if "latency" not in c:
            raise ProfileError(f"{path}.latency: missing required key")
        lat = _latency(c["latency"], f"{path}.latency")
        if "latency_sp" in c:
            if pp == 1:
                raise ProfileError(f"{path}.latency_sp: only meaningful for pp >= 2")
            lat_sp = _latency(c["latency_sp"], f"{path}.latency_sp")
        else:
            lat_sp = lat
        if pp >= 2 and pp not in theta:
            raise ProfileError(
                f"profile.theta: missing entry for pp={pp} (needed to evaluate SP on {path})"
            )
        configs.append(ConfigProfile(pp, tp, batch, lat, lat_sp))
    return Profile(
        name=name,
        num_gpus=num_gpus,
        configs=tuple(configs),
        theta=theta,
        acceptance_by_rank=acc,
        alpha_grid=tuple(grid),
    )


def load_profile(path: str | os.PathLike[str]) -> Profile:
    """Read and validate a profile JSON file."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        raise ProfileError(f"{path}: no such file") from None
    except json.JSONDecodeError as e:
        raise ProfileError(f"{path}: not valid JSON ({e})") from None
    return parse_profile(data)


@dataclass(frozen=True)
class PlanRow:
    """One ranked configuration."""

    label: str
    mode: str  # TP | PP | SP | SP_alpha
    pp: int
    tp: int
    alpha: float
    theta: float | None
    batch: int
    rows: float  # rows per iteration (micro-batch for PP)
    effective: float  # tokens per iteration
    latency_s: float
    throughput: float  # tokens / s
    extrapolated: bool


def rank_configurations(profile: Profile, alpha_model: str = "paper") -> list[PlanRow]:
    """Evaluate every configuration of ``profile`` and sort by predicted throughput.

    ``alpha_model`` selects Eq. 3-4 (``"paper"``) or :func:`cost_model.sp_alpha_exact`
    (``"exact"``) for SP_alpha. Ties keep a deterministic order (pp, tp, mode, alpha).
    """
    rows: list[PlanRow] = []
    for c in profile.configs:
        b = c.max_batch
        if c.pp == 1:
            rows.append(
                PlanRow(
                    label=c.label,
                    mode="TP",
                    pp=1,
                    tp=c.tp,
                    alpha=0.0,
                    theta=None,
                    batch=b,
                    rows=b,
                    effective=b,
                    latency_s=c.latency(b),
                    throughput=throughput_tp(b, c.latency),
                    extrapolated=c.latency.extrapolates(b),
                )
            )
            continue
        n = c.pp
        mb = b / n
        rows.append(
            PlanRow(
                label=f"{c.label} PP",
                mode="PP",
                pp=n,
                tp=c.tp,
                alpha=0.0,
                theta=None,
                batch=b,
                rows=mb,
                effective=mb,
                latency_s=c.latency(mb),
                throughput=throughput_pp(b, n, c.latency),
                extrapolated=c.latency.extrapolates(mb),
            )
        )
        th = profile.theta[n]
        rows.append(
            PlanRow(
                label=f"{c.label} SP",
                mode="SP",
                pp=n,
                tp=c.tp,
                alpha=0.0,
                theta=th,
                batch=b,
                rows=b,
                effective=b_eff_star(b, n, th),
                latency_s=c.latency_sp(b),
                throughput=throughput_sp(b, n, th, c.latency_sp),
                extrapolated=c.latency_sp.extrapolates(b),
            )
        )
        prof = profile.acceptance_by_rank.get(n)
        if prof is not None:
            best, _ = choose_alpha(n, b, prof, c.latency_sp, profile.alpha_grid, alpha_model)
            if best.alpha > 0.0:
                rows.append(
                    PlanRow(
                        label=f"{c.label} SP a={best.alpha:.2f}",
                        mode="SP_alpha",
                        pp=n,
                        tp=c.tp,
                        alpha=best.alpha,
                        theta=best.theta_alpha,
                        batch=b,
                        rows=best.rows,
                        effective=best.effective,
                        latency_s=best.latency_s,
                        throughput=best.throughput,
                        extrapolated=c.latency_sp.extrapolates(best.rows),
                    )
                )
    mode_rank = {"TP": 0, "PP": 1, "SP": 2, "SP_alpha": 3}
    rows.sort(key=lambda r: (-r.throughput, r.pp, r.tp, mode_rank[r.mode], r.alpha))
    return rows


def format_table(rows: Sequence[PlanRow]) -> str:
    """Plain-text ranked table (``*`` marks latencies extrapolated beyond the profile)."""
    if not rows:
        return "(no configurations)"
    best = rows[0].throughput
    head = (
        f"{'rank':>4}  {'configuration':<22} {'alpha':>5} {'theta':>6} {'B':>6} "
        f"{'rows/it':>8} {'tok/it':>8} {'ms/it':>8} {'tok/s':>9} {'vs best':>7}"
    )
    lines = [head, "-" * len(head)]
    for i, r in enumerate(rows, 1):
        th = f"{r.theta:.3f}" if r.theta is not None else "-"
        mark = "*" if r.extrapolated else " "
        lines.append(
            f"{i:>4}  {r.label:<22} {r.alpha:>5.2f} {th:>6} {r.batch:>6} {r.rows:>8.1f} "
            f"{r.effective:>8.1f} {r.latency_s * 1e3:>7.2f}{mark} {r.throughput:>9.1f} "
            f"{r.throughput / best:>7.3f}"
        )
    return "\n".join(lines)
