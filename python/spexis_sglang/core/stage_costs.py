"""What one pipeline stage costs: GPU time per forward, host time per loop phase, transfers.

The pipeline simulator (``pipeline_sim``) consumes these as plain numbers; where they come
from is someone else's business (``spexis_sglang.planning.aic`` tabulates AIConfigurator's
measured operator tables into :class:`StageCosts`; tests build them by hand).

GPU time of a stage's forward (decode: ``rows`` rows at mean KV length ``ctx``; prefill:
``rows`` = prompt tokens in the batch)::

    T_stage = correction(rows, ctx)
              * ( layers * sum_c layer[c](rows, ctx)
                  + sum_{e in extras of the stage's role} extra[e](rows, ctx) )

The components keep their names so the simulator can say where a stage's time goes
(``gemm``, ``attention``, ``elementwise``, ``allreduce`` per layer; ``embedding``,
``lm_head``, ``sampling``, ``draft_head``, ``length_predictor`` once per stage). Which extras a
stage runs depends on its role: the first stage embeds (and under SP runs the draft head and
the length predictor), the last applies the final norm, the LM head and sampling.

Every component also carries the share of its time that is memory-bound (the rest is
compute-bound): a GPU shared by two processes (the emulated two-GPU box) slows the two parts
differently (``des.SharedDevice``).

Host costs are per phase of the scheduler loop, ``fixed + per_row * rows + per_layer *
layers`` seconds (``per_layer`` matters without CUDA graphs, when the host launches every
kernel); values come from the phase timers of our GPU runs.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Optional, Sequence

import numpy as np

__all__ = [
    "CostGrid",
    "StageCosts",
    "StagePlan",
    "HostPhase",
    "HostCosts",
    "LinkSpec",
    "DeviceSharing",
    "layer_split",
    "LAYER_COMPONENTS",
    "EXTRA_COMPONENTS",
]

#: Per-decoder-layer components (times one layer; a stage multiplies by its layer count).
LAYER_COMPONENTS = ("gemm", "attention", "elementwise", "allreduce")
#: Once-per-stage components and the roles that run them.
EXTRA_COMPONENTS = ("embedding", "lm_head", "sampling", "draft_head", "length_predictor")


class CostGrid:
    """Seconds on a ``rows x ctx`` grid.

    Between grid points: bilinear interpolation. Below the first ``rows``/``ctx``: the first
    value (a decode step does not get cheaper than its weight-bound floor). Above the last:
    linear extrapolation along the last segment in either axis (GEMMs grow about linearly
    once compute-bound; attention grows linearly in ``ctx``). ``mem_frac`` is the share of the
    time that is memory-bound: one value, or one per ``rows`` point (GEMMs turn compute-bound
    as the batch grows).
    """

    __slots__ = ("rows", "ctx", "seconds", "mem_frac")

    def __init__(
        self,
        rows: Sequence[float],
        ctx: Sequence[float],
        seconds: Any,
        mem_frac: float = 0.5,
    ) -> None:
        r = np.asarray(rows, dtype=float)
        c = np.asarray(ctx, dtype=float)
        s = np.asarray(seconds, dtype=float)
        if r.ndim != 1 or c.ndim != 1 or r.size < 1 or c.size < 1:
            raise ValueError("rows and ctx must be non-empty 1-d sequences")
        if np.any(np.diff(r) <= 0) or np.any(np.diff(c) <= 0):
            raise ValueError("rows and ctx must be strictly increasing")
        if s.shape != (r.size, c.size):
            raise ValueError(f"seconds must have shape {(r.size, c.size)}, got {s.shape}")
        if np.any(~np.isfinite(s)) or np.any(s < 0):
            raise ValueError("seconds must be finite and >= 0")
        mf = np.asarray(mem_frac, dtype=float)
        if mf.ndim == 0:
            mf = np.full(r.size, float(mf))
        if mf.shape != (r.size,) or np.any((mf < 0) | (mf > 1)) or np.any(np.isnan(mf)):
            raise ValueError("mem_frac must be one value or one per rows point, all in [0, 1]")
        self.rows = r
        self.ctx = c
        self.seconds = s
        self.mem_frac = mf

    @classmethod
    def constant(cls, seconds: float, mem_frac: float = 0.5) -> "CostGrid":
        return cls([1.0], [1.0], [[float(seconds)]], mem_frac)

    @staticmethod
    def _axis(x: float, grid: np.ndarray) -> tuple[int, int, float]:
        """Indices (i, j) and weight w of x between grid[i] and grid[j] (w may exceed 1 above)."""
        n = grid.size
        if n == 1 or x <= grid[0]:
            return 0, 0, 0.0
        if x >= grid[-1]:
            i, j = n - 2, n - 1
        else:
            j = int(np.searchsorted(grid, x, side="right"))
            i = j - 1
        return i, j, (x - grid[i]) / (grid[j] - grid[i])

    def __call__(self, rows: float, ctx: float = 1.0) -> float:
        i0, i1, wr = self._axis(float(rows), self.rows)
        j0, j1, wc = self._axis(float(ctx), self.ctx)
        s = self.seconds
        lo = s[i0, j0] + wc * (s[i0, j1] - s[i0, j0])
        hi = s[i1, j0] + wc * (s[i1, j1] - s[i1, j0])
        return max(0.0, float(lo + wr * (hi - lo)))

    def mem_frac_at(self, rows: float) -> float:
        return float(np.interp(float(rows), self.rows, self.mem_frac))

    def scaled(self, factor: float) -> "CostGrid":
        return CostGrid(self.rows, self.ctx, self.seconds * float(factor), self.mem_frac)

    def to_json(self) -> dict:
        return {
            "rows": self.rows.tolist(),
            "ctx": self.ctx.tolist(),
            "seconds": self.seconds.tolist(),
            "mem_frac": self.mem_frac.tolist(),
        }

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "CostGrid":
        return cls(d["rows"], d["ctx"], d["seconds"], d.get("mem_frac", 0.5))


def layer_split(num_layers: int, pp: int) -> list[int]:
    """Decoder layers per stage as SGLang splits them (the last ``remainder`` stages get one
    more)."""
    if pp < 1 or num_layers < pp:
        raise ValueError(f"cannot split {num_layers} layers over {pp} stages")
    base, rem = divmod(num_layers, pp)
    return [base + (1 if r >= pp - rem else 0) for r in range(pp)]


@dataclass(frozen=True)
class StagePlan:
    """One stage: how many decoder layers and which once-per-stage components it runs."""

    layers: int
    extras: tuple[str, ...]

    @staticmethod
    def for_pipeline(num_layers: int, pp: int, sp: bool) -> list["StagePlan"]:
        """Stage 0 embeds (and drafts under SP); the last stage samples."""
        split = layer_split(num_layers, pp)
        plans = []
        for r, n in enumerate(split):
            extras: list[str] = []
            if r == 0:
                extras.append("embedding")
                if sp:
                    extras += ["draft_head", "length_predictor"]
            if r == pp - 1:
                extras += ["lm_head", "sampling"]
            plans.append(StagePlan(n, tuple(extras)))
        return plans


@dataclass(frozen=True)
class StageCosts:
    """Per-component GPU time tables of one model on one system at one TP degree.

    ``decode`` and ``prefill`` map component names (:data:`LAYER_COMPONENTS` and
    :data:`EXTRA_COMPONENTS`) to :class:`CostGrid` s; a missing component costs nothing.
    ``correction`` multiplies the total (calibration against our own measurements; 1 when
    absent). ``source`` says where the numbers come from.
    """

    model: str
    num_layers: int
    hidden_size: int
    tp: int
    decode: Mapping[str, CostGrid]
    prefill: Mapping[str, CostGrid] = field(default_factory=dict)
    correction: Optional[CostGrid] = None
    act_bytes: int = 2
    source: str = ""

    def __post_init__(self) -> None:
        known = set(LAYER_COMPONENTS) | set(EXTRA_COMPONENTS)
        for table in (self.decode, self.prefill):
            unknown = sorted(set(table) - known)
            if unknown:
                raise ValueError(f"unknown cost component {unknown[0]!r} (known: {sorted(known)})")

    # -- composition --------------------------------------------------------------------
    def breakdown(
        self, plan: StagePlan, rows: float, ctx: float, phase: str = "decode"
    ) -> dict[str, float]:
        """Seconds per component for one forward of ``plan`` (correction applied)."""
        table = self.decode if phase == "decode" else self.prefill
        if rows <= 0:
            return {}
        corr = self.correction(rows, ctx) if self.correction is not None else 1.0
        out: dict[str, float] = {}
        for c in LAYER_COMPONENTS:
            g = table.get(c)
            if g is not None:
                out[c] = corr * plan.layers * g(rows, ctx)
        for c in plan.extras:
            g = table.get(c)
            if g is not None:
                out[c] = corr * g(rows, ctx)
        return out

    def stage_time(self, plan: StagePlan, rows: float, ctx: float, phase: str = "decode") -> float:
        return float(sum(self.breakdown(plan, rows, ctx, phase).values()))

    def mem_frac(self, plan: StagePlan, rows: float, ctx: float, phase: str = "decode") -> float:
        """Time-weighted memory-bound share of the stage's forward."""
        table = self.decode if phase == "decode" else self.prefill
        parts = self.breakdown(plan, rows, ctx, phase)
        total = sum(parts.values())
        if total <= 0:
            return 0.5
        return float(sum(t * table[c].mem_frac_at(rows) for c, t in parts.items()) / total)

    def with_correction(self, correction: Optional[CostGrid]) -> "StageCosts":
        return StageCosts(
            self.model,
            self.num_layers,
            self.hidden_size,
            self.tp,
            self.decode,
            self.prefill,
            correction,
            self.act_bytes,
            self.source,
        )

    def proxy_bytes(self, rows: float) -> float:
        """Bytes SGLang's PP sends downstream per batch: hidden states and residual."""
        return 2.0 * rows * self.hidden_size * self.act_bytes

    # -- JSON ---------------------------------------------------------------------------
    def to_json(self) -> dict:
        return {
            "model": self.model,
            "num_layers": self.num_layers,
            "hidden_size": self.hidden_size,
            "tp": self.tp,
            "act_bytes": self.act_bytes,
            "source": self.source,
            "decode": {k: g.to_json() for k, g in self.decode.items()},
            "prefill": {k: g.to_json() for k, g in self.prefill.items()},
            "correction": self.correction.to_json() if self.correction is not None else None,
        }

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "StageCosts":
        corr = d.get("correction")
        return cls(
            model=d["model"],
            num_layers=int(d["num_layers"]),
            hidden_size=int(d["hidden_size"]),
            tp=int(d.get("tp", 1)),
            decode={k: CostGrid.from_json(v) for k, v in d["decode"].items()},
            prefill={k: CostGrid.from_json(v) for k, v in d.get("prefill", {}).items()},
            correction=CostGrid.from_json(corr) if corr else None,
            act_bytes=int(d.get("act_bytes", 2)),
            source=d.get("source", ""),
        )

    def dumps(self) -> str:
        return json.dumps(self.to_json())


