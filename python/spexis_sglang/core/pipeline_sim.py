"""Discrete-event simulator of SGLang's pipeline loop: stock PP, Spexis SP and TP (PP=1).

The closed forms of ``cost_model`` assume a stage time and nothing else. With CUDA graphs
the GPU part of a stage is short, and what decides the throughput is the *choreography*:
which host phases sit between one stage's forward and the next, when a batch's hidden states
leave for the next stage, when its sampled tokens come back, bubbles when a micro-batch
waits for its own previous step, acceptance that varies per request. This module plays the
loop out event by event, from numbers it is given (``stage_costs``: per-stage GPU time per
batch, host time per loop phase, transfer time per message).

What each rank does per iteration ``k`` (SGLang 0.5.17 ``event_loop_pp``; Spexis's
``event_loop_sp`` keeps the same order), with ``L = N + async_depth`` iterations in flight::

    schedule      stage 0 decides batch k (SP: after reading stage 0's drafts of k-1)
    [recv proxy]  later stages: host waits for batch k's metadata from the stage before
    launch        host launches the forward; the GPU runs it once its input has arrived
    exchange      last stage: send batch (k - depth)'s sampled tokens to stage 0;
                  others: forward the outputs received last iteration downstream
                  (depth > 0: the exchange comes before the launch)
    process       wait for batch (k - L + 1)'s outputs, then process them (verify under SP)
    send proxy    send batch k's hidden states downstream (``send_after_launch``: right
                  after the launch instead, the overlapped loop)

The GPU of each stage is a FIFO (``des.Stream``); a batch's forward starts when its input has
arrived and its launch was issued; without CUDA graphs it cannot end before the host has
launched its last kernel. Transfers are FIFO links. On the emulated two-GPU box every stage
runs on one GPU split by MPS (``des.SharedDevice``). TP=1 pipelines and TP inside a stage
differ only in the stage costs. PP=1 (mode ``tp``) runs SGLang's overlap loop: launch k,
then process k-1.

Batches. Stock PP keeps ``L`` micro-batches, each request in one; a micro-batch's next step
starts after its previous step's tokens were processed. SP puts every running request in
every iteration: a row is *normal* (verified input) or *speculative* (on stage 0's draft);
the last stage's token for a row comes back ``N - 1`` iterations later, and a wrong draft
makes the request's rows in flight stale (epochs, as ``core/sp_state``); with ``alpha > 0``
the least confident drafts wait for verification instead of riding (``core/selection``).
Per-row acceptance is a Bernoulli draw with the request's own Theta (optionally shaped by an
acceptance-by-confidence-rank profile). Prefill batches take a whole iteration (SGLang's
prefill-first scheduling); new requests are admitted while ``max_running`` and the KV
capacity (with SGLang's future-token reservation) allow.
"""

from __future__ import annotations

import functools
import logging
import math
from dataclasses import dataclass, field
from typing import Generator, Optional

import numpy as np

from .des import EventLoop, Link, Process, SharedDevice, Signal, SimulationError, Stream
from .selection import num_dropped
from .stage_costs import DeviceSharing, HostCosts, LinkSpec, StageCosts, StagePlan

logger = logging.getLogger(__name__)

__all__ = [
    "Deployment",
    "LoopSpec",
    "Machine",
    "AcceptanceModel",
    "DecodeWorkload",
    "ServingWorkload",
    "SimResult",
    "simulate",
    "simulate_decode_benchmark",
]

MODES = ("tp", "pp", "sp")


@dataclass(frozen=True)
class Deployment:
    """How the GPUs are used: ``mode`` ``tp`` (PP=1), ``pp`` (stock) or ``sp``; TP per stage."""

    mode: str
    pp: int = 1
    tp: int = 1
    alpha: float = 0.0

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.mode == "tp" and self.pp != 1:
            raise ValueError("mode 'tp' is PP=1 (use 'pp' or 'sp' for pipelines)")
        if self.mode in ("pp", "sp") and self.pp < 2:
            raise ValueError(f"mode {self.mode!r} needs pp >= 2")
        if not 0.0 <= self.alpha < 1.0:
            raise ValueError(f"alpha must lie in [0, 1), got {self.alpha}")
        if self.alpha > 0 and self.mode != "sp":
            raise ValueError("alpha (selective speculation) applies to mode 'sp' only")

    @property
    def gpus(self) -> int:
        return self.pp * self.tp

    @property
    def label(self) -> str:
        if self.mode == "tp":
            return f"TP{self.tp}"
        base = f"{'SP' if self.mode == 'sp' else 'PP'}{self.pp}" + (
            f"xTP{self.tp}" if self.tp > 1 else ""
        )
        return base + (f" a={self.alpha:.2f}" if self.alpha > 0 else "")


@dataclass(frozen=True)
class LoopSpec:
    """The loop's choreography.

    ``graphs``: CUDA graphs (a forward is one replay) or eager (the host launches every kernel
    and the forward cannot end before it has); ``async_depth``: stock PP's
    ``--pp-async-batch-depth`` (the output exchange moves before the launch and one more
    micro-batch is in flight); ``send_after_launch``: the hidden states leave right after the
    launch, before the host waits for and processes older outputs (the overlapped loop).
    ``device_verdicts`` (SP only; default: as ``send_after_launch``): Spexis's overlapped SP
    loop. Every rank builds and launches iteration ``k`` before it verifies ``k - N`` on the
    host (it verifies after the launch); stage 0's forward of ``k`` takes the true tokens of
    ``k - N`` on the device (a row whose chain they reject runs as the normal row), so that
    forward waits for those outputs to arrive, not for the host to process them. Which rows
    ``k`` holds and which are stale is what the serial loop gives (the host's
    bookkeeping of ``k - N`` is applied before ``k`` is composed).
    """

    graphs: bool = True
    async_depth: int = 0
    send_after_launch: bool = False
    device_verdicts: Optional[bool] = None

    def __post_init__(self) -> None:
        if self.async_depth not in (0, 1):
            raise ValueError("async_depth must be 0 or 1")

    @property
    def verdicts_on_device(self) -> bool:
        return self.send_after_launch if self.device_verdicts is None else self.device_verdicts


