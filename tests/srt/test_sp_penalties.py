"""SP's penalizer state equals stock SGLang's after cumulating the same tokens step by step."""

from __future__ import annotations

import random
from types import SimpleNamespace
from typing import List, Optional

import pytest
import torch
from sglang.srt.sampling.penaltylib import (
    BatchedFrequencyPenalizer,
    BatchedMinNewTokensPenalizer,
    BatchedPenalizerOrchestrator,
    BatchedPresencePenalizer,
    BatchedRepetitionPenalizer,
)

from spexis_sglang.core.sp_state import SPState
from spexis_sglang.srt.sp_penalties import (
    needs_penalizer,
    row_output_prefix,
    set_penalizer_state,
)

VOCAB = 37
EOS = 2
PENALIZERS = {
    BatchedFrequencyPenalizer,
    BatchedMinNewTokensPenalizer,
    BatchedPresencePenalizer,
    BatchedRepetitionPenalizer,
}


def _req(frequency=0.0, presence=0.0, repetition=1.0, min_new_tokens=0, stop=None):
    params = SimpleNamespace(
        frequency_penalty=frequency,
        presence_penalty=presence,
        repetition_penalty=repetition,
        min_new_tokens=min_new_tokens,
        stop_token_ids=stop,
    )
    tokenizer = SimpleNamespace(additional_stop_token_ids=None, eos_token_id=EOS)
    return SimpleNamespace(sampling_params=params, tokenizer=tokenizer)


class _Batch:
    """What the orchestrator reads of a ScheduleBatch (it holds the batch weakly)."""

    def __init__(self, reqs):
        self.reqs = reqs
        self.device = "cpu"


def _orchestrator(reqs) -> BatchedPenalizerOrchestrator:
    batch = _Batch(reqs)
    orch = BatchedPenalizerOrchestrator(VOCAB, batch, PENALIZERS)
    orch._keep_batch = batch  # the orchestrator holds the batch weakly
    return orch


def _stock(req, tokens: List[int]) -> BatchedPenalizerOrchestrator:
    """Stock SGLang's way: one cumulate_output_tokens per decode step."""
    orch = _orchestrator([req])
    for t in tokens:
        orch.cumulate_output_tokens(torch.tensor([t], dtype=torch.int64))
    return orch


def _apply(orch, logits: torch.Tensor) -> torch.Tensor:
    out = logits.clone()
    if orch.is_required:
        orch.apply(out)
    return out


def _random_reqs(rng: random.Random, n: int):
    reqs = []
    for _ in range(n):
        kind = rng.randrange(6)
        reqs.append(
            _req(
                frequency=rng.choice([0.0, 0.5, 0.3, -0.7]) if kind in (0, 4) else 0.0,
                presence=rng.choice([0.0, 0.5, 1.1]) if kind in (1, 4) else 0.0,
                repetition=rng.choice([1.0, 1.3, 0.9]) if kind in (2, 4) else 1.0,
                min_new_tokens=rng.choice([0, 3, 20]) if kind in (3, 4) else 0,
                stop={5} if kind == 3 else None,
            )
        )
    return reqs


@pytest.mark.parametrize("seed", range(20))
def test_state_and_logits_equal_stock_cumulation(seed):
    rng = random.Random(seed)
    reqs = _random_reqs(rng, rng.randint(1, 8))
    prefixes: List[Optional[List[int]]] = []
    for req in reqs:
        n = rng.choice([0, 1, 2, 5, 19, 20, 21, 60])
        # few distinct tokens, so tokens repeat often
        prefix = [
            rng.randrange(min(VOCAB, 8)) if rng.random() < 0.7 else rng.randrange(VOCAB)
            for _ in range(n)
        ]
        prefixes.append(prefix if needs_penalizer(req.sampling_params) else None)

    orch = _orchestrator(reqs)
    set_penalizer_state(orch, prefixes)
    logits = torch.randn(len(reqs), VOCAB, generator=torch.Generator().manual_seed(seed)) * 5
    got = _apply(orch, logits)

    for i, (req, prefix) in enumerate(zip(reqs, prefixes)):
        ref = _stock(req, prefix or [])
        want = _apply(ref, logits[i : i + 1])
        assert torch.equal(got[i : i + 1], want), (i, req.sampling_params, prefix)
        # the penalizers' own tensors, bit for bit
        for cls, pen in orch.penalizers.items():
            ref_pen = ref.penalizers[cls]
            if not ref_pen.is_prepared():
                continue
            for name in (
                "cumulated_frequency_penalties",
                "cumulated_presence_penalties",
                "cumulated_repetition_penalties",
                "len_output_tokens",
            ):
                if hasattr(ref_pen, name):
                    assert torch.equal(getattr(pen, name)[i], getattr(ref_pen, name)[0]), name


