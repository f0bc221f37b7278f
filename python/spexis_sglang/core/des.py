"""A small discrete-event kernel for the pipeline simulator (``pipeline_sim``).

Why not simpy: ``core/`` imports only the standard library and numpy (a test enforces it),
and the one resource here that simpy has no primitive for is a GPU shared by two processes
(the emulated two-GPU box: two MPS clients on one H200), where a kernel's speed changes
whenever the other client starts or stops one. That is a fluid, processor-sharing server
(:class:`SharedDevice`); the rest (timed callbacks, one-shot signals, generator processes,
FIFO streams and links) is a hundred lines.

Driving sequence::

    loop = EventLoop()
    done = Signal(loop)
    def host():
        yield 1e-3                    # busy for 1 ms
        yield done                    # wait until the signal fires
    Process(loop, host())
    stream = Stream(loop)
    stream.submit(duration=2e-3, after=(), on_done=done)
    loop.run()

Times are seconds (float). Events at equal times run in the order they were scheduled.
"""

from __future__ import annotations

import heapq
import math
from typing import Callable, Generator, Iterable, Optional, Sequence

__all__ = [
    "EventLoop",
    "Signal",
    "Process",
    "Stream",
    "SharedDevice",
    "Link",
    "SimulationError",
]


class SimulationError(RuntimeError):
    """The simulated system cannot make progress (a deadlock) or was driven wrongly."""


class EventLoop:
    """Timed callbacks in time order (ties: scheduling order)."""

    __slots__ = ("now", "_heap", "_seq", "events")

    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list = []
        self._seq = 0
        self.events = 0

    def at(self, t: float, fn: Callable, *args) -> None:
        if t < self.now - 1e-12:
            raise SimulationError(f"event scheduled in the past ({t} < {self.now})")
        self._seq += 1
        heapq.heappush(self._heap, (max(t, self.now), self._seq, fn, args))

    def run(self, until: float = math.inf, stop: Optional[Callable[[], bool]] = None) -> None:
        """Run events until none is left, ``until`` is passed or ``stop()`` turns true."""
        heap = self._heap
        while heap:
            t, _, fn, args = heap[0]
            if t > until:
                self.now = until
                return
            heapq.heappop(heap)
            self.now = t
            self.events += 1
            fn(*args)
            if stop is not None and stop():
                return

    @property
    def idle(self) -> bool:
        return not self._heap


class Signal:
    """A one-shot event; callbacks registered before or after it fires run at its time."""

    __slots__ = ("loop", "time", "_waiters", "name")

    def __init__(self, loop: EventLoop, name: str = "") -> None:
        self.loop = loop
        self.time: Optional[float] = None
        self._waiters: list = []
        self.name = name

    @property
    def fired(self) -> bool:
        return self.time is not None

    def fire(self, t: Optional[float] = None) -> None:
        """Fire now, or at the future time ``t``."""
        t = self.loop.now if t is None else t
        if t > self.loop.now:
            self.loop.at(t, self.fire, t)
            return
        if self.time is not None:
            raise SimulationError(f"signal {self.name!r} fired twice")
        self.time = self.loop.now
        waiters, self._waiters = self._waiters, []
        for cb in waiters:
            cb()

    def on(self, cb: Callable[[], None]) -> None:
        if self.time is not None:
            cb()
        else:
            self._waiters.append(cb)


def all_of(loop: EventLoop, signals: Sequence[Signal], cb: Callable[[], None]) -> None:
    """Call ``cb`` once every signal has fired."""
    pending = [s for s in signals if s is not None and not s.fired]
    if not pending:
        cb()
        return
    count = [len(pending)]

    def one() -> None:
        count[0] -= 1
        if count[0] == 0:
            cb()

    for s in pending:
        s.on(one)


class Process:
    """A generator driven by the loop: ``yield seconds`` sleeps, ``yield signal`` waits."""

    __slots__ = ("loop", "gen", "name", "finished")

    def __init__(self, loop: EventLoop, gen: Generator, name: str = "") -> None:
        self.loop = loop
        self.gen = gen
        self.name = name
        self.finished = False
        loop.at(loop.now, self._step)

    def _step(self) -> None:
        try:
            cmd = next(self.gen)
        except StopIteration:
            self.finished = True
            return
        if isinstance(cmd, Signal):
            cmd.on(self._resume)
        else:
            dt = float(cmd)
            if dt < 0 or math.isnan(dt):
                raise SimulationError(f"process {self.name!r} slept {dt} s")
            self.loop.at(self.loop.now + dt, self._step)

    def _resume(self) -> None:
        # a signal's callbacks run inside fire(); resume through the loop to keep order
        self.loop.at(self.loop.now, self._step)


class _Job:
    __slots__ = ("duration", "mem_frac", "after", "min_end", "done", "tag", "start", "end")

    def __init__(self, duration, mem_frac, after, min_end, done, tag) -> None:
        self.duration = duration
        self.mem_frac = mem_frac
        self.after = after
        self.min_end = min_end
        self.done = done
        self.tag = tag
        self.start = math.nan
        self.end = math.nan


