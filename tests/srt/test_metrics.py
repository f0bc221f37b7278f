"""The spexis:* Prometheus series read the same counters /server_info exports (SPStats)."""

from __future__ import annotations

import pytest

from spexis_sglang.core.sp_stats import SPStats
from spexis_sglang.srt.metrics import SpexisMetrics
from spexis_sglang.srt.stats import SP_PHASES, STAT_COUNTERS, PhaseTimer, spexis_state, stat_deltas

prometheus_client = pytest.importorskip("prometheus_client")

LABELS = {"model_name": "contract"}


def sample(name: str, **labels) -> float:
    return prometheus_client.REGISTRY.get_sample_value(name, {**LABELS, **labels}) or 0.0


def test_series_follow_the_counters_by_their_growth():
    metrics = SpexisMetrics(LABELS, benchmark_modes=["forced_acceptance"])
    stats, phases = SPStats(), PhaseTimer(SP_PHASES)
    before = spexis_state(stats, phases)
    for step in range(1, 4):  # three iterations, each counting something
        stats.decode_iterations += 1
        stats.rows_normal += 1
        stats.rows_spec += 3
        stats.rows_redone += 1
        stats.rows_stale += 1
        stats.accepted += 2
        stats.rejected += 1
        stats.tokens_committed += 3
        stats.drafts_dropped += step
        stats.decode_eager_forwards += 1
        stats.admissions_delayed += 1
        stats.alpha = 0.1 * step
        metrics.update(stats)
    metrics.update(stats)  # nothing new: nothing counted twice
    delta = stat_deltas(before, spexis_state(stats, phases))
    assert sample("spexis:rows_total", kind="normal") == delta["rows_normal"] == 3
    assert sample("spexis:rows_total", kind="spec") == delta["rows_spec"] == 9
    assert sample("spexis:rows_total", kind="redone") == delta["rows_redone"] == 3
    assert sample("spexis:rows_total", kind="stale") == delta["rows_stale"] == 3
    assert sample("spexis:draft_verdicts_total", verdict="accepted") == delta["accepted"] == 6
    assert sample("spexis:draft_verdicts_total", verdict="rejected") == delta["rejected"] == 3
    assert sample("spexis:tokens_committed_total") == delta["tokens_committed"] == 9
    assert sample("spexis:drafts_dropped_total") == delta["drafts_dropped"] == 6
    assert sample("spexis:decode_forwards_total", mode="eager") == 3
    assert sample("spexis:admissions_delayed_total") == 3
    assert sample("spexis:acceptance_rate") == pytest.approx(stats.acceptance_rate)
    assert sample("spexis:effective_batch") == pytest.approx(stats.avg_tokens_per_decode_iteration)
    assert sample("spexis:tokens_per_row") == pytest.approx(stats.effective_batch_ratio)
    assert sample("spexis:alpha") == pytest.approx(0.3)
    assert sample("spexis:benchmark_mode", mode="forced_acceptance") == 1
    assert "alpha" not in delta and set(delta) <= set(STAT_COUNTERS)
