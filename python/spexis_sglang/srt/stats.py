"""Per-phase wall and thread-CPU time of a scheduler's event loop.

:class:`PhaseTimer` splits each iteration of a loop into named phases and keeps both the wall
time (``time.perf_counter``) and this thread's CPU time (``time.thread_time``) of each: wall
time says where an iteration's latency goes (waits included), CPU time what the scheduler
itself costs (a blocking receive or an idle wait costs none), which is what has to hide behind
the accelerator. Two ways to attribute time, usable together:

* ``mark(phase)``: the time since the iteration's start or its previous mark goes to ``phase``
  (the SP loop: consecutive phases, the loop unchanged but for one call between them);
* ``with timer.phase(name):``: the time inside goes to ``name`` and is taken out of the
  enclosing mark's span (a sub-phase such as reading the drafts, or a wrapped method).

An iteration's times reach the totals only when it is committed (``commit``: a busy
iteration) and are dropped by ``discard`` (an idle one).

:class:`StockPPPhaseTimers` applies the same measurement to stock SGLang's ``event_loop_pp``
without copying it: it wraps, on the scheduler instance, the methods the loop calls.
``SPEXIS_PHASE_TIMERS=1`` turns it on (normal servers pay nothing).
"""

from __future__ import annotations

import functools
import json
import logging
import time
from typing import Any, Callable, Dict, Optional, Sequence

logger = logging.getLogger(__name__)

from spexis_sglang.core.sp_stats import SPStats
from spexis_sglang.srt.config import ENV_GPU_TIMERS, ENV_PHASE_TIMERS, env_flag

# the SP loop's phases, in loop order (sp_scheduler.event_loop_sp); "forced" is the
# benchmark-only forced acceptance (--spexis-benchmark-force-accept), a span inside
# "process" kept apart so that a benchmark can tell what a serving loop costs without it
SP_PHASES = ("schedule", "draft_sync", "launch", "wait_output", "process", "forced", "send")


def phase_timers_enabled() -> bool:
    return env_flag(ENV_PHASE_TIMERS)


class _Span:
    """``with timer.phase(name)``: a reusable context manager (no generator per call)."""

    __slots__ = ("timer", "name")

    def __init__(self, timer: "PhaseTimer", name: str):
        self.timer, self.name = timer, name

    def __enter__(self) -> None:
        self.timer.begin(self.name)

    def __exit__(self, *exc) -> None:
        self.timer.end()


