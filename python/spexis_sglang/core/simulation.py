"""Brute-force simulations that check the closed forms of this package (docs/design.md §6).

Each simulation plays out the *mechanics* of a process, row by row or iteration by
iteration, without using the formula it checks:

* :func:`simulate_sp` — speculative parallelism with random acceptance and selective
  speculation, per request and per iteration, with an in-flight ring of rows, epochs and
  verification ``N`` iterations after launch. Checks Eq. 1-4 and
  :func:`cost_model.sp_alpha_exact`.
* :func:`simulate_lookahead` — the stochastic token/finish model of Algorithm 1, sampled
  (seeded). Checks :class:`lookahead.LookaheadModel`.
* :func:`simulate_admission` — both admission policies of §5.2 (aggressive and delay),
  request by request, with evictions and recomputation. Checks :mod:`admission`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from .selection import select_drops

__all__ = [
    "SPSimResult",
    "simulate_sp",
    "simulate_lookahead",
    "AdmissionSimResult",
    "simulate_admission",
]


# --------------------------------------------------------------------------------------
# Speculative parallelism
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SPSimResult:
    """Per-iteration row counts of a simulated SP run (indexed by launch iteration).

    ``normal``, ``accepted`` and ``stale`` count rows launched at each iteration by what
    they turned out to be; ``rows`` is their sum and ``effective = normal + accepted``.
    Only iterations whose rows have all returned are included.
    """

    normal: np.ndarray
    accepted: np.ndarray
    stale: np.ndarray
    dropped: np.ndarray
    candidates: np.ndarray

    @property
    def rows(self) -> np.ndarray:
        return self.normal + self.accepted + self.stale

    @property
    def effective(self) -> np.ndarray:
        return self.normal + self.accepted

    def mean_rows(self, warmup: int) -> float:
        return float(self.rows[warmup:].mean())

    def mean_effective(self, warmup: int) -> float:
        return float(self.effective[warmup:].mean())

    def drop_fraction(self, warmup: int) -> float:
        c = self.candidates[warmup:].sum()
        return float(self.dropped[warmup:].sum() / c) if c else 0.0


def simulate_sp(
    num_requests: int,
    num_stages: int,
    theta: float,
    iters: int,
    alpha: float = 0.0,
    seed: int = 0,
) -> SPSimResult:
    """Simulate SP with ``num_requests`` resident requests for ``iters`` iterations.

    Mechanics per request (vectorised over requests):

    * At iteration ``t`` the rows launched at ``t - N`` return. A row of the request's
      current epoch commits its token; if the request's next row (launched at ``t-N+1``) was
      speculative on a wrong draft, the epoch is bumped (its in-flight rows become stale)
      and the request needs a normal row. If the request had no next row (its draft was
      dropped) it needs a normal row as well. Rows of an old epoch are stale.
    * Then rows are launched: requests needing a normal row launch one; requests holding a
      draft are candidates, of which ``floor(alpha * #candidates)`` (chosen by random
      confidence through :func:`selection.select_drops`) are dropped and wait; the others
      launch a speculative row whose draft is right with probability ``theta``.

    ``theta`` is the acceptance of *launched* drafts (``Theta_alpha`` in Eq. 4). All
    requests start needing a normal row (``n_0 = B``, appendix A.1).
    """
    r_n = int(num_requests)
    n_st = int(num_stages)
    if r_n < 1 or n_st < 1 or iters < 1:
        raise ValueError("num_requests, num_stages and iters must be >= 1")
    rng = np.random.default_rng(seed)
    epoch = np.zeros(r_n, dtype=np.int64)
    # Request modes as masks (boolean masks are much cheaper than masked assignment):
    # need = needs a normal row, wait = draft dropped, waiting; otherwise holds a draft.
    need = np.ones(r_n, dtype=bool)
    wait = np.zeros(r_n, dtype=bool)
    # Ring of in-flight rows; slot t % N holds the row launched at t.
    ex = np.zeros((n_st, r_n), dtype=bool)
    ep = np.zeros((n_st, r_n), dtype=np.int64)
    spec = np.zeros((n_st, r_n), dtype=bool)
    wrong = np.zeros((n_st, r_n), dtype=bool)
    launch_iter = np.zeros(n_st, dtype=np.int64)
    total = iters + n_st
    normal = np.zeros(total, dtype=np.int64)
    accepted = np.zeros(total, dtype=np.int64)
    stale = np.zeros(total, dtype=np.int64)
    dropped = np.zeros(total, dtype=np.int64)
    cands = np.zeros(total, dtype=np.int64)
    block = 64
    u_acc = u_conf = np.empty((0, r_n))
    for t in range(total):
        s = t % n_st
        if t >= n_st:
            t0 = launch_iter[s]
            back = ex[s]
            valid = back & (ep[s] == epoch)
            n_valid = np.count_nonzero(valid)
            stale[t0] = np.count_nonzero(back) - n_valid
            accepted[t0] = np.count_nonzero(valid & spec[s])
            normal[t0] = n_valid - accepted[t0]
            if np.count_nonzero(valid & wrong[s]):
                raise AssertionError("a current-epoch row had a wrong input")
            # The request's next row (launched at t0 + 1) lives in slot (t0 + 1) % N; for
            # N == 1 that is the slot being refilled now, i.e. there is no next row yet.
            if n_st > 1:
                s1 = (s + 1) % n_st
                nxt = ex[s1] & (ep[s1] == epoch)
                reject = valid & nxt & wrong[s1]
                trigger = reject | (valid & ~nxt)
                np.add(epoch, reject, out=epoch, casting="unsafe")
            else:
                trigger = valid
            need |= trigger
            wait &= ~trigger
            ex[s] = False
        if t >= iters:
            continue
        if t % block == 0:
            u_acc = rng.random((block, r_n))
            u_conf = rng.random((block, r_n))
        launch_iter[s] = t
        have = ~(need | wait)
        if alpha > 0.0:
            cand = np.flatnonzero(have)
            cands[t] = cand.size
            if cand.size:
                d = cand[select_drops(u_conf[t % block, cand], alpha)]
                have[d] = False
                wait[d] = True
                dropped[t] = d.size
        else:
            cands[t] = np.count_nonzero(have)
        ex[s] = need | have
        ep[s] = epoch
        spec[s] = have
        wrong[s] = have & (u_acc[t % block] >= theta)
        need[:] = False
    return SPSimResult(
        normal=normal[:iters].astype(float),
        accepted=accepted[:iters].astype(float),
        stale=stale[:iters].astype(float),
        dropped=dropped[:iters].astype(float),
        candidates=cands[:iters].astype(float),
    )


# --------------------------------------------------------------------------------------
# Lookahead (Algorithm 1's stochastic model)
# --------------------------------------------------------------------------------------


def simulate_lookahead(
    lengths: Sequence[int] | np.ndarray,
    buckets: Sequence[int] | np.ndarray,
    num_stages: int,
    theta: float,
    precision: Sequence[float],
    thresholds: Sequence[int],
    horizon: int,
    samples: int,
    seed: int = 0,
) -> tuple[np.ndarray, np.ndarray]:
    """Sample the lookahead model; returns (mean, standard error) of memory at ``1..horizon``.

    Per request and sample: each generated token costs 1 iteration with probability
    ``theta`` and ``N`` iterations otherwise; ``G_i`` counts tokens completed by iteration
    ``i``. A request with bucket ``k`` has, with probability ``precision[k]``, a remaining
    length of ``thresholds[k]`` tokens and frees all its memory at the first iteration with
    ``G_i >= thresholds[k]``; otherwise (and without a bucket) it does not finish within the
    horizon. Memory of an unfinished request is ``length + G_i``.
    """
    lengths = np.asarray(lengths, dtype=float)
    buckets = np.asarray(buckets, dtype=np.int64)
    rng = np.random.default_rng(seed)
    r_n = lengths.size
    h = int(horizon)
    prec = np.asarray(list(precision) + [0.0])
    tau = np.asarray(list(thresholds) + [h + 1], dtype=np.int64)
    b_idx = np.where(buckets < 0, len(thresholds), buckets)
    acc = np.zeros(h)
    acc2 = np.zeros(h)
    done = 0
    chunk = max(1, 200_000 // max(1, r_n * h))
    while done < samples:
        s_n = min(chunk, samples - done)
        done += s_n
        cost = np.where(rng.random((s_n, r_n, h)) < theta, 1, num_stages)
        # iteration at which token k+1 completes, clipped to "after the horizon"
        done_at = np.minimum(np.cumsum(cost, axis=2), h + 1)
        flat = (np.arange(s_n * r_n)[:, None] * (h + 2)).reshape(s_n, r_n, 1) + done_at
        counts = np.bincount(flat.ravel(), minlength=s_n * r_n * (h + 2))
        g = np.cumsum(counts.reshape(s_n, r_n, h + 2), axis=2)[:, :, 1 : h + 1]
        correct = rng.random((s_n, r_n)) < prec[b_idx][None, :]
        fin = correct[:, :, None] & (g >= tau[b_idx][None, :, None])
        mem = np.where(fin, 0.0, lengths[None, :, None] + g).sum(axis=1)
        acc += mem.sum(axis=0)
        acc2 += (mem * mem).sum(axis=0)
    mean = acc / samples
    var = np.maximum(acc2 / samples - mean * mean, 0.0)
    return mean, np.sqrt(var / samples)


# --------------------------------------------------------------------------------------
# Admission: explicit simulation of both policies
# --------------------------------------------------------------------------------------


@dataclass
class AdmissionSimResult:
    """One policy's run over a period of ``I`` iterations."""

    tokens: float
    time: float
    evictions: list[tuple[int, int]] = field(default_factory=list)  # (victim, i_evict)
    waits: list[int] = field(default_factory=list)
    recomputes: int = 0
    admitted_at: int | None = None

    @property
    def throughput(self) -> float:
        return self.tokens / self.time