@dataclass(frozen=True)
class Machine:
    """The hardware and host: stage costs (at the deployment's TP), host costs, links."""

    costs: StageCosts
    host: HostCosts
    link: LinkSpec
    sharing: Optional[DeviceSharing] = None
    output_bytes_per_row: int = 16
    name: str = ""


@dataclass(frozen=True)
class AcceptanceModel:
    """Draft acceptance: a Theta per request, optionally shaped by confidence rank.

    ``rank_profile`` lists the acceptance of drafts by confidence bin, most confident first
    (e.g. deciles, ``quality_gpu_long.json``); a draft's bin is uniform. A request with Theta
    ``t`` accepts a draft of bin ``b`` with probability ``sigmoid(logit(profile[b]) + c_t)``,
    ``c_t`` chosen so that the mean over bins is ``t`` (the profile's shape, moved to the
    request's own acceptance). Without a profile every draft of the request is accepted with
    probability ``t`` (the benchmark's forced acceptance). Selective speculation drops the
    least confident drafts, so it needs a profile to gain anything.
    """

    theta: float = 0.76
    rank_profile: Optional[tuple[float, ...]] = None

    def __post_init__(self) -> None:
        if not 0.0 <= self.theta <= 1.0:
            raise ValueError(f"theta must lie in [0, 1], got {self.theta}")
        if self.rank_profile is not None:
            p = np.asarray(self.rank_profile, dtype=float)
            if p.ndim != 1 or p.size < 1 or np.any((p < 0) | (p > 1)) or p.mean() <= 0:
                raise ValueError("rank_profile must be acceptance rates in [0, 1], mean > 0")

    def profile_at(self, theta: float) -> np.ndarray:
        """Acceptance per confidence bin for a request whose mean acceptance is ``theta``."""
        return _shifted_profile(tuple(self.rank_profile), round(float(theta), 6))

    def accept_prob(self, theta: np.ndarray, conf_u: np.ndarray) -> np.ndarray:
        """Acceptance probability of drafts with confidence quantile ``conf_u`` (1 = surest)."""
        theta = np.asarray(theta, dtype=float)
        if self.rank_profile is None:
            return theta
        n = len(self.rank_profile)
        b = np.minimum((1.0 - conf_u) * n, n - 1).astype(np.int64)
        out = np.empty(theta.shape)
        for t in np.unique(theta):
            sel = theta == t
            out[sel] = self.profile_at(float(t))[b[sel]]
        return out


@functools.lru_cache(maxsize=4096)
def _shifted_profile(profile: tuple, theta: float) -> np.ndarray:
    """``sigmoid(logit(profile) + c)`` with ``c`` such that the mean is ``theta`` (bisection)."""
    p = np.clip(np.asarray(profile, dtype=float), 1e-4, 1 - 1e-4)
    lg = np.log(p / (1 - p))
    t = min(max(theta, 1e-4), 1 - 1e-4)
    lo, hi = -30.0, 30.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if np.mean(1 / (1 + np.exp(-(lg + mid)))) < t:
            lo = mid
        else:
            hi = mid
    out = 1 / (1 + np.exp(-(lg + (lo + hi) / 2)))
    out.setflags(write=False)
    return out


@dataclass(frozen=True)
class DecodeWorkload:
    """``batch`` prompts of ``context`` tokens sent at once, decoding without end.

    As in ``benchmark/gpu/decode_throughput.py``: the prompts are admitted by SGLang's
    prefill (``prefill_chunk`` tokens per prefill batch, at most ``max_running // pp``
    requests per stock-PP micro-batch), which decides how stock PP's micro-batches fill
    (64 prompts of 128 tokens fit one 8,192-token chunk: one micro-batch, the other empty).
    ``prefill_chunk=None`` skips prefill and spreads the requests evenly. The throughput is
    measured between stage 0's launches ``warmup`` and ``iterations``.
    """

    batch: int
    context: int = 128
    iterations: int = 300
    warmup: int = 60
    theta: Optional[float] = None  # default: the acceptance model's
    prefill_chunk: Optional[int] = 8192
    max_running: int = 512

    def __post_init__(self) -> None:
        if self.batch < 1 or self.context < 1:
            raise ValueError("batch and context must be >= 1")
        if not 0 <= self.warmup < self.iterations:
            raise ValueError("need 0 <= warmup < iterations")
        if self.batch > self.max_running:
            raise ValueError(f"batch {self.batch} exceeds max_running {self.max_running}")


@dataclass(frozen=True)
class ServingWorkload:
    """Requests arriving over time (seconds), with prompt and output lengths in tokens.

    ``theta`` (optional) is each request's own acceptance (e.g. drawn from the measured
    per-category acceptance of its dataset category). Admission: at most ``max_running``
    requests, prompts chunked to ``chunk_tokens`` per prefill batch, and a request is admitted
    while the KV pool holds its prompt plus ``reserve_ratio`` of every running request's
    remaining output (SGLang's new-token ratio).
    """

    arrival_s: np.ndarray
    prompt_len: np.ndarray
    output_len: np.ndarray
    theta: Optional[np.ndarray] = None
    max_running: int = 256
    kv_capacity_tokens: int = 10**9
    chunk_tokens: int = 8192
    reserve_ratio: float = 0.5

    def __post_init__(self) -> None:
        n = len(self.arrival_s)
        if n < 1 or len(self.prompt_len) != n or len(self.output_len) != n:
            raise ValueError("arrival_s, prompt_len and output_len need the same length >= 1")
        if self.theta is not None and len(self.theta) != n:
            raise ValueError("theta needs one value per request")
        if np.any(np.diff(np.asarray(self.arrival_s, dtype=float)) < 0):
            raise ValueError("arrival_s must be non-decreasing")
        if np.any(np.asarray(self.output_len) < 1) or np.any(np.asarray(self.prompt_len) < 1):
            raise ValueError("prompt and output lengths must be >= 1")


