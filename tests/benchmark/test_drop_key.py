"""benchmark/quality/drop_key.py's pure functions on synthetic rows (no model): the AUC is the
Mann-Whitney statistic, the lagged key never crosses a sequence, and the drop simulation
separates a perfect key from a random one."""

from __future__ import annotations

import itertools
import os
import sys

import numpy as np
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "benchmark", "quality"))

import drop_key  # noqa: E402


def _mann_whitney(score, label) -> float:
    """P(accepted outranks rejected), ties counted half: the AUC by its definition."""
    pos = [s for s, y in zip(score, label) if y]
    neg = [s for s, y in zip(score, label) if not y]
    wins = sum(1.0 if p > n else 0.5 if p == n else 0.0 for p, n in itertools.product(pos, neg))
    return wins / (len(pos) * len(neg))


def test_roc_auc_is_the_mann_whitney_statistic_with_ties():
    score = [0.9, 0.4, 0.4, 0.7, 0.1, 0.4, 0.8, 0.2]
    label = [1, 0, 1, 1, 0, 0, 0, 1]
    # 4 accepted x 4 rejected: 0.9 beats 4; 0.4 ties 2, beats 1; 0.7 beats 3; 0.2 beats 1
    assert drop_key.roc_auc(score, label) == pytest.approx(10 / 16)
    assert drop_key.roc_auc(score, label) == pytest.approx(_mann_whitney(score, label))
    rng = np.random.default_rng(3)
    s = rng.integers(0, 5, 40).astype(float)  # many ties
    y = rng.random(40) < 0.5
    assert drop_key.roc_auc(s, y) == pytest.approx(_mann_whitney(s, y))


def test_roc_auc_perfect_inverted_tied_and_one_class():
    label = np.array([0, 0, 1, 1, 1], dtype=bool)
    score = np.array([0.1, 0.2, 0.3, 0.4, 0.5])
    assert drop_key.roc_auc(score, label) == 1.0
    assert drop_key.roc_auc(-score, label) == 0.0
    assert drop_key.roc_auc(np.ones(5), label) == 0.5
    assert np.isnan(drop_key.roc_auc(score, np.ones(5, dtype=bool)))
    with pytest.raises(ValueError):
        drop_key.roc_auc([0.1, np.nan], [True, False])


def test_lag_reads_the_previous_position_of_the_same_sequence_only():
    # two sequences, rows shuffled; sequence 1 has a gap at position 6
    seq = np.array([0, 0, 0, 1, 1, 1, 1])
    pos = np.array([3, 4, 5, 3, 4, 5, 7])
    val = np.array([10.0, 11.0, 12.0, 20.0, 21.0, 22.0, 24.0])
    perm = np.random.default_rng(0).permutation(len(seq))
    lag = drop_key.lag_within_sequences(seq[perm], pos[perm], val[perm], fill=-1.0)
    expect = np.array([-1.0, 10.0, 11.0, -1.0, 20.0, 21.0, -1.0])
    np.testing.assert_array_equal(lag, expect[perm])
    # the first row of sequence 1 must not read sequence 0's last value (12.0)
    assert 12.0 not in lag


def test_lag_never_crosses_a_boundary_on_many_sequences():
    rng = np.random.default_rng(1)
    lengths = rng.integers(1, 9, 50)
    seq = np.repeat(np.arange(50), lengths)
    pos = np.concatenate([np.arange(n) + 7 for n in lengths])
    val = seq * 1000.0 + pos
    lag = drop_key.lag_within_sequences(seq, pos, val)
    first = pos == 7
    assert np.isnan(lag[first]).all()
    np.testing.assert_array_equal(lag[~first], val[~first] - 1)


def _rows(n_seq: int = 60, per_seq: int = 40, p_accept: float = 0.6, seed: int = 0):
    rng = np.random.default_rng(seed)
    seq = np.repeat(np.arange(n_seq), per_seq)
    accept = rng.random(seq.size) < p_accept
    return seq, accept, rng


def test_batches_take_each_sequence_once_until_the_batch_needs_more():
    seq, _, rng = _rows(n_seq=60, per_seq=5)
    small = drop_key.sample_batches(seq, 32, 50, rng)
    assert small.shape == (50, 32)
    assert all(len(set(seq[b])) == 32 for b in small)
    large = drop_key.sample_batches(seq, 128, 50, rng)
    for b in large:
        assert len(set(b)) == 128  # distinct rows
        counts = np.bincount(seq[b], minlength=60)
        assert counts.min() == 2 and counts.max() == 3
    with pytest.raises(ValueError):
        drop_key.sample_batches(seq, 301, 1, rng)


def test_perfect_key_drops_no_accepted_draft_while_rejections_last():
    seq, accept, rng = _rows(p_accept=0.5)
    perfect = accept.astype(float) + 0.01 * rng.random(accept.size)
    res = drop_key.simulate_drops(accept, {"perfect": perfect}, seq, [32], [0.1, 0.9], 500, rng)
    low = res["32"]["0.1"]  # 3 of 32 dropped; a batch has ~16 rejections
    assert low["perfect"]["dropped_per_batch"] == 3
    assert low["perfect"]["accepted_lost"] == 0.0
    assert low["perfect"]["acceptance_dropped"] == 0.0
    assert low["oracle"] == low["perfect"]
    # 28 of 32 dropped: more than the rejections, so all 4 kept are accepted
    assert res["32"]["0.9"]["perfect"]["acceptance_kept"] == 1.0


def test_random_key_drops_accepted_drafts_at_the_base_rate():
    seq, accept, rng = _rows(p_accept=0.6)
    keys = {"random": rng.random(accept.size), "inverted": 1.0 - accept}
    res = drop_key.simulate_drops(accept, keys, seq, [32, 128], [0.3], 1000, rng)
    for b in ("32", "128"):
        r = res[b]["0.3"]["random"]
        k = r["dropped_per_batch"]
        assert k == int(0.3 * int(b))
        assert r["acceptance_dropped"] == pytest.approx(accept.mean(), abs=0.02)
        assert r["acceptance_kept"] == pytest.approx(accept.mean(), abs=0.02)
        assert r["accepted_lost"] == pytest.approx(k / int(b), abs=0.02)
        # the worst key drops accepted drafts only
        assert res[b]["0.3"]["inverted"]["acceptance_dropped"] == 1.0


def test_nan_keys_are_dropped_first_as_the_server_does():
    seq, accept, rng = _rows(p_accept=0.5)
    key = np.where(accept, 0.5, np.nan)  # NaN = lowest: rejected rows go first
    res = drop_key.simulate_drops(accept, {"nan": key}, seq, [32], [0.1], 200, rng)
    assert res["32"]["0.1"]["nan"]["accepted_lost"] == 0.0


def test_bootstrap_interval_covers_the_auc_and_orders_keys():
    seq, accept, rng = _rows(n_seq=40, per_seq=30)
    good = accept + rng.normal(0, 0.7, accept.size)
    keys = {"good": good, "random": rng.random(accept.size)}
    ci = drop_key.bootstrap_auc(seq, accept, keys, 200, rng)
    auc = drop_key.roc_auc(good, accept)
    assert ci["good"][0] < auc < ci["good"][1]
    rand = drop_key.roc_auc(keys["random"], accept)
    assert ci["random"][0] < rand < ci["random"][1] and abs(rand - 0.5) < 0.05
    assert ci["good_minus_random"][0] > 0
