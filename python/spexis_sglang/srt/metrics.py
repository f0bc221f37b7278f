"""Spexis' Prometheus metrics (``spexis:*``), exported through SGLang's ``/metrics``.

SGLang sets up multiprocess Prometheus collection when ``--enable-metrics`` is on; metrics
created in a scheduler process with the scheduler's labels appear next to ``sglang:*``.
Only stage 0 reports (every rank sees the same verdicts, so one is enough).
"""

from __future__ import annotations

from typing import Dict, Sequence


class SpexisMetrics:
    """Counters and gauges fed from :class:`SpexisStats` deltas once per iteration."""

    def __init__(self, labels: Dict[str, str], benchmark_modes: Sequence[str] = ()):
        from prometheus_client import Counter, Gauge

        self.labels = dict(labels)
        names = list(self.labels)
        self.rows = Counter(
            "spexis:rows",
            "Decode rows launched, by kind (normal, spec), rows whose result was stale, and "
            "speculative rows the device redid as normal rows (redone).",
            labelnames=names + ["kind"],
        )
        self.verdicts = Counter(
            "spexis:draft_verdicts",
            "Speculated drafts verified by the last stage, by verdict (accepted, rejected).",
            labelnames=names + ["verdict"],
        )
        self.tokens = Counter(
            "spexis:tokens_committed", "Verified tokens committed by decode rows.", labelnames=names
        )
        self.dropped = Counter(
            "spexis:drafts_dropped",
            "Drafts not speculated on by selective speculation.",
            labelnames=names,
        )
        self.delayed = Counter(
            "spexis:admissions_delayed",
            "Requests look-ahead admission held back at least once (--spexis-lookahead-admission).",
            labelnames=names,
        )
        self.decode_forwards = Counter(
            "spexis:decode_forwards",
            "Stage 0's decode forwards, by how they ran (graph: a CUDA graph replay, eager).",
            labelnames=names + ["mode"],
        )
        self.acceptance = Gauge(
            "spexis:acceptance_rate",
            "Accepted / verified drafts since start.",
            labelnames=names,
            multiprocess_mode="mostrecent",
        )
        self.effective_batch = Gauge(
            "spexis:effective_batch",
            "Committed tokens per decode iteration since start (the paper's B_eff).",
            labelnames=names,
            multiprocess_mode="mostrecent",
        )
        self.tokens_per_row = Gauge(
            "spexis:tokens_per_row",
            "Committed tokens per launched decode row since start (B_eff / B).",
            labelnames=names,
            multiprocess_mode="mostrecent",
        )
        self.alpha = Gauge(
            "spexis:alpha",
            "Selective speculation's drop ratio in force on stage 0 (--spexis-alpha, or the "
            "latest online choice under --spexis-alpha auto).",
            labelnames=names,
            multiprocess_mode="mostrecent",
        )
        # benchmark-only modes (forced acceptance, length oracle): 1 while on, so a dashboard
        # or a scrape can never take such a server's numbers for a real one's
        self.benchmark_mode = Gauge(
            "spexis:benchmark_mode",
            "1 for each benchmark-only mode this server runs in (mode: forced_acceptance, "
            "length_oracle): its outputs or predictions are not the model's.",
            labelnames=names + ["mode"],
            multiprocess_mode="mostrecent",
        )
        for mode in benchmark_modes:
            self.benchmark_mode.labels(**self.labels, mode=mode).set(1)
        self._last: Dict[str, float] = {}

    def update(self, stats: Dict[str, float]) -> None:
        last, self._last = self._last, dict(stats)

        def delta(key: str) -> float:
            return stats[key] - last.get(key, 0)

        for kind, key in (
            ("normal", "rows_normal"),
            ("spec", "rows_spec"),
            ("stale", "rows_stale"),
            ("redone", "rows_redone"),
        ):
            if delta(key):
                self.rows.labels(**self.labels, kind=kind).inc(delta(key))
        for verdict in ("accepted", "rejected"):
            if delta(verdict):
                self.verdicts.labels(**self.labels, verdict=verdict).inc(delta(verdict))
        if delta("tokens_committed"):
            self.tokens.labels(**self.labels).inc(delta("tokens_committed"))
        if delta("drafts_dropped"):
            self.dropped.labels(**self.labels).inc(delta("drafts_dropped"))
        for mode, key in (("graph", "decode_graph_replays"), ("eager", "decode_eager_forwards")):
            if delta(key):
                self.decode_forwards.labels(**self.labels, mode=mode).inc(delta(key))
        if delta("admissions_delayed"):
            self.delayed.labels(**self.labels).inc(delta("admissions_delayed"))
        self.acceptance.labels(**self.labels).set(stats["acceptance_rate"])
        self.effective_batch.labels(**self.labels).set(stats["avg_tokens_per_decode_iteration"])
        self.tokens_per_row.labels(**self.labels).set(stats["effective_batch_ratio"])
        self.alpha.labels(**self.labels).set(stats["alpha"])