@dataclass
class SimResult:
    """What a simulated run reports; times in seconds unless the name says ms."""

    label: str
    mode: str
    pp: int
    tp: int
    alpha: float
    batch: float
    throughput_tok_s: float
    iteration_s: float
    rows_per_iteration: float
    tokens_per_iteration: float
    theta_measured: float
    stage_utilisation: list
    stage_gpu_ms: list
    phases_ms: dict
    gpu_breakdown_ms: dict
    link_utilisation: list
    serving: dict = field(default_factory=dict)
    events: int = 0

    def to_json(self) -> dict:
        return dict(self.__dict__)


# --------------------------------------------------------------------------------------
# Batches and the policies that build them (stage 0's decisions)
# --------------------------------------------------------------------------------------


class _Batch:
    __slots__ = ("k", "kind", "rows", "tokens", "ctx", "reqs", "spec", "epoch", "wrong", "mb")

    def __init__(self, k: int, kind: str, reqs: np.ndarray, tokens: int, ctx: float, mb: int):
        self.k = k
        self.kind = kind
        self.reqs = reqs
        self.rows = int(reqs.size)
        self.tokens = int(tokens)
        self.ctx = float(ctx)
        self.mb = mb
        self.spec = self.epoch = self.wrong = None


class _Requests:
    """Per-request arrays and the admission queue, shared by every policy."""

    def __init__(self, n: int, prompt, output, theta, arrival) -> None:
        self.n = n
        self.prompt = np.asarray(prompt, dtype=np.int64)
        self.output = np.asarray(output, dtype=np.float64)  # inf: never finishes
        self.theta = np.asarray(theta, dtype=np.float64)
        self.arrival = np.asarray(arrival, dtype=np.float64)
        self.committed = np.zeros(n, dtype=np.int64)
        self.prefilled = np.zeros(n, dtype=np.int64)
        self.first_token = np.full(n, np.nan)
        self.finish = np.full(n, np.nan)
        self.running = np.zeros(n, dtype=bool)
        self.next_arrival = 0  # index of the next request not yet queued
        self.queue: list[int] = []
        self.chunked: Optional[int] = None
        self.done = 0

    def kv_len(self, idx: np.ndarray) -> np.ndarray:
        return self.prompt[idx] + self.committed[idx]


@dataclass(frozen=True)
class _Admission:
    chunk: int
    max_running: int
    per_slot: int  # stock PP: SGLang's pp_max_micro_batch_size (max_running // pp)
    kv_capacity: float
    reserve_ratio: float


class _Policy:
    """Stage 0's scheduling decisions and result processing (subclasses per mode)."""

    def __init__(self, sim: "_Sim", reqs: _Requests, adm: Optional[_Admission]) -> None:
        self.sim = sim
        self.r = reqs
        self.adm = adm
        self.committed_log: list = []  # (time, tokens) per processed decode batch
        self.rows_log: list = []  # (k, rows, tokens_effective) per processed decode batch
        self.outstanding = 0  # launched batches not yet processed

    # -- admission ---------------------------------------------------------------------
    def _arrive(self, now: float) -> None:
        r = self.r
        while r.next_arrival < r.n and r.arrival[r.next_arrival] <= now:
            r.queue.append(r.next_arrival)
            r.next_arrival += 1

    def _kv_used(self) -> float:
        r = self.r
        run = np.flatnonzero(r.running)
        used = float((r.prompt[run] + r.committed[run]).sum())
        left = np.minimum(r.output[run] - r.committed[run], 1e9)
        return used + self.adm.reserve_ratio * float(left.sum())

    def _slot_room(self, mb: int) -> int:
        return 1 << 62

    def _admit(self, k: int, mb: int) -> Optional[_Batch]:
        """A prefill batch of queued requests (SGLang admits prefill first), or None."""
        adm = self.adm
        if adm is None:
            return None
        r = self.r
        self._arrive(self.sim.loop.now)
        if not r.queue and r.chunked is None:
            return None
        budget = adm.chunk
        room = self._slot_room(mb)
        n_run = int(r.running.sum()) + self._prefilling()
        taken: list[int] = []
        tokens = 0
        ctx_sum = 0.0
        used = self._kv_used()
        if r.chunked is not None:
            i = r.chunked
            chunk = min(budget, int(r.prompt[i] - r.prefilled[i]))
            r.prefilled[i] += chunk
            tokens += chunk
            ctx_sum += r.prefilled[i]
            taken.append(i)
            r.chunked = None if r.prefilled[i] >= r.prompt[i] else i
            budget -= chunk
        while r.queue and budget > 0 and r.chunked is None and room > 0:
            i = r.queue[0]
            if n_run + 1 > adm.max_running:
                break
            need = float(r.prompt[i]) + adm.reserve_ratio * float(min(r.output[i], 1e9))
            if used + need > adm.kv_capacity:
                break
            room -= 1
            r.queue.pop(0)
            chunk = min(budget, int(r.prompt[i]))
            r.prefilled[i] = chunk
            tokens += chunk
            ctx_sum += chunk
            taken.append(i)
            used += need
            n_run += 1
            budget -= chunk
            if chunk < r.prompt[i]:
                r.chunked = i
        if not taken:
            return None
        b = _Batch(
            k, "prefill", np.asarray(taken, dtype=np.int64), tokens, ctx_sum / len(taken), mb
        )
        self._on_prefill_launch(b)
        return b

    def _prefilling(self) -> int:
        return 0

    def _on_prefill_launch(self, b: _Batch) -> None:
        pass

    def _prefill_done(self, b: _Batch, now: float) -> np.ndarray:
        """Requests whose whole prompt is in: their first token is out; they start decoding."""
        r = self.r
        full = b.reqs[r.prefilled[b.reqs] >= r.prompt[b.reqs]]
        r.first_token[full] = now
        r.committed[full] = 1
        r.running[full] = True
        fin = full[r.committed[full] >= r.output[full]]
        if fin.size:
            self._finish(fin, now)
        return full[r.committed[full] < r.output[full]]

    def _finish(self, idx: np.ndarray, now: float) -> None:
        r = self.r
        r.finish[idx] = now
        r.running[idx] = False
        r.done += idx.size

    def idle(self) -> bool:
        r = self.r
        return (
            self.outstanding == 0
            and not r.running.any()
            and not r.queue
            and r.chunked is None
            and self._prefilling() == 0
        )

    def all_done(self) -> bool:
        return self.r.done >= self.r.n

    def next_batch(self, k: int) -> Optional[_Batch]:
        raise NotImplementedError

    def process(self, b: _Batch, now: float) -> None:
        raise NotImplementedError


