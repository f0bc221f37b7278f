"""Developer aids of the SP loop.

:class:`LoopProfiler` (``SPEXIS_PROFILE_LOOP``): a cProfile of a scheduler's event loop, for
finding per-row Python costs. It counts the thread's CPU time, the quantity the loop's cost is
measured in: a wall-clock profile charges blocking waits (gloo sends, the previous stage) to
whatever function waited. The scheduler runs in a child process that is killed at shutdown, so
the statistics are written every ``interval_s`` seconds instead of at exit. Read them
with ``python -m pstats FILE``.

:class:`ProfilerRanges` (``SPEXIS_PROFILE_RANGES``): the PP loop's steps as named ranges of a
``torch.profiler`` trace (SGLang's ``/start_profile``), read by ``benchmark/gpu/timeline.py``.

:class:`DraftLog` (``SPEXIS_DRAFT_LOG``): stage 0's drafts per decode batch.
"""

from __future__ import annotations

import cProfile
import functools
import json
import logging
import time
from typing import Any, Callable, Sequence

logger = logging.getLogger(__name__)

#: the range prefix (``spexis::run_batch``); ``benchmark/gpu/timeline.py`` reads it
RANGE_PREFIX = "spexis::"

#: the SP loop's steps (sp_loop.sp_iteration) and what stage 0 does inside its launch
SP_RANGE_METHODS = (
    "_sp_schedule",
    "_sp_collect",
    "_sp_launch",
    "_sp_send",
    "_sp_verify",
    "run_batch",
    "_sp_resolve_rows",
    "_sp_make_drafts",
    "_sp_start_draft_readback",
)


class LoopProfiler:
    def __init__(self, path: str, interval_s: float = 10.0):
        self.path = path
        self.interval_s = interval_s
        self.profile = cProfile.Profile(time.thread_time)
        self.last_dump = time.monotonic()
        self.profile.enable()

    def tick(self) -> None:
        now = time.monotonic()
        if now - self.last_dump >= self.interval_s:
            self.profile.disable()
            self.profile.dump_stats(self.path)
            self.last_dump = now
            self.profile.enable()


def profile_stock_loop(scheduler: Any, path: str) -> LoopProfiler:
    """A :class:`LoopProfiler` of stock SGLang's PP loop, which this project does not own: it
    ticks in ``process_input_requests``, which that loop calls once per micro-batch step."""
    profiler = LoopProfiler(path)
    inner = scheduler.process_input_requests

    @functools.wraps(inner)
    def ticking(recv_reqs):
        profiler.tick()
        return inner(recv_reqs)

    scheduler.process_input_requests = ticking
    return profiler


class ProfilerRanges:
    """Wraps, on one scheduler instance, the methods its PP loop calls in a
    ``torch.profiler.record_function`` range named ``spexis::<method>``.

    In a trace the ranges show which loop step the host was in while the device idled, and
    the device work each launched (Kineto's ``gpu_user_annotation``). Installed only under
    ``SPEXIS_PROFILE_RANGES=1``: a range costs a few microseconds per call even while no
    profiler runs.
    """

    def __init__(self, scheduler: Any, names: Sequence[str]):
        import torch

        self._record_function = torch.profiler.record_function
        self.names = tuple(n for n in names if hasattr(scheduler, n))
        for name in self.names:
            setattr(scheduler, name, self._wrap(getattr(scheduler, name), name))
        logger.info("Spexis: profiler ranges on %s", ", ".join(self.names))

    def _wrap(self, fn: Callable, name: str) -> Callable:
        label = RANGE_PREFIX + name
        record_function = self._record_function

        @functools.wraps(fn)
        def ranged(*args, **kwargs):
            with record_function(label):
                return fn(*args, **kwargs)

        return ranged


class DraftLog:
    """Stage 0's drafts as its scheduler received them, one JSON line per decode batch
    (``SPEXIS_DRAFT_LOG``).

    The model-side trace (``SPEXIS_DRAFT_TRACE``) runs inside the forward, so a CUDA-graph
    replay never writes it; this log is written after the replay, from what the scheduler
    reads, which is what a test comparing replayed and eager drafts needs. Row ``i`` is request
    ``rids[i]``'s input token ``tokens[i]`` at ``positions[i]``; ``drafts[i]`` is the head's
    guess for the next position, ``buckets`` the remaining-length buckets (None without a
    predictor).
    """

    def __init__(self, path: str):
        self.path = path

    def write(self, rids, positions, tokens, drafts, conf, buckets) -> None:
        record = {
            "rids": list(rids),
            "positions": [int(p) for p in positions],
            "tokens": [int(t) for t in tokens],
            "drafts": [int(d) for d in drafts],
            "conf": [float(c) for c in conf],
            "buckets": None if buckets is None else [int(b) for b in buckets],
        }
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
