"""Benchmark-only forced acceptance: the vectorised draw is the per-row hash, and a verdict
depends on the request, position and epoch only (every rank draws the same)."""

from __future__ import annotations

import random

import numpy as np

from spexis_sglang.core.row_hash import below64, row_key
from spexis_sglang.core.slot_state import Rows
from spexis_sglang.srt.sp_forced import ForcedAcceptance, uniform64, uniform64_scalar


def test_vectorised_uniform_equals_the_scalar_hash():
    rng = random.Random(0)
    base = [rng.getrandbits(32) for _ in range(500)]
    pos = [rng.randrange(1 << 20) for _ in range(500)]
    ep = [rng.randrange(1 << 16) for _ in range(500)]
    got = uniform64(
        np.array(base, dtype=np.uint64), np.array(pos, dtype=np.uint64), np.array(ep, np.uint64)
    )
    want = [uniform64_scalar(b, p, e) for b, p, e in zip(base, pos, ep)]
    assert got.tolist() == want
    assert 0.0 <= got.min() and got.max() < 1.0
    assert abs(got.mean() - 0.5) < 0.05


def test_below64_is_the_uniform_draw_compared_with_theta():
    """The per-slot key and scaled threshold give the comparison ``uniform64(base, position,
    epoch - epoch0) < theta`` exactly, wrapped sums and thetas at the edges included."""
    rng = np.random.default_rng(1)
    n = 2000
    base = rng.integers(0, 1 << 32, n).astype(np.uint64)
    epoch0 = rng.integers(0, 1 << 20, n)
    epoch = epoch0 + rng.integers(0, 1 << 16, n)
    position = rng.integers(0, 1 << 40, n)
    theta = rng.choice([0.0, 1.0, 0.25, 0.76, 0.999999], n)
    theta[:500] = rng.random(500)
    u = uniform64(base, position.astype(np.uint64), (epoch - epoch0).astype(np.uint64))
    # draws close to a threshold: theta set to the draw itself and its neighbours
    theta[500:600] = u[500:600]
    theta[600:700] = np.nextafter(u[600:700], 2.0)
    theta[700:800] = np.nextafter(u[700:800], -1.0)
    key = np.array([row_key(int(b), int(e)) for b, e in zip(base, epoch0)], dtype=np.uint64)
    got = below64(key, position, epoch, theta * 2.0**64)
    assert got.tolist() == (u < theta).tolist()
    assert 0 < got.sum() < n


class _Req:
    def __init__(self, rid, theta=None):
        self.rid = rid
        self.sampling_params = type(
            "SP", (), {"custom_params": None if theta is None else {"spexis_force_accept": theta}}
        )()


def _rows(slots, positions, epochs):
    n = len(slots)
    return Rows(
        np.array(slots, dtype=np.int64),
        np.array(positions, dtype=np.int64),
        np.array(epochs, dtype=np.int64),
        np.zeros(n, dtype=bool),
        np.zeros(n, dtype=np.int64),
        np.ones(n),
    )


def test_acceptance_rate_and_slot_independence():
    vocab = 100
    fa = ForcedAcceptance(capacity=8, seed=3, default_theta=0.76, vocab_size=vocab)
    fb = ForcedAcceptance(capacity=8, seed=3, default_theta=0.76, vocab_size=vocab)
    fa.admit(2, _Req("a"), epoch=5)
    fb.admit(7, _Req("a"), epoch=40)  # same request in another slot, another epoch origin
    n = 4000
    positions = np.arange(n)
    drafts = positions % vocab
    true_ids = (drafts + 7) % vocab  # the model never agrees
    built = np.ones(n, dtype=bool)
    got_a = fa.true_tokens(_rows([2] * n, positions, [5] * n), true_ids, drafts, built)
    got_b = fb.true_tokens(_rows([7] * n, positions, [40] * n), true_ids, drafts, built)
    assert (got_a == got_b).all()
    accepted = got_a == drafts
    assert abs(accepted.mean() - 0.76) < 0.03
    assert (got_a[~accepted] != drafts[~accepted]).all()
    # rows that verify no draft keep the model's token
    same = fa.true_tokens(_rows([2] * n, positions, [5] * n), true_ids, drafts, ~built)
    assert (same == true_ids).all()


def test_a_requests_own_theta():
    fa = ForcedAcceptance(capacity=4, seed=0, default_theta=0.5, vocab_size=10)
    fa.admit(1, _Req("r", theta=1.0), epoch=0)
    n = 200
    drafts = np.arange(n) % 10
    got = fa.true_tokens(
        _rows([1] * n, np.arange(n), [0] * n), (drafts + 1) % 10, drafts, np.ones(n, bool)
    )
    assert (got == drafts).all()