class _MicroBatchPolicy(_Policy):
    """Stock PP (``L`` micro-batches) and TP (one batch): one token per request per step."""

    def __init__(self, sim, reqs, adm, slots: int) -> None:
        super().__init__(sim, reqs, adm)
        self.slots: list[list[int]] = [[] for _ in range(slots)]
        self.pending = [0] * slots  # requests prefilling into each slot
        self.L = slots

    def _slot_room(self, mb: int) -> int:
        return self.adm.per_slot - len(self.slots[mb]) - self.pending[mb]

    def seed(self, idx: np.ndarray) -> None:
        for j, i in enumerate(idx.tolist()):
            self.slots[j % self.L].append(i)
        self.r.running[idx] = True

    def _prefilling(self) -> int:
        return sum(self.pending)

    def next_batch(self, k: int) -> Optional[_Batch]:
        m = k % self.L
        b = self._admit(k, m)
        if b is not None:
            self.pending[m] += b.rows
            return b
        ids = self.slots[m]
        if not ids:
            return None
        idx = np.asarray(ids, dtype=np.int64)
        return _Batch(k, "decode", idx, idx.size, float(self.r.kv_len(idx).mean()), m)

    def process(self, b: _Batch, now: float) -> None:
        r = self.r
        if b.kind == "prefill":
            self.pending[b.mb] -= b.rows
            started = self._prefill_done(b, now)
            self.slots[b.mb].extend(started.tolist())
            return
        live = b.reqs[r.running[b.reqs]]
        r.committed[live] += 1
        self.committed_log.append((now, int(live.size)))
        self.rows_log.append((b.k, b.rows, int(live.size)))
        fin = live[r.committed[live] >= r.output[live]]
        if fin.size:
            self._finish(fin, now)
            gone = set(fin.tolist())
            self.slots[b.mb] = [i for i in self.slots[b.mb] if i not in gone]


class _SPPolicy(_Policy):
    """Speculative parallelism: every running request rides every iteration (design.md §2)."""

    def __init__(self, sim, reqs, adm, num_stages: int, alpha: float, acc: AcceptanceModel, rng):
        super().__init__(sim, reqs, adm)
        n = reqs.n
        self.N = num_stages
        self.alpha = alpha
        self.acc = acc
        self.rng = rng
        self.need = np.zeros(n, dtype=bool)  # needs a normal row (verified input)
        self.wait = np.zeros(n, dtype=bool)  # draft dropped: waits for verification
        self.epoch = np.zeros(n, dtype=np.int64)
        self.inflight = np.zeros(n, dtype=np.int64)  # current-epoch rows not yet verified
        self.last_row: dict[int, np.ndarray] = {}  # k -> requests with a row in decode batch k
        self.n_prefill = 0
        self.drops = 0
        self.candidates = 0
        self.accepted = 0
        self.rejected = 0

    def seed(self, idx: np.ndarray) -> None:
        self.r.running[idx] = True
        self.need[idx] = True

    def _prefilling(self) -> int:
        return self.n_prefill

    def _on_prefill_launch(self, b: _Batch) -> None:
        self.n_prefill += b.rows

    def next_batch(self, k: int) -> Optional[_Batch]:
        b = self._admit(k, 0)
        if b is not None:
            return b
        r = self.r
        run = r.running
        # a request whose committed tokens plus rows in flight reach its end launches nothing
        room = (r.committed + self.inflight) < r.output
        need = self.need & run & room
        have = run & ~self.need & ~self.wait & room
        conf_have = None  # confidence quantiles of the kept drafts, in request order
        if self.alpha > 0:
            cand = np.flatnonzero(have)
            self.candidates += cand.size
            conf = self.rng.random(cand.size)
            nd = num_dropped(cand.size, self.alpha)
            keep = np.ones(cand.size, dtype=bool)
            if nd:
                keep[np.argpartition(conf, nd - 1)[:nd]] = False
                drop = cand[~keep]
                have[drop] = False
                self.wait[drop] = True
                self.drops += nd
            conf_have = conf[keep]
        rows = np.flatnonzero(need | have)
        if rows.size == 0:
            return None
        spec = have[rows]
        b = _Batch(k, "decode", rows, rows.size, float(r.kv_len(rows).mean()), 0)
        b.spec = spec
        b.epoch = self.epoch[rows].copy()
        wrong = np.zeros(rows.size, dtype=bool)
        ns = int(spec.sum())
        if ns:
            sidx = rows[spec]  # = np.flatnonzero(have): the order of conf_have
            u_conf = conf_have if conf_have is not None else self.rng.random(ns)
            p = self.acc.accept_prob(r.theta[sidx], u_conf)
            wrong[spec] = self.rng.random(ns) >= p
        b.wrong = wrong
        self.need[rows] = False
        self.inflight[rows] += 1
        self.last_row[k] = rows
        return b

    def process(self, b: _Batch, now: float) -> None:
        r = self.r
        if b.kind == "prefill":
            self.n_prefill -= b.rows
            started = self._prefill_done(b, now)
            self.need[started] = True
            self.wait[started] = False
            return
        rows = b.reqs
        cur = (b.epoch == self.epoch[rows]) & r.running[rows]
        self.inflight[rows[cur]] -= 1
        valid = rows[cur]
        n_valid = int(valid.size)
        acc_rows = int((cur & b.spec).sum())
        self.accepted += acc_rows
        r.committed[valid] += 1
        self.committed_log.append((now, n_valid))
        self.rows_log.append((b.k, b.rows, n_valid))
        # the request's next row (batch k+1): a wrong draft makes it and later rows stale
        nxt = self.last_row.get(b.k + 1)
        has_next = np.zeros(r.n, dtype=bool)
        wrong_next = np.zeros(r.n, dtype=bool)
        nb = self.sim.batches.get(b.k + 1)
        if nxt is not None and nb is not None and nb.kind == "decode":
            ok = nb.epoch == self.epoch[nxt]
            has_next[nxt[ok]] = True
            wrong_next[nxt[ok & nb.wrong]] = True
        reject = np.zeros(r.n, dtype=bool)
        reject[valid] = wrong_next[valid]
        trigger = reject.copy()
        trigger[valid] |= ~has_next[valid]
        if reject.any():
            self.rejected += int(reject.sum())
            self.epoch[reject] += 1
            self.inflight[reject] = 0
        self.need |= trigger
        self.wait &= ~trigger
        self.last_row.pop(b.k - 1, None)
        fin = valid[r.committed[valid] >= r.output[valid]]
        if fin.size:
            self._finish(fin, now)
            self.epoch[fin] += 1  # rows still in flight drain as stale
            self.inflight[fin] = 0
            self.need[fin] = False
            self.wait[fin] = False


