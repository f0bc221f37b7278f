"""The length oracle's degradation reaches the stated precision and recall per threshold."""

from __future__ import annotations

import re

import numpy as np
import pytest

from spexis_sglang.core.length_oracle import (
    PRESETS,
    OracleQuality,
    OracleSpecError,
    base_rate_counts,
    buckets_of,
    degraded_predictions,
    false_positive_rate,
    parse_oracle_spec,
)
from spexis_sglang.core.lookahead import DEFAULT_THRESHOLDS

THRESHOLDS = np.asarray(DEFAULT_THRESHOLDS)


def _workload_rows(seed: int, requests: int = 4000):
    """Remaining length of every row of a ShareGPT-like workload (one row per position)."""
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(np.log(180), 1.0, requests).astype(np.int64), 1, 2048)
    remaining = np.concatenate([np.arange(n, 0, -1) for n in lengths])
    positives = sum(base_rate_counts(int(n), THRESHOLDS) for n in lengths)
    return remaining, positives / lengths.sum()


def _precision_recall(remaining, predicted):
    positive = remaining[:, None] < THRESHOLDS[None, :]
    tp = (predicted & positive).sum(0)
    return tp / predicted.sum(0), tp / positive.sum(0)


@pytest.mark.parametrize("preset", ["paper-l70", "paper-q32", "perfect", "low"])
def test_degradation_reaches_the_stated_precision_and_recall(preset):
    if preset == "low":  # our measured predictor's range: low recall, ~0.8 precision
        quality = parse_oracle_spec("0.8/0.17,0.8/0.16,0.8/0.09,0.8/0.09,0.8/0.19")
    else:
        quality = PRESETS[preset]
    remaining, base_rate = _workload_rows(seed=1)
    # the base rate from the requests' lengths is the rows' own
    assert np.allclose(base_rate, (remaining[:, None] < THRESHOLDS).mean(0))
    u = np.random.default_rng(2).random(remaining.shape[0])
    fpr = false_positive_rate(quality.precision, quality.recall, base_rate)
    predicted = degraded_predictions(remaining, u, THRESHOLDS, quality.recall, fpr)
    precision, recall = _precision_recall(remaining, predicted)
    positives = (remaining[:, None] < THRESHOLDS).sum(0)
    print(preset, "positives", positives.tolist(), "precision", precision.round(3).tolist())
    print(preset, "recall", recall.round(3).tolist())
    # >= 4000 positive rows per threshold: a few standard deviations is ~0.02-0.03
    assert positives.min() > 4000
    assert np.allclose(precision, quality.precision, atol=0.03)
    assert np.allclose(recall, quality.recall, atol=0.03)


def test_buckets_follow_the_predictor_convention():
    predicted = np.array(
        [
            [False, True, True, True, True],
            [False] * 5,
            [True] * 5,
            [False, False, False, False, True],
        ]
    )
    assert buckets_of(predicted).tolist() == [1, -1, 0, 4]
    # the perfect oracle's bucket is the true one: smallest threshold above remaining
    remaining = np.array([1, 3, 4, 7, 8, 63, 64, 500])
    q = PRESETS["perfect"]
    fpr = false_positive_rate(q.precision, q.recall, [0.1] * 5)
    got = buckets_of(degraded_predictions(remaining, np.full(8, 0.999), THRESHOLDS, q.recall, fpr))
    assert got.tolist() == [0, 0, 1, 1, 2, 4, -1, -1]


def test_false_positive_rate_edges():
    # no positives / no negatives: nothing to predict falsely
    assert false_positive_rate([0.8], [0.5], [0.0]).tolist() == [0.0]
    assert false_positive_rate([0.8], [0.5], [1.0]).tolist() == [0.0]
    # precision 1: no false positives; below the base rate: capped at 1
    assert false_positive_rate([1.0], [0.5], [0.3]).tolist() == [0.0]
    assert false_positive_rate([0.1], [1.0], [0.5]).tolist() == [1.0]
    # R pi (1-P) / (P (1-pi))
    assert false_positive_rate([0.8], [0.5], [0.2]).tolist() == pytest.approx([0.03125])


def test_specs_parse_and_bad_ones_are_refused():
    assert parse_oracle_spec("paper-l70") is PRESETS["paper-l70"]
    one = parse_oracle_spec("0.9/0.5")
    assert one.precision == (0.9,) * 5 and one.recall == (0.5,) * 5
    five = parse_oracle_spec("0.9/0.1, 0.8/0.2,0.7/0.3,0.6/0.4,0.5/0.5")
    assert five.precision == (0.9, 0.8, 0.7, 0.6, 0.5) and five.recall[-1] == 0.5
    ours = OracleQuality("ours", (0.8,) * 5, (0.1,) * 5)
    assert parse_oracle_spec("ours", ours) is ours
    for bad, message in [
        ("ours", "needs the shipped predictor's calibration"),
        ("paper", "expected a preset"),
        ("0.9/0.5,0.9/0.5", "5 comma-separated P/R pairs"),
        ("0/0.5", "precision must be in (0, 1]"),
        ("0.9/1.5", "recall must be in [0, 1]"),
    ]:
        with pytest.raises(OracleSpecError, match=re.escape(message)):
            parse_oracle_spec(bad)
    assert OracleQuality.from_dict(PRESETS["paper-q32"].as_dict()) == PRESETS["paper-q32"]