class PhaseTimer:
    """Wall and thread-CPU seconds per phase, cumulative over committed iterations."""

    def __init__(self, phases: Sequence[str]):
        self.phases = tuple(phases)
        self.wall: Dict[str, float] = dict.fromkeys(self.phases, 0.0)
        self.cpu: Dict[str, float] = dict.fromkeys(self.phases, 0.0)
        self.wall_busy = 0.0
        self.cpu_busy = 0.0
        self.iterations = 0
        # the same wall totals over decode-only iterations (no prefill launched or processed):
        # a benchmark's per-iteration phases, free of where each run's prefill time landed
        self.decode_wall: Dict[str, float] = dict.fromkeys(self.phases, 0.0)
        self.decode_wall_busy = 0.0
        self.decode_iterations = 0
        self.started = False
        self._spans = {name: _Span(self, name) for name in self.phases}
        self._pending_wall: Dict[str, float] = dict.fromkeys(self.phases, 0.0)
        self._pending_cpu: Dict[str, float] = dict.fromkeys(self.phases, 0.0)
        self._start_wall = self._start_cpu = 0.0
        self._mark_wall = self._mark_cpu = 0.0
        # time spent in phase() spans since the last mark (taken out of the next mark)
        self._nested_wall = self._nested_cpu = 0.0
        self._depth = 0
        self._span_name = ""
        self._span_wall = self._span_cpu = 0.0

    # -- an iteration ---------------------------------------------------------------------
    def start(self) -> None:
        """Begin an iteration (anything pending from an uncommitted one is dropped)."""
        self._clear_pending()
        self._start_wall = self._mark_wall = time.perf_counter()
        self._start_cpu = self._mark_cpu = time.thread_time()
        self.started = True

    def mark(self, phase: str) -> None:
        """The time since the start or the previous mark, less phase() spans, is ``phase``'s."""
        wall, cpu = time.perf_counter(), time.thread_time()
        self._pending_wall[phase] += wall - self._mark_wall - self._nested_wall
        self._pending_cpu[phase] += cpu - self._mark_cpu - self._nested_cpu
        self._mark_wall, self._mark_cpu = wall, cpu
        self._nested_wall = self._nested_cpu = 0.0

    def phase(self, name: str) -> _Span:
        """``with timer.phase(name):`` the time inside is ``name``'s (nested spans: the outer's)."""
        return self._spans[name]

    def begin(self, name: str) -> None:
        self._depth += 1
        if self._depth == 1:
            self._span_name = name
            self._span_wall, self._span_cpu = time.perf_counter(), time.thread_time()

    def end(self) -> None:
        self._depth -= 1
        if self._depth:
            return
        wall = time.perf_counter() - self._span_wall
        cpu = time.thread_time() - self._span_cpu
        self._pending_wall[self._span_name] += wall
        self._pending_cpu[self._span_name] += cpu
        self._nested_wall += wall
        self._nested_cpu += cpu

    def commit(self, decode_only: bool = False) -> None:
        """A busy iteration: its phases and its whole time since ``start`` join the totals
        (``decode_only``: it launched and processed decode batches only; the decode totals
        get it too)."""
        if not self.started:
            return
        wall = time.perf_counter() - self._start_wall
        self.wall_busy += wall
        self.cpu_busy += time.thread_time() - self._start_cpu
        for name in self.phases:
            self.wall[name] += self._pending_wall[name]
            self.cpu[name] += self._pending_cpu[name]
        self.iterations += 1
        if decode_only:
            self.decode_wall_busy += wall
            for name in self.phases:
                self.decode_wall[name] += self._pending_wall[name]
            self.decode_iterations += 1
        self._clear_pending()
        self.started = False

    def discard(self) -> None:
        """An idle iteration: nothing of it is counted."""
        self._clear_pending()
        self.started = False

    def _clear_pending(self) -> None:
        for name in self.phases:
            self._pending_wall[name] = 0.0
            self._pending_cpu[name] = 0.0
        self._nested_wall = self._nested_cpu = 0.0

    # -- export ---------------------------------------------------------------------------
    def as_dict(self) -> Dict[str, float]:
        """``time_busy_s``, ``time_<phase>_s`` (wall), ``cpu_busy_s``, ``cpu_<phase>_s``; over
        decode-only iterations ``decode_time_busy_s``, ``decode_time_<phase>_s`` (wall) and
        their count ``decode_timed_iterations``."""
        d: Dict[str, float] = {"time_busy_s": self.wall_busy}
        d.update({f"time_{name}_s": self.wall[name] for name in self.phases})
        d["cpu_busy_s"] = self.cpu_busy
        d.update({f"cpu_{name}_s": self.cpu[name] for name in self.phases})
        d["decode_timed_iterations"] = self.decode_iterations
        d["decode_time_busy_s"] = self.decode_wall_busy
        d.update({f"decode_time_{name}_s": self.decode_wall[name] for name in self.phases})
        return d


class _TimedReceiver:
    """A request receiver whose ``recv_requests`` is timed; everything else is the original's."""

    def __init__(self, receiver: Any, recv_requests: Callable):
        self._receiver = receiver
        self.recv_requests = recv_requests

    def __getattr__(self, name: str) -> Any:
        return getattr(self._receiver, name)


# stock event_loop_pp's calls (sglang/srt/managers/scheduler_pp_mixin.py), by phase; the
# loop's own code between them and _pp_commit_comm_work's waits count in busy time only
STOCK_PP_PHASE_METHODS: Dict[str, Sequence[str]] = {
    "schedule": ("process_input_requests", "_pp_send_pyobj_to_next_stage", "get_next_batch_to_run"),
    "launch": ("_pp_recv_proxy_tensors", "_pp_launch_batch"),
    "wait_output": ("_pp_commit_send_output_work_and_preprocess_output_tensors",),
    "process": ("_pp_process_batch_result",),
    "send": ("_pp_send_dict_to_next_stage",),
}
STOCK_PP_PHASES = tuple(STOCK_PP_PHASE_METHODS)
#: the same calls and the forward inside the launch, as profiler ranges (profiling.ProfilerRanges)
STOCK_PP_RANGE_METHODS = tuple(n for names in STOCK_PP_PHASE_METHODS.values() for n in names) + (
    "run_batch",
)