# --------------------------------------------------------------------------------------
# The simulation
# --------------------------------------------------------------------------------------


class _Sim:
    def __init__(
        self,
        dep: Deployment,
        loop_spec: LoopSpec,
        machine: Machine,
        workload,
        acc: AcceptanceModel,
        seed: int,
    ) -> None:
        self.dep = dep
        self.spec = loop_spec
        self.m = machine
        self.wl = workload
        self.loop = EventLoop()
        self.N = dep.pp
        self.L = dep.pp + (loop_spec.async_depth if dep.mode == "pp" else 0)
        self.plans = StagePlan.for_pipeline(machine.costs.num_layers, dep.pp, dep.mode == "sp")
        if machine.costs.tp != dep.tp:
            raise ValueError(
                f"stage costs are for TP={machine.costs.tp}, the deployment has TP={dep.tp}"
            )
        device = None
        if machine.sharing is not None:
            sh = machine.sharing
            device = SharedDevice(self.loop, sh.compute, sh.memory)
        self.streams = [Stream(self.loop, device, name=f"gpu{r}") for r in range(self.N)]
        for s in self.streams:
            s.log = []
        lk = machine.link
        self.proxy_links = [
            Link(self.loop, lk.latency_s, lk.bandwidth_Bps, f"proxy{r}") for r in range(self.N)
        ]
        self.out_links = [
            Link(self.loop, lk.latency_s, lk.bandwidth_Bps, f"out{r}") for r in range(self.N)
        ]
        for link in self.proxy_links + self.out_links:
            link.stream.log = []
        self.batches: dict[int, Optional[_Batch]] = {}
        self._signals: dict = {}
        self.rng = np.random.default_rng(seed)
        self.phase_acc = [dict() for _ in range(self.N)]
        self.launch_times: list[float] = []
        self.gpu_parts: list[dict] = [dict() for _ in range(self.N)]
        self.stopping = False
        self.rank_iter = [0] * self.N
        self._gc_done = -1
        self._cost_memo: dict = {}
        self._host_memo: dict = {}
        # requests
        if isinstance(workload, DecodeWorkload):
            n = workload.batch
            th = acc.theta if workload.theta is None else workload.theta
            self.reqs = _Requests(
                n,
                np.full(n, workload.context),
                np.full(n, np.inf),
                np.full(n, th),
                np.zeros(n),
            )
        else:
            n = len(workload.arrival_s)
            th = workload.theta if workload.theta is not None else np.full(n, acc.theta)
            self.reqs = _Requests(
                n, workload.prompt_len, workload.output_len, th, workload.arrival_s
            )
        if isinstance(workload, DecodeWorkload):
            adm = None
            if workload.prefill_chunk is not None:
                per_slot = max(1, workload.max_running // dep.pp)
                adm = _Admission(
                    workload.prefill_chunk, workload.max_running, per_slot, math.inf, 0.0
                )
        else:
            per_slot = max(1, workload.max_running // dep.pp)
            adm = _Admission(
                workload.chunk_tokens,
                workload.max_running,
                per_slot,
                float(workload.kv_capacity_tokens),
                workload.reserve_ratio,
            )
        if dep.mode == "sp":
            self.policy: _Policy = _SPPolicy(self, self.reqs, adm, self.N, dep.alpha, acc, self.rng)
        else:
            slots = self.L if dep.mode == "pp" else 1
            self.policy = _MicroBatchPolicy(self, self.reqs, adm, slots)
        if adm is None:
            self.policy.seed(np.arange(self.reqs.n))
        self.kind = dep.mode

    # -- helpers ---------------------------------------------------------------------------
    def sig(self, name: str, r: int, k: int) -> Signal:
        key = (name, r, k)
        s = self._signals.get(key)
        if s is None:
            s = self._signals[key] = Signal(self.loop, f"{name}[{r}][{k}]")
        return s

    def _charge(self, r: int, phase: str, dt: float) -> None:
        if self._measuring():
            acc = self.phase_acc[r]
            acc[phase] = acc.get(phase, 0.0) + dt

    def _measuring(self) -> bool:
        wl = self.wl
        if isinstance(wl, DecodeWorkload):
            return wl.warmup <= len(self.launch_times) <= wl.iterations
        return True

    def host(self, r: int, phase: str, b: Optional[_Batch]) -> float:
        kind = self.kind
        layers = self.plans[r].layers
        if b is None:
            dt = self.m.host.idle_poll if phase == "schedule" else 0.0
        else:
            key = (phase, b.rows, layers)
            dt = self._host_memo.get(key)
            if dt is None:
                dt = self._host_memo[key] = self.m.host.cost(kind, phase, b.rows, layers)
            if b.kind == "prefill" and phase in ("schedule", "launch", "process"):
                dt += self.m.host.prefill_per_token * b.tokens
        self._charge(r, phase, dt)
        return dt

    def _wait(self, r: int, phase: str, s: Signal) -> Generator:
        t0 = self.loop.now
        yield s
        self._charge(r, phase, self.loop.now - t0)

    def gpu_time(self, r: int, b: _Batch) -> tuple[float, float]:
        phase = "prefill" if b.kind == "prefill" else "decode"
        rows = b.tokens if b.kind == "prefill" else b.rows
        # KV lengths within 8 tokens of each other cost the same (a memo, not a model)
        key = (r, phase, rows, int(b.ctx) // 8)
        hit = self._cost_memo.get(key)
        if hit is None:
            costs, plan = self.m.costs, self.plans[r]
            parts = costs.breakdown(plan, rows, 8 * key[3] + 4, phase)
            table = costs.decode if phase == "decode" else costs.prefill
            total = float(sum(parts.values()))
            mf = (
                sum(t * table[c].mem_frac_at(rows) for c, t in parts.items()) / total
                if total > 0
                else 0.5
            )
            hit = self._cost_memo[key] = (parts, total, mf)
        parts, total, mf = hit
        if self._measuring():
            acc = self.gpu_parts[r]
            for c, t in parts.items():
                acc[c] = acc.get(c, 0.0) + t
        return total, mf

    def _launch(self, r: int, k: int, b: _Batch) -> Generator:
        """The launch phase and the GPU job (graphs: one replay at its end; eager: kernels
        issued during it, so the forward cannot end before the phase does)."""
        dur, mf = self.gpu_time(r, b)
        inputs = [self.sig("proxy_data", r, k)] if r > 0 else []
        done = self.sig("gpu", r, k)
        last = r == self.N - 1
        if self.spec.graphs:
            yield self.host(r, "launch", b)
            self.streams[r].submit(dur, after=inputs, mem_frac=mf, tag=k, done=done)
            if last:  # sampling runs outside the graph: the host launches it after the replay
                yield self.host(r, "sample", b)
        else:
            issued = Signal(self.loop)
            self.streams[r].submit(dur, after=inputs, min_end=issued, mem_frac=mf, tag=k, done=done)
            yield self.host(r, "launch", b)
            if last:
                yield self.host(r, "sample", b)
            issued.fire()
        if r == 0:
            self.launch_times.append(self.loop.now)
            self.policy.outstanding += 1

    def _send_proxy(self, r: int, k: int, b: _Batch) -> Generator:
        yield self.host(r, "send", b)
        self.sig("proxy_meta", r + 1, k).fire(self.loop.now + self.m.link.meta_latency_s)
        self.proxy_links[r].send(
            self.m.costs.proxy_bytes(b.rows),
            after=[self.sig("gpu", r, k)],
            tag=k,
            done=self.sig("proxy_data", r + 1, k),
        )

    def _exchange(self, r: int, k: int, fwd: list) -> None:
        N = self.N
        ob = self.m.output_bytes_per_row
        if r == N - 1:
            s = k - (self.spec.async_depth if self.kind == "pp" else 0)
            bs = self.batches.get(s)
            if bs is not None:
                self.out_links[r].send(
                    ob * bs.rows, after=[self.sig("gpu", r, s)], tag=s, done=self.sig("out", 0, s)
                )
        elif fwd:
            j = fwd.pop()
            bj = self.batches[j]
            self.out_links[r].send(
                ob * bj.rows, after=[self.sig("out", r, j)], tag=j, done=self.sig("out", r + 1, j)
            )

    # -- rank loops ------------------------------------------------------------------------
    def _decide(self, k: int) -> Optional[_Batch]:
        b = self.policy.next_batch(k)
        self.batches[k] = b
        self.sig("decided", 0, k).fire()
        return b

    def rank(self, r: int) -> Generator:
        if self.kind == "sp" and self.spec.verdicts_on_device:
            yield from self.rank_device_verdicts(r)
            return
        N, L = self.N, self.L
        last = r == N - 1
        depth = self.spec.async_depth if self.kind == "pp" else 0
        fwd: list = []
        k = 0
        while not self.stopping:
            if r == 0:
                if self.kind == "sp" and k > 0:
                    prev = self.batches.get(k - 1)
                    if prev is not None and prev.kind == "decode":
                        yield from self._wait(r, "wait_draft", self.sig("gpu", 0, k - 1))
                        yield self.host(r, "draft_sync", prev)
                yield from self._idle_until_arrival(r)
                if self.stopping:
                    return
                b = self._decide(k)
            else:
                yield from self._wait(r, "wait_decision", self.sig("decided", 0, k))
                b = self.batches[k]
            yield self.host(r, "schedule", b)
            if b is not None and r > 0:
                yield from self._wait(r, "wait_proxy", self.sig("proxy_meta", r, k))
            if depth:
                self._exchange(r, k, fwd)
            if b is not None:
                yield from self._launch(r, k, b)
                if not last and self.spec.send_after_launch:
                    yield from self._send_proxy(r, k, b)
            if not depth:
                self._exchange(r, k, fwd)
            j = k - L + 1
            bj = self.batches.get(j) if j >= 0 else None
            if bj is not None:
                yield from self._wait(r, "wait_output", self.sig("out", r, j))
                yield self.host(r, "recv_output", bj)
                yield self.host(r, "process", bj)
                if r == 0:
                    self.policy.process(bj, self.loop.now)
                    self.policy.outstanding -= 1
                    self._after_process()
                if not last:
                    fwd.append(j)
            if b is not None and not last and not self.spec.send_after_launch:
                yield from self._send_proxy(r, k, b)
            k += 1
            self.rank_iter[r] = k
            if r == 0:
                self._gc(min(self.rank_iter) - 2 * L - 2)

    def rank_device_verdicts(self, r: int) -> Generator:
        """Spexis's overlapped SP loop (``LoopSpec.device_verdicts``), rank ``r``.

        Iteration ``k``: (stage 0: read the drafts of ``k - 1`` only when alpha > 0) schedule,
        launch ``k`` and send its proxy (the last stage: its outputs) without waiting for the
        outputs of ``k - N``; then verify ``k - N`` on the host. Stage 0's forward of ``k``
        starts once the outputs of ``k - N`` are on its device, so the host's schedule and
        launch of ``k`` (charged with the previous batch's rows) overlap the forwards in flight.
        """
        N, L = self.N, self.L
        last = r == N - 1
        fwd: list = []
        k = 0
        prev: Optional[_Batch] = None  # the host prices its phases by the last batch built
        while not self.stopping:
            j = k - L
            bj = self.batches.get(j) if j >= 0 else None
            if r == 0:
                pk = self.batches.get(k - 1) if k > 0 else None
                if pk is not None and pk.kind == "decode":
                    if self.dep.alpha > 0:  # the host drops drafts by their confidence
                        yield from self._wait(r, "wait_draft", self.sig("gpu", 0, k - 1))
                    yield self.host(r, "draft_sync", pk)
                yield self.host(r, "schedule", prev)
                yield self.host(r, "launch", prev)
                if bj is not None:
                    # the device takes the true tokens of k - N: the forward of k waits for
                    # them; the bookkeeping they decide is applied before k is composed
                    yield from self._wait(r, "wait_output", self.sig("out", r, j))
                    self.policy.process(bj, self.loop.now)
                    self.policy.outstanding -= 1
                    self._after_process()
                    if self.stopping:
                        return
                    fwd.append(j)
                yield from self._idle_until_arrival(r)
                if self.stopping:
                    return
                b = self._decide(k)
                if b is not None:
                    self._submit(r, k, b)
                    if not last:
                        yield from self._send_proxy(r, k, b)
                self._exchange(r, k, fwd)
                if bj is not None:
                    yield self.host(r, "recv_output", bj)
                    yield self.host(r, "process", bj)
            else:
                yield from self._wait(r, "wait_decision", self.sig("decided", 0, k))
                b = self.batches[k]
                yield self.host(r, "schedule", b)
                if b is not None:
                    yield from self._wait(r, "wait_proxy", self.sig("proxy_meta", r, k))
                    yield from self._launch(r, k, b)
                    if not last:
                        yield from self._send_proxy(r, k, b)
                self._exchange(r, k, fwd)
                if bj is not None:
                    yield from self._wait(r, "wait_output", self.sig("out", r, j))
                    yield self.host(r, "recv_output", bj)
                    yield self.host(r, "process", bj)
                    if not last:
                        fwd.append(j)
            if b is not None:
                prev = b
            k += 1
            self.rank_iter[r] = k
            if r == 0:
                self._gc(min(self.rank_iter) - 2 * L - 2)

    def _idle_until_arrival(self, r: int) -> Generator:
        """Stage 0 with nothing running under admission: stop once every request is done
        (``stopping``), else sleep until the next one arrives."""
        if self.policy.idle() and self.policy.adm is not None:
            if self.policy.all_done():
                self.stopping = True
                return
            yield from self._sleep_until_arrival(r)

    def _submit(self, r: int, k: int, b: _Batch) -> None:
        """Stage 0's forward of ``k`` with its launch already charged (graphs: one replay)."""
        dur, mf = self.gpu_time(r, b)
        self.streams[r].submit(dur, mem_frac=mf, tag=k, done=self.sig("gpu", r, k))
        self.launch_times.append(self.loop.now)
        self.policy.outstanding += 1

    def single(self) -> Generator:
        """PP=1: SGLang's overlap loop (launch k, then process k-1)."""
        k = 0
        while not self.stopping:
            yield from self._idle_until_arrival(0)
            if self.stopping:
                return
            b = self._decide(k)
            yield self.host(0, "schedule", b)
            if b is not None:
                yield from self._launch(0, k, b)
            bj = self.batches.get(k - 1) if k > 0 else None
            if bj is not None:
                yield from self._wait(0, "wait_output", self.sig("gpu", 0, k - 1))
                yield self.host(0, "process", bj)
                self.policy.process(bj, self.loop.now)
                self.policy.outstanding -= 1
                self._after_process()
            k += 1
            self._gc(k - 4)

    def _sleep_until_arrival(self, r: int) -> Generator:
        """Nothing runs and nothing is queued: the loop idles until the next request."""
        req = self.reqs
        if req.next_arrival < req.n:
            nxt = float(req.arrival[req.next_arrival])
            if nxt > self.loop.now:
                self._charge(r, "idle", nxt - self.loop.now)
                yield nxt - self.loop.now

    def _after_process(self) -> None:
        wl = self.wl
        if isinstance(wl, DecodeWorkload):
            if len(self.launch_times) > wl.iterations + self.L:
                self.stopping = True
        elif self.policy.all_done():
            self.stopping = True

    def _gc(self, k: int) -> None:
        """Forget batches and signals up to ``k`` (every rank is past them)."""
        if k < 0 or k <= self._gc_done:
            return
        for j in range(self._gc_done + 1, k + 1):
            self.batches.pop(j, None)
        self._gc_done = k
        for key in [key for key in self._signals if key[2] <= k]:
            del self._signals[key]

    # -- run -------------------------------------------------------------------------------
    def run(self) -> SimResult:
        if self.kind == "tp":
            Process(self.loop, self.single(), "rank0")
        else:
            for r in range(self.N):
                Process(self.loop, self.rank(r), f"rank{r}")
        self.loop.run(stop=lambda: self.stopping)
        if not self.stopping:
            raise SimulationError(
                f"{self.dep.label}: the simulated loop stalled at t={self.loop.now:.4f}s "
                f"after {len(self.launch_times)} launches (a deadlock in the choreography)"
            )
        return self._result()

    def _window(self) -> tuple[float, float, int]:
        wl = self.wl
        lt = self.launch_times
        if isinstance(wl, DecodeWorkload):
            a, b = wl.warmup, min(wl.iterations, len(lt) - 1)
            return lt[a], lt[b], b - a
        return 0.0, self.loop.now, len(lt)

    def _result(self) -> SimResult:
        t0, t1, iters = self._window()
        span = max(t1 - t0, 1e-12)
        pol = self.policy
        toks = sum(n for t, n in pol.committed_log if t0 <= t < t1)
        rows_in = [(rows, eff) for k, rows, eff in pol.rows_log]
        if isinstance(self.wl, DecodeWorkload):
            a = self.wl.warmup
            rows_in = [(rows, eff) for k, rows, eff in pol.rows_log if a <= k < self.wl.iterations]
        rows_pi = float(np.mean([x[0] for x in rows_in])) if rows_in else 0.0
        eff_pi = float(np.mean([x[1] for x in rows_in])) if rows_in else 0.0
        util = []
        gpu_ms = []
        for s in self.streams:
            busy = 0.0
            n = 0
            for _, a, b in s.log:
                lo, hi = max(a, t0), min(b, t1)
                if hi > lo:
                    busy += hi - lo
                if t0 <= a < t1:
                    n += 1
            util.append(busy / span)
            gpu_ms.append(1e3 * busy / max(n, 1))
        link_util = []
        for lk in self.proxy_links[: self.N - 1]:
            busy = sum(max(0.0, min(b, t1) - max(a, t0)) for _, a, b in (lk.stream.log or []))
            link_util.append(busy / span)
        phases = [
            {p: 1e3 * v / max(iters, 1) for p, v in sorted(acc.items())} for acc in self.phase_acc
        ]
        gparts = {
            f"stage{r}": {c: 1e3 * v / max(iters, 1) for c, v in sorted(p.items())}
            for r, p in enumerate(self.gpu_parts)
        }
        theta = float("nan")
        if isinstance(pol, _SPPolicy) and (pol.accepted + pol.rejected) > 0:
            theta = pol.accepted / (pol.accepted + pol.rejected)
        serving = {}
        if isinstance(self.wl, ServingWorkload):
            serving = self._serving_metrics()
            thr = serving["output_tok_s"]
        else:
            thr = toks / span
        batch = self.wl.batch if isinstance(self.wl, DecodeWorkload) else float("nan")
        return SimResult(
            label=self.dep.label,
            mode=self.dep.mode,
            pp=self.dep.pp,
            tp=self.dep.tp,
            alpha=self.dep.alpha,
            batch=batch,
            throughput_tok_s=float(thr),
            iteration_s=span / max(iters, 1),
            rows_per_iteration=rows_pi,
            tokens_per_iteration=eff_pi,
            theta_measured=theta,
            stage_utilisation=util,
            stage_gpu_ms=gpu_ms,
            phases_ms={"stage0": phases[0], **{f"stage{r}": phases[r] for r in range(1, self.N)}},
            gpu_breakdown_ms=gparts,
            link_utilisation=link_util,
            serving=serving,
            events=self.loop.events,
        )

    def _serving_metrics(self) -> dict:
        r = self.reqs
        done = np.isfinite(r.finish)
        ttft = r.first_token[done] - r.arrival[done]
        e2e = r.finish[done] - r.arrival[done]
        out = r.output[done]
        multi = out > 1
        tpot = (r.finish[done][multi] - r.first_token[done][multi]) / (out[multi] - 1)
        makespan = float(np.nanmax(r.finish) - r.arrival[0]) if done.any() else float("nan")

        def pct(x: np.ndarray) -> dict:
            if x.size == 0:
                return {
                    "mean": float("nan"),
                    "p50": float("nan"),
                    "p90": float("nan"),
                    "p99": float("nan"),
                }
            return {
                "mean": float(x.mean()),
                "p50": float(np.percentile(x, 50)),
                "p90": float(np.percentile(x, 90)),
                "p99": float(np.percentile(x, 99)),
            }

        return {
            "completed": int(done.sum()),
            "requests": int(r.n),
            "makespan_s": makespan,
            "request_throughput": float(done.sum() / makespan) if makespan > 0 else float("nan"),
            "output_tok_s": float(out.sum() / makespan) if makespan > 0 else float("nan"),
            "ttft_s": pct(ttft),
            "tpot_s": pct(tpot),
            "e2e_s": pct(e2e),
            "normalized_latency_s": pct(e2e / out),
        }


def simulate_decode_benchmark(
    deployment: Deployment,
    machine: Machine,
    batch: int,
    acceptance: Optional[AcceptanceModel] = None,
    loop: Optional[LoopSpec] = None,
    input_len: int = 128,
    short_output: int = 16,
    long_output: int = 128,
    max_running: int = 512,
    prefill_chunk: int = 8192,
    seed: int = 0,
) -> tuple[float, SimResult, SimResult]:
    """The protocol of ``benchmark/gpu/decode_throughput.py``, simulated.

    ``batch`` prompts arrive at once; one run stops at ``short_output`` new tokens, one at
    ``long_output``; the decode throughput is ``batch / T_step`` with ``T_step = (t_long -
    t_short) / (long - short)``. Prefill and the ramp-up cancel out; what remains includes the
    tail in which SP's requests, whose tokens arrive after random numbers of iterations, finish
    one by one. Returns ``(tokens/s, short run, long run)``.
    """
    if not 0 < short_output < long_output:
        raise ValueError("need 0 < short_output < long_output")
    runs = []
    for out in (short_output, long_output):
        wl = ServingWorkload(
            arrival_s=np.zeros(batch),
            prompt_len=np.full(batch, input_len),
            output_len=np.full(batch, out),
            max_running=max_running,
            chunk_tokens=prefill_chunk,
            reserve_ratio=0.0,
        )
        runs.append(simulate(deployment, machine, wl, acceptance, loop, seed))
    t_short = runs[0].serving["makespan_s"]
    t_long = runs[1].serving["makespan_s"]
    t_step = (t_long - t_short) / (long_output - short_output)
    return batch / t_step, runs[0], runs[1]


def simulate(
    deployment: Deployment,
    machine: Machine,
    workload,
    acceptance: Optional[AcceptanceModel] = None,
    loop: Optional[LoopSpec] = None,
    seed: int = 0,
) -> SimResult:
    """Simulate one deployment on one machine under one workload; see the module docstring."""
    if not isinstance(workload, (DecodeWorkload, ServingWorkload)):
        raise TypeError("workload must be a DecodeWorkload or a ServingWorkload")
    sim = _Sim(
        deployment,
        loop or LoopSpec(),
        machine,
        workload,
        acceptance or AcceptanceModel(),
        seed,
    )
    return sim.run()
