"""What the SP loop tells: the periodic statistics line and the Prometheus series (one counter
set, ``SPStats``, which ``/server_info`` exports too), and the labels of the benchmark-only modes.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, List

if TYPE_CHECKING:
    from spexis_sglang.srt.sp_scheduler import SpexisScheduler

logger = logging.getLogger(__name__)


class SPObserveMixin:
    """The statistics line and the Prometheus series. (A mixin of
    :class:`~.sp_scheduler.SpexisScheduler`.)"""

    def sp_maybe_log(self: SpexisScheduler) -> None:
        stats = self.sp.stats
        if self.sp.metrics is not None and stats.decode_iterations:
            self.sp.metrics.update(stats)
        interval = self.spexis_config.log_interval
        if interval <= 0 or not self.sp.rank0:
            return
        now = time.monotonic()
        if now - self.sp.last_log < interval:
            return
        if stats.decode_iterations == self.sp.last_logged_iterations:
            return  # nothing new to say (idle)
        self.sp.last_log = now
        self.sp.last_logged_iterations = stats.decode_iterations
        logger.info(
            "".join(f"[BENCHMARK {m.replace('_', ' ')}] " for m in self._sp_benchmark_modes())
            + "Spexis: acceptance %.3f, tokens/row %.3f, rows/iter %.1f, tokens/iter %.2f, "
            "normal %d, spec %d, stale %d, dropped %d, alpha %.2f, delayed admissions %d",
            stats.acceptance_rate,
            stats.effective_batch_ratio,
            stats.avg_rows_per_decode_iteration,
            stats.avg_tokens_per_decode_iteration,
            stats.rows_normal,
            stats.rows_spec,
            stats.rows_stale,
            stats.drafts_dropped,
            stats.alpha,
            stats.admissions_delayed,
        )

    def _sp_benchmark_modes(self: SpexisScheduler) -> List[str]:
        """The benchmark-only modes this server runs in (labels for logs and metrics)."""
        cfg = self.spexis_config
        modes = []
        if cfg.force_accept is not None:
            modes.append("forced_acceptance")
        if cfg.length_oracle is not None:
            modes.append("length_oracle")
        return modes