class StockPPPhaseTimers:
    """Stock ``event_loop_pp``'s CPU and wall time by phase, per micro-batch step.

    An iteration of the loop's inner ``for`` (one micro-batch step) begins when it polls for
    requests (``request_receiver.recv_requests``, timed as "schedule"); it counts when it
    launched a batch or processed one's result, and goes to the decode-only totals too when
    every batch it launched or processed was a decode batch. Also counted: decode batches
    launched and their rows (stage 0 of PP=N runs B/N rows per step when B requests decode).
    """

    def __init__(self, scheduler: Any):
        self.timer = PhaseTimer(STOCK_PP_PHASES)
        self.decode_iterations = 0
        self.decode_rows = 0
        self._busy = False
        self._decode_only = True  # nothing but decode batches launched or processed so far
        for phase, names in STOCK_PP_PHASE_METHODS.items():
            for name in names:
                setattr(scheduler, name, self._wrap(getattr(scheduler, name), phase))
        # (SGLang's receiver is a frozen, slotted dataclass: it is wrapped, not patched)
        receiver = scheduler.request_receiver
        scheduler.request_receiver = _TimedReceiver(
            receiver, self._wrap_iteration_start(receiver.recv_requests)
        )
        logger.info("%s=1: timing stock event_loop_pp by phase", ENV_PHASE_TIMERS)

    def _wrap(self, fn: Callable, phase: str) -> Callable:
        span = self.timer.phase(phase)
        launch = fn.__name__ == "_pp_launch_batch"
        process = fn.__name__ == "_pp_process_batch_result"

        @functools.wraps(fn)
        def timed(*args, **kwargs):
            if launch:
                batch = args[1] if len(args) > 1 else kwargs["cur_batch"]
                self._busy = True
                if batch.forward_mode.is_decode():
                    self.decode_iterations += 1
                    self.decode_rows += batch.batch_size()
                else:
                    self._decode_only = False
            elif process:
                batch = args[0] if args else kwargs["batch"]
                self._busy = True
                if not batch.forward_mode.is_decode():
                    self._decode_only = False
            with span:
                return fn(*args, **kwargs)

        return timed

    def _wrap_iteration_start(self, fn: Callable) -> Callable:
        span = self.timer.phase("schedule")

        @functools.wraps(fn)
        def timed(*args, **kwargs):
            if self._busy:
                self.timer.commit(decode_only=self._decode_only)
            else:
                self.timer.discard()
            self._busy = False
            self._decode_only = True
            self.timer.start()
            with span:
                return fn(*args, **kwargs)

        return timed

    def as_dict(self) -> Dict[str, float]:
        d: Dict[str, float] = {
            "iterations": self.timer.iterations,
            "decode_iterations": self.decode_iterations,
            "decode_rows": self.decode_rows,
        }
        d.update(self.timer.as_dict())
        return d


class GpuForwardTimer:
    """Device time of this rank's decode forwards by batch rows (``SPEXIS_GPU_TIMERS=1``).

    A CUDA event pair brackets each forward on its stream; a pair is read once both events
    have completed (``query``, never a wait), so timing costs the loop two event records. The
    span starts when the stream reaches the forward (after whatever it waited for), so it is
    the stage's own GPU time: what an ideal pipeline would pay per iteration. Logged per rank
    every ``log_every_s`` seconds as one JSON line (``LOG_PREFIX``), which is how the later
    stages' times reach a benchmark."""

    LOG_PREFIX = "Spexis GPU forward ms by rows"

    def __init__(self, label: str, log_every_s: float = 5.0) -> None:
        import torch

        self._torch = torch
        self.label = label
        self.log_every_s = log_every_s
        self.totals: Dict[str, list] = {}  # "rows@ctx" -> [forwards, total ms]
        self._pending: list = []
        self._free: list = []
        self._logged = time.monotonic()
        self._changed = False

    def _event(self):
        return self._free.pop() if self._free else self._torch.cuda.Event(enable_timing=True)

    def start(self, stream=None):
        """Open a forward's span on ``stream`` (the current stream if None): the stream the
        forward runs on, which under SGLang's overlap scheduler (PP=1) is its forward stream,
        not the scheduler's (spans there read ~1.1 ms for 10-25 ms forwards)."""
        ev = self._event()
        ev.record(stream)
        return ev

    def stop(self, start, rows: int, tokens: Optional[int] = None, stream=None) -> None:
        """End the span of a forward of ``rows`` rows over ``tokens`` context tokens in all,
        on the stream :meth:`start` was given."""
        end = self._event()
        end.record(stream)
        self._pending.append((self.key(rows, tokens), start, end))

    @staticmethod
    def key(rows: int, tokens: Optional[int]) -> str:
        """``"rows@ctx"``: ``ctx`` is the mean context per row rounded down to a power of 8
        (64 covers 64..511, 512 covers 512..4095, ...), so one server's sweeps at short and
        long prompts keep apart."""
        ctx = GpuForwardTimer.context_bucket(tokens / rows) if tokens and rows else 0
        return f"{rows}@{ctx}"

    @staticmethod
    def context_bucket(mean_context: float) -> int:
        """The power of 8 at or below ``mean_context`` (1 below 8): a :meth:`key`'s ``ctx``."""
        ctx = 1
        while ctx * 8 <= mean_context:
            ctx *= 8
        return ctx

    @staticmethod
    def rows_of(key: str) -> int:
        """The rows of a :meth:`key` (how a benchmark reads the logged totals)."""
        return int(key.split("@")[0])

    def poll(self) -> None:
        """Take the pairs whose forward is done; log now and then."""
        done = 0
        for key, start, end in self._pending:
            if not end.query():
                break
            entry = self.totals.setdefault(key, [0, 0.0])
            entry[0] += 1
            entry[1] += start.elapsed_time(end)
            self._free += (start, end)
            done += 1
        if done:
            del self._pending[:done]
            self._changed = True
        now = time.monotonic()
        if self._changed and now - self._logged >= self.log_every_s:
            self._logged, self._changed = now, False
            logger.info("%s (%s): %s", self.LOG_PREFIX, self.label, json.dumps(self.as_dict()))

    def as_dict(self) -> Dict[str, list]:
        """``{"rows@ctx": [forwards, mean ms]}``."""
        return {k: [n, round(t / n, 4)] for k, (n, t) in sorted(self.totals.items())}


