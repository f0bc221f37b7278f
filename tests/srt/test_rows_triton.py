"""Completing a decode batch of SP rows on the device (``rows_triton``): PyTorch's ops against a
row-by-row reference on CPU, the one-kernel Triton pass against PyTorch's ops on a GPU, and
the fallback when the kernel cannot run."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from spexis_sglang.srt import rows_triton

VOCAB = 50
SLOTS, CONTEXT = 12, 40


def _case(n: int, mode: str, seed: int, spec: bool = True, pool: int = SLOTS):
    """A batch of ``n`` rows on distinct slots, as ``_sp_alloc_kv`` and the transit batch
    leave it: tokens (-1 where speculative), lengths, alternatives (-1 or an earlier
    position), transit rows and their (true token, draft) pairs, KV slots per position."""
    rng = np.random.default_rng(seed)
    slots = rng.permutation(pool)[:n].astype(np.int64)
    lens = rng.integers(4, CONTEXT, n).astype(np.int64)
    tokens = rng.integers(0, VOCAB, n).astype(np.int64)
    if spec:
        tokens[rng.random(n) < 0.6] = -1
    case = {
        "input_ids": tokens,
        "slots": slots,
        "seq_lens": lens,
        "req_to_token": rng.integers(0, 10_000, (pool, CONTEXT)).astype(np.int32),
        "draft_by_slot": rng.integers(0, VOCAB, pool).astype(np.int64) if spec else None,
    }
    if mode in ("verdict", "forced"):
        m = n + 3
        transit = rng.integers(0, VOCAB, (m, 2)).astype(np.int64)
        agree = rng.random(m) < 0.5
        transit[agree, 1] = transit[agree, 0]
        transit[0, 1] = transit[0, 0] = VOCAB - 1  # a forced rejection wraps round the vocab
        has = rng.random(n) < 0.7
        case["alternatives"] = np.where(has, lens - 1 - rng.integers(1, 3, n), -1)
        case["transit_rows"] = np.where(has, rng.permutation(m)[:n], 0).astype(np.int64)
        case["transit"] = transit
        case["forced_vocab"] = VOCAB if mode == "forced" else None
    elif mode == "given":
        case["given_positions"] = lens - 1 - rng.integers(0, 3, n)
    return case


def _expected(case):
    """Row by row, what the launch must run: (tokens, positions or None)."""
    tokens = case["input_ids"].copy()
    slots = case["slots"]
    positions = None
    for i in range(tokens.shape[0]):
        if tokens[i] < 0 and case["draft_by_slot"] is not None:
            tokens[i] = case["draft_by_slot"][slots[i]]
    if "given_positions" in case:
        positions = case["given_positions"].copy()
    elif "alternatives" in case:
        positions = case["seq_lens"] - 1
        for i, alternative in enumerate(case["alternatives"]):
            if alternative < 0:
                continue
            true_id, draft = case["transit"][case["transit_rows"][i]]
            if case["forced_vocab"] is not None:  # every row left with one is rejected
                tokens[i] = (draft + 1) % VOCAB if true_id == draft else true_id
                positions[i] = alternative
            elif true_id != draft:
                tokens[i], positions[i] = true_id, alternative
    return tokens, positions


def _tensors(case, device: str):
    # copies: the lengths are rewritten in place
    t = {
        k: torch.tensor(v, device=device) if isinstance(v, np.ndarray) else v
        for k, v in case.items()
    }
    lens = t.pop("seq_lens")
    # as _sp_alloc_kv lays them out: int32 lengths inside an int64 buffer
    orig = torch.zeros((lens.shape[0] + 1) // 2, dtype=torch.int64, device=device)
    orig = orig.view(torch.int32)[: lens.shape[0]]
    orig.copy_(lens)
    return t.pop("input_ids"), t.pop("slots"), lens, orig, t.pop("req_to_token"), t


def _run(fn, case, device: str):
    ids, slots, lens, orig, req_to_token, kwargs = _tensors(case, device)
    out_ids, positions, loc = fn(ids, slots, lens, orig, req_to_token, **kwargs)
    return out_ids, positions, loc, lens, orig


CASES = [
    (n, mode, seed, spec)
    for n, mode in [(1, "verdict"), (7, "verdict"), (9, "forced"), (10, "given"), (8, "spec")]
    for seed in range(3)
    for spec in (True, False)
    if mode != "spec" or spec
]


@pytest.mark.parametrize("n,mode,seed,spec", CASES)
def test_torch_ops_complete_rows_as_the_rows_say(n, mode, seed, spec):
    case = _case(n, mode, seed, spec)
    want_ids, want_pos = _expected(case)
    ids, positions, loc, lens, orig = _run(rows_triton.resolve_rows_torch, case, "cpu")
    assert ids.tolist() == want_ids.tolist()
    if want_pos is None:  # no alternatives: lengths and KV slots as the host set them
        assert positions is None and loc is None
        assert lens.tolist() == case["seq_lens"].tolist()
        return
    assert positions.tolist() == want_pos.tolist()
    assert lens.tolist() == (want_pos + 1).tolist() == orig.tolist()
    assert loc.dtype == torch.int64
    assert loc.tolist() == case["req_to_token"][case["slots"], want_pos].tolist()
    if mode != "given":  # some rows were redone and some were not
        moved = want_pos != case["seq_lens"] - 1
        assert moved.any() or n == 1


@pytest.mark.skipif(
    not (torch.cuda.is_available() and rows_triton.triton is not None), reason="needs a GPU"
)
@pytest.mark.parametrize("n,mode,seed,spec", CASES + [(600, "verdict", 0, True)])
def test_fused_kernel_equals_torch_ops_on_gpu(n, mode, seed, spec):
    # 600 rows: more than a program takes
    case = _case(n, mode, seed, spec, pool=max(SLOTS, n + 5))
    want = _run(rows_triton.resolve_rows_torch, case, "cuda")
    got = _run(rows_triton.resolve_rows_fused, case, "cuda")
    for w, g in zip(want, got):
        if w is None:
            assert g is None
        else:
            assert g.dtype == w.dtype and g.tolist() == w.tolist()


def test_a_kernel_that_cannot_run_falls_back_to_torch_ops(monkeypatch, caplog):
    case = _case(7, "verdict", 0)
    want = _run(rows_triton.resolve_rows_torch, case, "cpu")

    def broken(*args, **kwargs):
        raise RuntimeError("no kernel image for this device")

    monkeypatch.setattr(rows_triton.FUSED_ROWS, "on", True)
    # as on a GPU with Triton
    monkeypatch.setattr(rows_triton, "fused_available", lambda ids: True)
    monkeypatch.setattr(rows_triton, "resolve_rows_fused", broken)
    with caplog.at_level("WARNING"):
        got = _run(rows_triton.resolve_rows, case, "cpu")
    assert [g.tolist() for g in got] == [w.tolist() for w in want]
    assert "fused row kernel failed" in caplog.text
    assert not rows_triton.FUSED_ROWS.on  # said once: PyTorch's ops from here on