@dataclass(frozen=True)
class HostPhase:
    """Host seconds of one loop phase: ``fixed + per_row * rows + per_layer * layers``.

    With ``points`` (``(rows, seconds)`` pairs, rows increasing) the rows part is instead
    interpolated between measured points (flat outside them) and ``fixed``/``per_row`` are
    ignored: phase timers are not straight lines (``schedule`` 0.92 / 0.85 / 1.8 ms at
    B = 64 / 256 / 512 on the emulated box).
    """

    fixed: float = 0.0
    per_row: float = 0.0
    per_layer: float = 0.0
    points: tuple = ()

    def __post_init__(self) -> None:
        if self.points:
            r = [float(p[0]) for p in self.points]
            if any(b <= a for a, b in zip(r, r[1:])):
                raise ValueError("HostPhase.points: rows must increase strictly")

    def __call__(self, rows: float, layers: int = 0) -> float:
        if self.points:
            r = [float(p[0]) for p in self.points]
            v = [float(p[1]) for p in self.points]
            base = float(np.interp(float(rows), r, v))
        else:
            base = self.fixed + self.per_row * rows
        return max(0.0, base + self.per_layer * layers)

    @staticmethod
    def table(points: Iterable[Sequence[float]], per_layer: float = 0.0) -> "HostPhase":
        return HostPhase(points=tuple((float(r), float(s)) for r, s in points), per_layer=per_layer)

    @staticmethod
    def fit(points: Iterable[Sequence[float]]) -> "HostPhase":
        """Least-squares ``fixed + per_row * rows`` through ``(rows, seconds)`` points.

        One point gives a constant; a negative slope (noise) is clamped to a constant mean.
        """
        pts = [(float(r), float(s)) for r, s in points]
        if not pts:
            raise ValueError("no points to fit")
        if len(pts) == 1 or len({r for r, _ in pts}) == 1:
            return HostPhase(fixed=float(np.mean([s for _, s in pts])))
        r = np.array([p[0] for p in pts])
        s = np.array([p[1] for p in pts])
        slope, icpt = np.polyfit(r, s, 1)
        if slope < 0:
            return HostPhase(fixed=float(s.mean()))
        if icpt < 0:  # keep it non-negative at small batches: pass through the smallest point
            slope = float(np.max(s / r))
            icpt = 0.0
        return HostPhase(fixed=float(icpt), per_row=float(slope))

    def to_json(self) -> dict:
        d = {"fixed": self.fixed, "per_row": self.per_row, "per_layer": self.per_layer}
        if self.points:
            d["points"] = [list(p) for p in self.points]
        return d

    def scaled(self, f: float) -> "HostPhase":
        return HostPhase(
            self.fixed * f,
            self.per_row * f,
            self.per_layer * f,
            tuple((r, s * f) for r, s in self.points),
        )