class Stream:
    """A FIFO of GPU work (one CUDA stream of one pipeline stage).

    A job starts when the previous job has finished and every signal in ``after`` has fired
    (its inputs have arrived, its launch was issued). ``min_end`` is a signal the job cannot
    finish before (eager mode: the host is still launching its kernels). With a
    :class:`SharedDevice` the job's speed depends on what the other streams run.
    """

    def __init__(
        self, loop: EventLoop, device: Optional["SharedDevice"] = None, name: str = ""
    ) -> None:
        self.loop = loop
        self.device = device
        self.name = name
        self._queue: list[_Job] = []
        self._busy = False
        self.busy_time = 0.0
        self.jobs_done = 0
        self.log: Optional[list] = None  # (tag, start, end) when set to a list

    def submit(
        self,
        duration: float,
        after: Iterable[Optional[Signal]] = (),
        min_end: Optional[Signal] = None,
        mem_frac: float = 0.5,
        tag: object = None,
        done: Optional[Signal] = None,
    ) -> Signal:
        """Queue a job; returns the signal fired when it ends (``done`` if given)."""
        if duration < 0 or math.isnan(duration):
            raise SimulationError(f"stream {self.name!r}: job duration {duration}")
        if done is None:
            done = Signal(self.loop, f"{self.name}:{tag}")
        self._queue.append(_Job(duration, mem_frac, [a for a in after if a], min_end, done, tag))
        if not self._busy:
            self._try_start()
        return done

    def _try_start(self) -> None:
        if self._busy or not self._queue:
            return
        job = self._queue[0]
        self._busy = True  # reserved for the head job while it waits for its inputs
        all_of(self.loop, job.after, lambda: self.loop.at(self.loop.now, self._start, job))

    def _start(self, job: _Job) -> None:
        job.start = self.loop.now
        if self.device is None:
            self.loop.at(self.loop.now + job.duration, self._finish_compute, job)
        else:
            self.device.run(job, lambda: self._finish_compute(job))

    def _finish_compute(self, job: _Job) -> None:
        if job.min_end is not None and not job.min_end.fired:
            job.min_end.on(lambda: self.loop.at(self.loop.now, self._finish, job))
        else:
            self._finish(job)

    def _finish(self, job: _Job) -> None:
        job.end = self.loop.now
        self.busy_time += job.end - job.start
        self.jobs_done += 1
        if self.log is not None:
            self.log.append((job.tag, job.start, job.end))
        self._queue.pop(0)
        self._busy = False
        job.done.fire()
        self._try_start()


class SharedDevice:
    """One GPU split between processes (MPS clients): a fluid processor-sharing server.

    A job's ``duration`` is its time alone on the whole GPU; ``mem_frac`` the share of that
    time bound by memory bandwidth (the rest by compute). With ``k`` jobs running at once a
    job's compute part runs ``compute_slowdown[k]`` times slower and its memory part
    ``memory_slowdown[k]`` times slower (index 1: alone in its client, 2: both clients busy).
    Whenever a job starts or ends the others' finish times are recomputed.
    """

    def __init__(
        self,
        loop: EventLoop,
        compute_slowdown: Sequence[float],
        memory_slowdown: Sequence[float],
    ) -> None:
        if len(compute_slowdown) < 2 or len(memory_slowdown) < 2:
            raise ValueError("give slowdowns for 1 and 2 concurrent jobs (index 1 and 2)")
        self.loop = loop
        self.compute_slowdown = tuple(float(x) for x in compute_slowdown)
        self.memory_slowdown = tuple(float(x) for x in memory_slowdown)
        self._running: dict = {}  # job -> [remaining_work_s, callback, version]
        self._last = 0.0

    def _rate(self, job: _Job, k: int) -> float:
        k = min(k, len(self.compute_slowdown) - 1)
        slow = (
            job.mem_frac * self.memory_slowdown[k] + (1.0 - job.mem_frac) * self.compute_slowdown[k]
        )
        return 1.0 / slow

    def _advance(self) -> None:
        dt = self.loop.now - self._last
        if dt > 0 and self._running:
            k = len(self._running)
            for job, st in self._running.items():
                st[0] -= dt * self._rate(job, k)
        self._last = self.loop.now

    def _reschedule(self) -> None:
        k = len(self._running)
        for job, st in self._running.items():
            st[2] += 1
            eta = self.loop.now + max(st[0], 0.0) / self._rate(job, k)
            self.loop.at(eta, self._maybe_done, job, st[2])

    def run(self, job: _Job, cb: Callable[[], None]) -> None:
        self._advance()
        self._running[job] = [job.duration, cb, 0]
        self._reschedule()

    def _maybe_done(self, job: _Job, version: int) -> None:
        st = self._running.get(job)
        if st is None or st[2] != version:
            return  # superseded by a later reschedule
        self._advance()
        del self._running[job]
        self._reschedule()
        st[1]()


class Link:
    """A FIFO point-to-point channel: transfer time ``latency + bytes / bandwidth``.

    A transfer starts when its data is ready (``after``) and the previous transfer on the
    link has finished; ``send`` returns the signal of its arrival.
    """

    def __init__(self, loop: EventLoop, latency_s: float, bandwidth_Bps: float, name: str = ""):
        if latency_s < 0 or bandwidth_Bps <= 0:
            raise ValueError(f"link {name!r}: latency must be >= 0 and bandwidth > 0")
        self.stream = Stream(loop, name=f"link {name}")
        self.latency_s = float(latency_s)
        self.bandwidth_Bps = float(bandwidth_Bps)
        self.bytes_sent = 0

    def transfer_s(self, nbytes: float) -> float:
        return self.latency_s + float(nbytes) / self.bandwidth_Bps

    def send(
        self,
        nbytes: float,
        after: Iterable[Optional[Signal]] = (),
        tag=None,
        done: Optional[Signal] = None,
    ) -> Signal:
        self.bytes_sent += nbytes
        return self.stream.submit(self.transfer_s(nbytes), after=after, tag=tag, done=done)
