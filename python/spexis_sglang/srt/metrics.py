"""Spexis' Prometheus metrics (``spexis:*``), exported through SGLang's ``/metrics``.

SGLang sets up multiprocess Prometheus collection when ``--enable-metrics`` is on; metrics
created in a scheduler process with the scheduler's labels appear next to ``sglang:*``.
Only stage 0 reports (every rank sees the same verdicts, so one is enough). The series are
read from the scheduler's one set of counters (:class:`~spexis_sglang.core.sp_stats.SPStats`),
the object ``/server_info`` exports too; what each counts is said there and in docs/metrics.md.
"""

from __future__ import annotations

from typing import Dict, Sequence

from spexis_sglang.core.sp_stats import SPStats

# Prometheus counter label -> SPStats field, per labelled series
_ROW_KINDS = (
    ("normal", "rows_normal"),
    ("spec", "rows_spec"),
    ("stale", "rows_stale"),
    ("redone", "rows_redone"),
)
_VERDICTS = (("accepted", "accepted"), ("rejected", "rejected"))
_FORWARD_MODES = (
    ("graph", "decode_graph_replays"),
    ("eager", "decode_eager_forwards"),
    ("mixed", "mixed_forwards"),
)


class SpexisMetrics:
    """The ``spexis:*`` series, brought up to the scheduler's counters once per iteration
    (a Prometheus counter only grows by increments: each takes what its field grew by)."""

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
            "Stage 0's forwards of SP rows, by how they ran (graph: a CUDA graph replay, eager, "
            "mixed: riding along a prefill chunk).",
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
        # the counters as the series last took them
        self._taken: Dict[str, int] = dict.fromkeys(SPStats.counter_names(), 0)

    def update(self, stats: SPStats) -> None:
        taken = self._taken

        def grown(field: str) -> int:
            now = getattr(stats, field)
            delta, taken[field] = now - taken[field], now
            return delta

        for label, field in _ROW_KINDS:
            if n := grown(field):
                self.rows.labels(**self.labels, kind=label).inc(n)
        for label, field in _VERDICTS:
            if n := grown(field):
                self.verdicts.labels(**self.labels, verdict=label).inc(n)
        for label, field in _FORWARD_MODES:
            if n := grown(field):
                self.decode_forwards.labels(**self.labels, mode=label).inc(n)
        if n := grown("tokens_committed"):
            self.tokens.labels(**self.labels).inc(n)
        if n := grown("drafts_dropped"):
            self.dropped.labels(**self.labels).inc(n)
        if n := grown("admissions_delayed"):
            self.delayed.labels(**self.labels).inc(n)
        self.acceptance.labels(**self.labels).set(stats.acceptance_rate)
        self.effective_batch.labels(**self.labels).set(stats.avg_tokens_per_decode_iteration)
        self.tokens_per_row.labels(**self.labels).set(stats.effective_batch_ratio)
        self.alpha.labels(**self.labels).set(stats.alpha)
