"""The server's length oracle: the truth per row from the request's fixed length, the stated
quality on a simulated workload, no prediction without ignore_eos, draws that depend on the
request and position only."""

from __future__ import annotations

import numpy as np
import pytest

from spexis_sglang.core.length_oracle import PRESETS
from spexis_sglang.core.slot_state import Rows
from spexis_sglang.srt.sp_length_oracle import (
    LengthOracle,
    oracle_eligible,
    resolve_oracle_quality,
    shipped_predictor_quality,
)


class _Params:
    def __init__(self, ignore_eos=True, max_new_tokens=100, stop_strs=()):
        self.ignore_eos = ignore_eos
        self.max_new_tokens = max_new_tokens
        self.stop_strs = list(stop_strs)
        self.stop_regex_strs = []


class _Req:
    def __init__(self, rid, **params):
        self.rid = rid
        self.grammar = None
        self.sampling_params = _Params(**params)


def _rows(slot, positions):
    n = len(positions)
    return Rows(
        np.full(n, slot, dtype=np.int64),
        np.asarray(positions, dtype=np.int64),
        np.zeros(n, dtype=np.int64),
        np.zeros(n, dtype=bool),
        np.zeros(n, dtype=np.int64),
        np.ones(n),
    )


def test_perfect_oracle_gives_the_true_bucket():
    oracle = LengthOracle(4, seed=0, quality=PRESETS["perfect"])
    prompt, max_new = 10, 40
    # after the prefill: 1 output token, the first SP row at position 10
    oracle.admit(2, _Req("a", max_new_tokens=max_new), prompt + 1, prompt + max_new)
    positions = np.arange(prompt, prompt + max_new - 1)  # the last row is at 48
    got = oracle.buckets(_rows(2, positions))
    remaining = prompt + max_new - 1 - positions  # 39 ... 1
    assert remaining[-1] == 1 and remaining[0] == max_new - 1
    want = np.select([remaining < t for t in (4, 8, 16, 32, 64)], range(5), -1)
    assert got.tolist() == want.tolist()
    assert oracle.measured() == {"precision": [1.0] * 5, "recall": [1.0] * 5}


@pytest.mark.parametrize(
    "req",
    [
        _Req("x", ignore_eos=False),
        _Req("y", stop_strs=["\n\n"]),
        _Req("z", max_new_tokens=None),
    ],
)
def test_requests_without_a_fixed_length_get_no_prediction(req):
    assert not oracle_eligible(req)
    oracle = LengthOracle(2, seed=0, quality=PRESETS["perfect"])
    oracle.admit(1, req, 11, 50)
    assert (oracle.buckets(_rows(1, np.arange(10, 49))) == -1).all()
    assert oracle.rows_unpredictable == 39 and oracle.rows_asked == 0


def test_stated_quality_on_a_simulated_workload_in_any_slot():
    """Requests of ShareGPT-like lengths reach the paper's Table 4 numbers; the draws depend
    on the request and the position, not on the slot or the batch a row is in."""
    quality = PRESETS["paper-l70"]
    rng = np.random.default_rng(0)
    lengths = np.clip(rng.lognormal(np.log(180), 1.0, 3000).astype(np.int64), 2, 2048)
    n = len(lengths)
    a = LengthOracle(n, seed=5, quality=quality)
    b = LengthOracle(n, seed=5, quality=quality)
    for i, length in enumerate(lengths):  # admitted in the same order, other slots
        a.admit(i, _Req(f"r{i}", max_new_tokens=int(length)), 21, 20 + int(length))
        b.admit(n - 1 - i, _Req(f"r{i}", max_new_tokens=int(length)), 21, 20 + int(length))
    for i, length in enumerate(lengths):
        positions = np.arange(20, 20 + length - 1)
        got = a.buckets(_rows(i, positions))
        # b: the same rows in two batches, last first
        half = len(positions) // 2
        other = np.concatenate(
            [
                b.buckets(_rows(n - 1 - i, positions[half:])),
                b.buckets(_rows(n - 1 - i, positions[:half])),
            ]
        )
        assert (
            got.tolist()
            == np.concatenate(
                [other[len(positions) - half :], other[: len(positions) - half]]
            ).tolist()
        )
    m = a.measured()
    print("paper-l70 measured", m)
    assert np.allclose(m["precision"], quality.precision, atol=0.03)
    assert np.allclose(m["recall"], quality.recall, atol=0.03)
    d = a.as_dict()
    assert d["benchmark_only"] and d["preset"] == "paper-l70"
    assert d["rows_asked"] == int((lengths - 1).sum())


def test_ours_is_the_shipped_calibration():
    ours = shipped_predictor_quality()
    assert resolve_oracle_quality("ours") == ours
    assert ours.thresholds == (4, 8, 16, 32, 64)
    assert all(0.75 <= p <= 0.85 for p in ours.precision)
    assert all(0.0 < r < 0.3 for r in ours.recall)