def simulate_admission(
    lengths: Sequence[int],
    remaining: Sequence[int | None],
    capacity: float,
    prompt: int,
    admit_at: int,
    period: int,
    t_decode: float,
    t_prefill: float,
    victim_order: Sequence[int],
) -> AdmissionSimResult:
    """Play one admission policy out request by request (deterministic, 1 token/iteration).

    Iteration ``i = 1 .. period``: the new request (``prompt`` KV tokens) is prefilled at
    iteration ``admit_at`` (1 = now). Every resident request grows by one token per
    iteration it runs and frees its memory when it has produced ``remaining[r]`` tokens
    (``None`` = not within the period). Before an iteration runs, if the memory it needs
    exceeds ``capacity``, running requests are evicted in ``victim_order`` until it fits; an
    evicted request keeps its progress and is recomputed (re-prefilled) at the first later
    iteration where it fits again, victims in eviction order. An iteration with ``k``
    prefills/recomputes costs ``t_decode + k (t_prefill - t_decode)``, otherwise
    ``t_decode``. Tokens are counted as one per running request per iteration, the paper's
    accounting (A.3).
    """
    lengths = [int(x) for x in lengths]
    n = len(lengths)
    rem = [None if r is None else int(r) for r in remaining]
    done = [0] * n  # tokens produced
    state = ["run"] * n  # run | out | fin
    queue: list[int] = []  # evicted, waiting for recompute (FIFO)
    out_since: dict[int, int] = {}
    res = AdmissionSimResult(tokens=0.0, time=0.0, admitted_at=admit_at)
    new_done: int | None = None

    def mem_next(r: int) -> int:
        # memory request r holds after running one more iteration
        if rem[r] is not None and done[r] + 1 >= rem[r]:
            return 0
        return lengths[r] + done[r] + 1

    for i in range(1, period + 1):
        prefills = 0
        if i == admit_at:
            new_done = 0
            prefills += 1
        running = [r for r in range(n) if state[r] == "run"]
        demand = sum(mem_next(r) for r in running)
        if new_done is not None:
            demand += prompt + new_done + 1
        for v in victim_order:
            if demand <= capacity:
                break
            if state[v] != "run":
                continue
            state[v] = "out"
            demand -= mem_next(v)
            queue.append(v)
            out_since[v] = i
            res.evictions.append((v, i))
        still: list[int] = []
        for v in queue:
            if out_since[v] < i and demand + mem_next(v) <= capacity and not still:
                state[v] = "run"
                demand += mem_next(v)
                res.waits.append(i - out_since[v])
                res.recomputes += 1
                prefills += 1
            else:
                still.append(v)
        queue = still
        # run the iteration
        toks = 0
        for r in range(n):
            if state[r] == "run":
                done[r] += 1
                toks += 1
                if rem[r] is not None and done[r] >= rem[r]:
                    state[r] = "fin"
        if new_done is not None:
            new_done += 1
            toks += 1
        res.tokens += toks
        res.time += t_decode + prefills * (t_prefill - t_decode)
    for v in queue:  # still evicted at the end of the period
        res.waits.append(period + 1 - out_since[v])
    return res
