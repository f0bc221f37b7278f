"""benchmark/serving.py: one rate's record from bench_serving's JSON, and max rate under SLO.

Synthetic inputs (no server): the numbers are chosen so that every value below is exact.
"""

import importlib.util
import os

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
_spec = importlib.util.spec_from_file_location(
    "benchmark_serving", os.path.join(HERE, "..", "..", "benchmark", "serving.py")
)
serving = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(serving)


def _bench_result(rate, ttfts, itls, out_lens, errors=None):
    return {
        "request_rate": rate,
        "completed": len(out_lens),
        "duration": 10.0,
        "ttfts": ttfts,
        "itls": itls,
        "output_lens": out_lens,
        "errors": errors or [""] * len(out_lens),
        "request_throughput": len(out_lens) / 10.0,
        "output_throughput": sum(out_lens) / 10.0,
        "total_output_tokens": sum(out_lens),
        "mean_ttft_ms": 1.0,
    }


def test_summarize_rate_normalized_latency_and_spexis_deltas():
    # request 1: (0.5 + 0.25 * 2) / 2 tokens = 0.5 s/token; request 2: (1 + 2) / 1 = 3 s/token
    result = _bench_result(1.0, [0.5, 1.0], [[0.25, 0.25], [2.0]], [2, 1])
    before = {"accepted": 10, "rejected": 10, "tokens_committed": 5, "rows_normal": 5}
    after = {
        "accepted": 16,
        "rejected": 12,
        "tokens_committed": 17,
        "rows_normal": 9,
        "rows_spec": 8,
        "rows_stale": 3,
    }
    rec = serving.summarize_rate(result, before, after, retractions=2)
    assert rec["mean_normalized_latency_s"] == pytest.approx(1.75)
    assert rec["failed"] == 0 and rec["retractions"] == 2
    assert rec["mean_ttft_ms"] == 1.0
    sp = rec["spexis"]
    assert sp["accepted"] == 6 and sp["rejected"] == 2
    assert sp["acceptance_rate"] == pytest.approx(0.75)
    assert sp["tokens_per_row"] == pytest.approx(12 / 15)


def test_failed_requests_are_counted_and_left_out_of_latency():
    result = _bench_result(2.0, [1.0, 0.0], [[1.0], []], [2, 0], errors=["", "timeout"])
    rec = serving.summarize_rate(result, {}, {}, retractions=0)
    assert rec["failed"] == 1
    assert rec["mean_normalized_latency_s"] == pytest.approx(1.0)
    assert "spexis" not in rec  # plain server: no Spexis counters


def _recs(points, failed_at=None):
    return [
        {"request_rate": r, "mean_normalized_latency_s": lat, "failed": int(r == failed_at)}
        for r, lat in points
    ]


def test_max_rate_under_slo_and_ratios():
    results = {
        "plain": _recs([(1, 0.10), (2, 0.15), (4, 0.25), (8, 0.5)]),
        "sp": _recs([(1, 0.08), (2, 0.10), (4, 0.15), (8, 0.21)]),
    }
    a = serving.analyse(results, k=2.0)
    assert a["common_threshold_s"] == pytest.approx(0.16)
    plain, sp = a["configs"]["plain"], a["configs"]["sp"]
    assert plain["max_rate_under_slo"] == 2  # 0.25 > 2 x 0.10
    assert sp["max_rate_under_slo"] == 4  # 0.21 > 2 x 0.08
    assert sp["ratio_vs_first"] == pytest.approx(2.0)
    assert plain["max_rate_under_common_slo"] == 2 and sp["max_rate_under_common_slo"] == 4


def test_a_rate_with_failures_ends_the_range():
    recs = _recs([(1, 0.1), (2, 0.1), (4, 0.1)], failed_at=2)
    assert serving.max_rate_under(recs, 1.0) == 1
