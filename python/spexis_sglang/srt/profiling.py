"""cProfile of a scheduler's event loop, dumped periodically (``SPEXIS_PROFILE_LOOP``).

A developer aid for finding per-row Python costs of the SP loop: the scheduler runs in a
child process that is killed at shutdown, so the statistics are written every
``interval_s`` seconds instead of at exit. Read them with ``python -m pstats FILE``.
"""

from __future__ import annotations

import cProfile
import time


class LoopProfiler:
    def __init__(self, path: str, interval_s: float = 10.0):
        self.path = path
        self.interval_s = interval_s
        self.profile = cProfile.Profile()
        self.last_dump = time.monotonic()
        self.profile.enable()

    def tick(self) -> None:
        now = time.monotonic()
        if now - self.last_dump >= self.interval_s:
            self.profile.disable()
            self.profile.dump_stats(self.path)
            self.last_dump = now
            self.profile.enable()
