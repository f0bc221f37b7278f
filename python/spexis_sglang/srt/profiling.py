"""Developer aids of the SP loop.

:class:`LoopProfiler` (``SPEXIS_PROFILE_LOOP``): a cProfile of a scheduler's event loop, for
finding per-row Python costs. It counts the thread's CPU time, the quantity the loop's cost is
measured in: a wall-clock profile charges blocking waits (gloo sends, the previous stage) to
whatever function waited. The scheduler runs in a child process that is killed at shutdown, so
the statistics are written every ``interval_s`` seconds instead of at exit. Read them
with ``python -m pstats FILE``.

:class:`DraftLog` (``SPEXIS_DRAFT_LOG``): stage 0's drafts per decode batch.
"""

from __future__ import annotations

import cProfile
import json
import time


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