def test_counts_by_brute_force():
    req = _req(frequency=0.5, presence=0.25, repetition=1.3, min_new_tokens=4)
    prefix = [3, 3, 7, 3, 9]
    orch = _orchestrator([req])
    set_penalizer_state(orch, [prefix])
    pens = orch.penalizers
    freq = pens[BatchedFrequencyPenalizer].cumulated_frequency_penalties[0]
    pres = pens[BatchedPresencePenalizer].cumulated_presence_penalties[0]
    rep = pens[BatchedRepetitionPenalizer].cumulated_repetition_penalties[0]
    for tok in range(VOCAB):
        count = prefix.count(tok)
        assert freq[tok].item() == 0.5 * count
        assert pres[tok].item() == (0.25 if count else 0.0)
        assert rep[tok].item() == pytest.approx(1.3 if count else 1.0)
    assert pens[BatchedMinNewTokensPenalizer].len_output_tokens.tolist() == [[5]]


def test_min_new_tokens_bans_eos_until_enough_tokens():
    req = _req(min_new_tokens=3, stop={5})
    logits = torch.zeros(1, VOCAB)
    for n, banned in ((0, True), (2, True), (3, False), (4, False)):
        orch = _orchestrator([req])
        set_penalizer_state(orch, [[1] * n])
        out = _apply(orch, logits)
        assert bool(torch.isinf(out[0, EOS])) is banned
        assert bool(torch.isinf(out[0, 5])) is banned


def test_out_of_vocab_drafts_are_skipped_and_a_plain_batch_is_untouched():
    req = _req(frequency=1.0)
    orch = _orchestrator([req, _req()])
    set_penalizer_state(orch, [[1, VOCAB + 3, 1], None])
    freq = orch.penalizers[BatchedFrequencyPenalizer].cumulated_frequency_penalties
    assert freq[0, 1].item() == 2.0 and freq.sum().item() == 2.0
    plain = _orchestrator([_req()])
    assert not plain.is_required
    set_penalizer_state(plain, [None])  # nothing to do, no error
    set_penalizer_state(None, [None])


def test_row_output_prefix_from_sp_state():
    """A speculative row's prefix = committed output + the drafts it was built on."""
    prompt_len, output = 4, [11]
    st = SPState()
    st.add("r", prompt_len + len(output), output[-1])
    row = st.launch_next("r")  # normal row at V - 1
    assert not row.is_spec
    assert row_output_prefix(output, st.draft_tokens("r"), prompt_len, row.position) == [11]
    st.on_draft("r", row.position, row.epoch, 21, 0.9)
    spec = st.launch_next("r")
    assert spec.is_spec and spec.position == row.position + 1
    st.on_draft("r", spec.position, spec.epoch, 22, 0.9)
    spec2 = st.launch_next("r")
    assert row_output_prefix(output, st.draft_tokens("r"), prompt_len, spec2.position) == [
        11,
        21,
        22,
    ]
    # the first row's true token rejects draft 21: the rows built on it are stale, and the
    # request continues from the corrected token with no draft in its prefix
    st.on_result("r", row.position, row.epoch, 30)
    output.append(30)
    assert st.draft_tokens("r") == []
    redo = st.launch_next("r")
    assert row_output_prefix(output, st.draft_tokens("r"), prompt_len, redo.position) == [11, 30]
    with pytest.raises(RuntimeError):
        row_output_prefix(output, [], prompt_len, redo.position + 1)