#: a later pipeline rank's ``/server_info`` state, logged as it answers (benchmarks only)
RANK_STATE_LOG_PREFIX = "Spexis rank state"


def rank_state_logging_enabled() -> bool:
    """Later ranks log their state on each ``/server_info`` under the benchmarks' timers
    (``SPEXIS_PHASE_TIMERS=1`` or ``SPEXIS_GPU_TIMERS=1``)."""
    return env_flag(ENV_PHASE_TIMERS) or env_flag(ENV_GPU_TIMERS)


def log_rank_state(label: str, state: Dict[str, Any]) -> None:
    """One JSON line: ``/server_info`` answers from stage 0 only (SGLang drops the later
    ranks' replies), so a benchmark reads a later stage's loop phases and counters from the
    line each rank logs when the request reaches it; ``t`` (``time.time()``) pairs the line
    with the request that made it."""
    logger.info(
        "%s (%s): %s",
        RANK_STATE_LOG_PREFIX,
        label,
        json.dumps({"t": time.time(), **state}, default=float),
    )


def spexis_state(stats: SPStats, phases: PhaseTimer) -> Dict[str, float]:
    """A rank's ``/server_info`` ``internal_states[i]["spexis"]``: the counters and their
    ratios (:meth:`SPStats.as_dict`) and the loop's seconds by phase (wall ``time_*_s``: where
    an iteration goes, waits included; thread CPU ``cpu_*_s``: what the loop itself costs)."""
    d = stats.as_dict()
    d.update(phases.as_dict())
    return d


# exported keys that are levels, not counts: a difference of two snapshots means nothing
STAT_GAUGES = SPStats.gauge_names()
# every cumulative key of spexis_state(): counters and phase seconds, the keys whose
# difference between two /server_info snapshots is what happened in between
STAT_COUNTERS: tuple[str, ...] = SPStats.counter_names() + tuple(PhaseTimer(SP_PHASES).as_dict())


def gpu_time_deltas(before: Optional[Dict[str, list]], after: Dict[str, list]) -> Dict[str, list]:
    """What a rank's :class:`GpuForwardTimer` recorded between two snapshots of
    :meth:`GpuForwardTimer.as_dict` (``{"rows@ctx": [forwards, mean ms]}``): the forwards of
    each kind in between and their mean, so a benchmark point's stage times are its own and
    not the server's over every point. Kinds with no forward in between are left out."""
    before = before or {}
    out: Dict[str, list] = {}
    for key, (n, mean) in after.items():
        n0, mean0 = before.get(key, (0, 0.0))
        if n > n0:
            out[key] = [n - n0, round((n * mean - n0 * mean0) / (n - n0), 4)]
    return out


def stat_deltas(before: Dict[str, float], after: Dict[str, float]) -> Dict[str, float]:
    """What a rank's Spexis counters did between two snapshots (``/server_info``'s
    ``internal_states[i]["spexis"]``); keys ``after`` lacks are left out, ones ``before`` lacks
    count from 0 (a server started with the snapshot)."""
    return {k: after[k] - before.get(k, 0) for k in STAT_COUNTERS if k in after}