#: Phases of each loop whose host time the simulator charges (``pipeline_sim`` docstring).
HOST_PHASES = {
    "pp": ("schedule", "launch", "sample", "recv_output", "process", "send"),
    "sp": ("schedule", "draft_sync", "launch", "sample", "recv_output", "process", "send"),
    "tp": ("schedule", "launch", "sample", "process"),
}


@dataclass(frozen=True)
class HostCosts:
    """Host time per loop phase, per loop kind (``pp``: stock PP, ``sp``, ``tp``: PP=1).

    ``phases[kind][phase]`` is a :class:`HostPhase`; a missing phase costs nothing. Rows are
    the batch's rows (a stock-PP micro-batch, all of SP's rows, the TP batch); prefill
    batches are charged as decode batches of as many rows as requests plus ``prefill_per_token``
    per prompt token. ``idle_poll`` is one idle pass of the loop (nothing to run).
    """

    phases: Mapping[str, Mapping[str, HostPhase]]
    prefill_per_token: float = 0.0
    idle_poll: float = 50e-6
    source: str = ""

    def cost(self, kind: str, phase: str, rows: float, layers: int = 0) -> float:
        p = self.phases.get(kind, {}).get(phase)
        return p(rows, layers) if p is not None else 0.0

    def scaled(self, factor: float) -> "HostCosts":
        """Every phase ``factor`` times as expensive (a faster or slower host)."""
        f = float(factor)
        return HostCosts(
            {k: {p: h.scaled(f) for p, h in v.items()} for k, v in self.phases.items()},
            self.prefill_per_token * f,
            self.idle_poll,
            self.source,
        )

    def to_json(self) -> dict:
        return {
            "phases": {k: {p: h.to_json() for p, h in v.items()} for k, v in self.phases.items()},
            "prefill_per_token": self.prefill_per_token,
            "idle_poll": self.idle_poll,
            "source": self.source,
        }

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "HostCosts":
        def phase(h: Mapping[str, Any]) -> HostPhase:
            h = dict(h)
            h["points"] = tuple(tuple(p) for p in h.get("points", ()))
            return HostPhase(**h)

        return cls(
            {k: {p: phase(h) for p, h in v.items()} for k, v in d["phases"].items()},
            float(d.get("prefill_per_token", 0.0)),
            float(d.get("idle_poll", 50e-6)),
            d.get("source", ""),
        )


@dataclass(frozen=True)
class LinkSpec:
    """Stage-to-stage transfer: ``latency + bytes / bandwidth`` on a FIFO link.

    ``meta_latency`` is when the receiving host learns that a message is coming (SGLang sends
    the tensors' metadata over a CPU group first): the receiver may launch its forward then,
    the forward itself waits for the data.
    """

    latency_s: float
    bandwidth_Bps: float
    meta_latency_s: float = 30e-6
    name: str = ""

    def transfer_s(self, nbytes: float) -> float:
        return self.latency_s + nbytes / self.bandwidth_Bps


@dataclass(frozen=True)
class DeviceSharing:
    """All stages on one GPU split by MPS (the emulated box); slowdowns against the whole GPU.

    ``compute[k]`` / ``memory[k]``: how much slower the compute-bound / memory-bound part of a
    kernel runs with ``k`` clients busy (index 0 unused, 1 = alone, 2 = both).
    """

    compute: tuple[float, ...]
    memory: tuple[float, ...]
    name: str = ""

    def alone(self, mem_frac: float) -> float:
        return mem_frac * self.memory[1] + (1 - mem_frac) * self.compute[1]

    def shared(self, mem_frac: float) -> float:
        return mem_frac * self.memory[2] + (1 - mem_frac) * self.compute[2]
