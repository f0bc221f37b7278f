"""Grammars under SP (``srt/sp_grammar.py``) on a small vocabulary with xgrammar's real matcher.

The contract test drives :class:`SPState` through an N-stage pipeline with a fake target and a
fake draft model (deterministic functions of the prefix) and checks that SP emits exactly the
tokens of stock SGLang's decode loop under the same grammar (mask from the committed state, then
``update_finish_state``, then ``accept_token``), with and without draft masking.
"""

from __future__ import annotations

import dataclasses
import random
from collections import deque
from types import SimpleNamespace
from typing import List, Optional

import pytest
import torch
import xgrammar as xgr
from sglang.srt.constrained.xgrammar_backend import XGrammarGrammar

from spexis_sglang.core.sp_state import Outcome, SPState
from spexis_sglang.srt.sp_grammar import (
    accept_committed,
    draft_mask_of,
    grammar_request_error,
    invalid_draft_rows,
    row_masks,
)

EOS = 0
VOCAB = ["<eos>", "a", "b", "c", "ab", "ba", "abc", "x", "y", "1", "2", "12", "{", "}", '"', ":"]
VOCAB += ["q", "r", "s", "t", "aa", "bb", "cb", "xy"]
V = len(VOCAB)
GRAMMARS = {
    "regex_end": ("regex", r"[ab]{2,7}c(12|1|2)?"),
    "regex_loop": ("regex", r"x(ab|ba|a)*y"),
    "ebnf": ("ebnf", 'root ::= "{" pair ("," pair)* "}"\npair ::= "\\"" [ab]+ "\\":" [12]+'),
}


@pytest.fixture(scope="module")
def compiler():
    info = xgr.TokenizerInfo(VOCAB, xgr.VocabType.RAW, stop_token_ids=[EOS])
    return xgr.GrammarCompiler(info)


def make_grammar(compiler, name: str) -> XGrammarGrammar:
    kind, source = GRAMMARS[name]
    ctx = compiler.compile_regex(source) if kind == "regex" else compiler.compile_grammar(source)
    return XGrammarGrammar(xgr.GrammarMatcher(ctx), V, ctx, None, source)


def allowed(grammar: XGrammarGrammar) -> List[int]:
    """The tokens a grammar allows next (all of them once it has terminated, as stock)."""
    if grammar.is_terminated():
        return list(range(V))
    mask = grammar.allocate_vocab_mask(V, 1, "cpu")
    grammar.fill_vocab_mask(mask, 0)
    logits = torch.zeros(1, V)
    grammar.apply_vocab_mask(logits, mask)
    return (logits[0] == 0).nonzero().flatten().tolist()


def mask_rows(mask, n: int) -> List[List[int]]:
    logits = torch.zeros(n, V)
    if mask is not None:
        mask.apply(logits)
    return [(logits[i] == 0).nonzero().flatten().tolist() for i in range(n)]


def reference_allowed(compiler, name: str, prefix: List[int]) -> Optional[List[int]]:
    """A fresh matcher fed ``prefix`` as stock would (None: a token of it is forbidden)."""
    g = make_grammar(compiler, name)
    for t in prefix:
        if g.is_terminated():
            break
        if not g.matcher.accept_token(t):
            return None
    return allowed(g)


# ------------------------------------------------------------------------------------------------
# row masks
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(GRAMMARS))
def test_row_masks_equal_a_fresh_matchers_after_committed_plus_drafts(compiler, name):
    rng = random.Random(name)
    for trial in range(60):
        committed, live = [], make_grammar(compiler, name)
        for _ in range(rng.randrange(0, 6)):  # a valid committed prefix
            if live.is_terminated():
                break
            t = rng.choice(allowed(live))
            live.accept_token(t)
            committed.append(t)
        before = allowed(live)
        drafts = []
        for _ in range(rng.randrange(0, 4)):  # mostly valid drafts, sometimes anything
            choices = reference_allowed(compiler, name, committed + drafts) or list(range(V))
            drafts.append(rng.randrange(V) if rng.random() < 0.3 else rng.choice(choices))
        other = make_grammar(compiler, name)
        mask = row_masks([None, live, other], [(), drafts, ()], V, "cpu")
        rows = mask_rows(mask, 3)
        assert rows[0] == list(range(V))  # no grammar: unconstrained
        assert rows[2] == allowed(other)
        expected = reference_allowed(compiler, name, committed + drafts)
        assert rows[1] == (expected if expected is not None else list(range(V))), (trial, drafts)
        assert allowed(live) == before  # the live matcher is back at the committed state
        assert live.accepted_tokens == committed
        assert invalid_draft_rows([live], [drafts]) == ([] if expected is not None else [0])


def test_no_grammar_no_mask(compiler):
    assert row_masks([None, None], [(), (1,)], V, "cpu") is None


def test_rows_after_the_grammar_terminated_are_unconstrained(compiler):
    g = make_grammar(compiler, "regex_end")
    ids = {t: i for i, t in enumerate(VOCAB)}
    for t in ("ab", "a", "c", "12"):
        g.accept_token(ids[t])
    assert allowed(g) == [EOS]  # complete: only the stop token
    rows = mask_rows(row_masks([g, g], [(), (EOS,)], V, "cpu"), 2)
    assert rows[0] == [EOS]
    assert rows[1] == list(range(V))  # drafted EOS terminates it: the next token is free
    assert not g.is_terminated()


# ------------------------------------------------------------------------------------------------
# commit, request checks, the sampler hook
# ------------------------------------------------------------------------------------------------


class FakeReq:
    def __init__(self, grammar, max_new_tokens: int = 64):
        self.rid = "r"
        self.grammar = grammar
        self.output_ids: List[int] = []
        self.origin_input_ids = [5, 6, 7]
        self.max_new_tokens = max_new_tokens
        self.to_finish = None
        self.finished_reason = None

    def finished(self) -> bool:
        return self.finished_reason is not None

    def update_finish_state(self) -> None:
        """The part of SGLang's ``Req.update_finish_state`` that concerns grammars."""
        if self.to_finish is not None:
            self.finished_reason, self.to_finish = self.to_finish, None
        elif len(self.output_ids) >= self.max_new_tokens:
            self.finished_reason = "length"
        elif self.grammar is not None and self.grammar.is_terminated():
            self.finished_reason = "matched"


def test_accept_committed_advances_and_syncs_finished(compiler):
    req = FakeReq(make_grammar(compiler, "regex_loop"))
    accept_committed(req, VOCAB.index("x"))
    assert req.grammar.accepted_tokens == [VOCAB.index("x")] and not req.grammar.finished
    accept_committed(req, VOCAB.index("q"))  # forbidden: stock aborts the request
    assert req.to_finish is not None
    req.update_finish_state()
    accept_committed(req, VOCAB.index("y"))
    assert req.grammar.finished
    accept_committed(FakeReq(None), 3)  # no grammar: nothing to do


def test_grammar_requests_are_served_except_in_forced_mode_or_other_backends(compiler):
    params = SimpleNamespace(regex="[ab]+", json_schema=None, ebnf=None, structural_tag=None)
    plain = SimpleNamespace(regex=None, json_schema=None, ebnf=None, structural_tag=None)
    g = make_grammar(compiler, "regex_end")
    assert grammar_request_error(params, g, forced=False) is None
    assert grammar_request_error(plain, None, forced=False) is None
    assert grammar_request_error(plain, None, forced=True) is None
    err = grammar_request_error(params, g, forced=True)
    assert "--spexis-benchmark-force-accept does not support regex" in err
    other = SimpleNamespace()  # e.g. an outlines or llguidance grammar
    err = grammar_request_error(params, other, forced=False)
    assert "xgrammar backend only" in err and "SimpleNamespace" in err


def _sampling_info(grammars, batch):
    from spexis_sglang.srt.sp_sampling import SPSamplingBatchInfo

    ones = torch.ones(batch)
    return SPSamplingBatchInfo(
        temperatures=ones.view(-1, 1),
        top_ps=ones,
        top_ks=torch.ones(batch, dtype=torch.int32),
        min_ps=torch.zeros(batch),
        is_all_greedy=True,
        is_any_greedy=True,
        need_top_p_sampling=False,
        need_top_k_sampling=False,
        need_min_p_sampling=False,
        vocab_size=V,
        grammars=grammars,
        device="cpu",
    )


def test_row_masks_replace_the_stock_fill_and_reach_the_draft_head(compiler):
    """A batch's own row masks replace SGLang's fill from the committed states (None: no row
    constrained); without them the stock fill runs; the draft mask reaches the forward."""
    g = make_grammar(compiler, "regex_loop")
    mask = row_masks([g], [()], V, "cpu")
    info = _sampling_info([g], 1)
    info.update_regex_vocab_mask()  # stock: a mask from g's committed state
    assert info.grammar_mask is not None and info.grammar_mask is not mask
    info.rows_masked, info.row_mask = True, mask
    info.update_regex_vocab_mask()
    assert info.grammar_mask is mask
    info.row_mask = None
    info.update_regex_vocab_mask()
    assert info.grammar_mask is None
    assert draft_mask_of(SimpleNamespace(sampling_info=info)) is None
    info.draft_mask = mask
    # the forward's copy (SGLang's copy_for_forward: a dataclasses.replace) keeps the mask
    forward = SimpleNamespace(sampling_info=dataclasses.replace(info))
    assert draft_mask_of(forward) is mask
    assert draft_mask_of(SimpleNamespace(sampling_info=None)) is None


# ------------------------------------------------------------------------------------------------
# contract: SP's committed tokens are stock SGLang's
# ------------------------------------------------------------------------------------------------


def _logits(seed: int, prefix: List[int]) -> torch.Tensor:
    rng = random.Random(hash((seed, *prefix)))
    return torch.tensor([rng.gauss(0, 1) for _ in range(V)])


def _target(prefix):
    # EOS is unlikely unless forced: outputs run until the grammar ends them
    return _logits(1, prefix) - 3.0 * torch.nn.functional.one_hot(torch.tensor(EOS), V)


def _draft(prefix):
    return _target(prefix) + 1.2 * _logits(2, prefix)  # agrees with the target often


def _argmax(logits: torch.Tensor, mask_row) -> int:
    logits = logits.clone()
    if mask_row is not None:
        forbidden = torch.ones(V, dtype=torch.bool)
        forbidden[mask_row] = False
        logits[forbidden] = float("-inf")
    return int(logits.argmax())


def stock_decode(compiler, name: str, max_new: int) -> List[int]:
    """Stock SGLang's loop: mask from the committed state, sample, finish check, accept."""
    req = FakeReq(make_grammar(compiler, name), max_new)
    while not req.finished():
        y = _argmax(_target(req.output_ids), allowed(req.grammar))
        req.output_ids.append(y)
        req.update_finish_state()
        accept_committed(req, y)
    return list(req.output_ids)


def sp_decode(compiler, name: str, max_new: int, stages: int, draft_mask: bool):
    """SP over ``stages`` pipeline stages: rows on drafts, row masks at launch, verification."""
    req = FakeReq(make_grammar(compiler, name), max_new)
    # the prefill's token (stock processing)
    y = _argmax(_target([]), allowed(req.grammar))
    req.output_ids.append(y)
    req.update_finish_state()
    accept_committed(req, y)
    st = SPState()
    prompt = len(req.origin_input_ids)
    st.add(req.rid, prompt + 1, y)
    pipe: deque = deque()  # one entry per iteration: the row launched then, or None
    invalid_rows = 0
    while req.rid in st or any(pipe):
        launched = None
        if req.rid in st:
            row = st.next_row(req.rid)
            if row is not None and row.position + 1 - prompt < max_new:
                epoch = st.on_launch(req.rid, row.position, row.token, row.is_spec)
                drafts = st.draft_tokens(req.rid)
                prefix = req.output_ids + drafts
                assert len(prefix) == row.position + 1 - prompt
                mask = mask_rows(row_masks([req.grammar], [drafts], V, "cpu"), 1)[0]
                invalid_rows += len(invalid_draft_rows([req.grammar], [drafts]))
                true = _argmax(_target(prefix), mask)
                draft = _argmax(_draft(prefix), mask if draft_mask else None)
                launched = (row.position, epoch, true, draft)
                st.on_draft(req.rid, row.position, epoch, draft, 0.5)
            elif row is not None:
                st.drop_draft(req.rid)  # past max_new_tokens: wait for verification
        pipe.append(launched)
        if len(pipe) < stages:
            continue
        returned = pipe.popleft()  # the row launched N - 1 iterations ago
        if returned is None:
            continue
        position, epoch, true, draft = returned
        outcome = st.on_result(req.rid, position, epoch, true, launched_draft=draft)
        if outcome is not Outcome.STALE:
            req.output_ids.append(true)
            req.update_finish_state()
            accept_committed(req, true)
            if req.finished():
                st.remove(req.rid)
    return list(req.output_ids), st.stats, invalid_rows


@pytest.mark.parametrize("stages", [2, 4])
@pytest.mark.parametrize("name", sorted(GRAMMARS))
def test_sp_commits_exactly_stock_sglangs_tokens(compiler, name, stages):
    totals = {}
    for draft_mask in (False, True):
        acc = rej = invalid = 0
        for max_new in (3, 9, 17, 40):
            expected = stock_decode(compiler, name, max_new)
            got, stats, invalid_rows = sp_decode(compiler, name, max_new, stages, draft_mask)
            assert got == expected, (max_new, draft_mask)
            acc, rej, invalid = acc + stats.accepted, rej + stats.rejected, invalid + invalid_rows
        totals[draft_mask] = (acc, rej, invalid)
    # drafts masked with the grammar are never forbidden, and the unmasked ones sometimes are
    assert totals[True][2] == 0
    assert totals[False][2] > 0
    rate = {k: a / max(1, a + r) for k, (a, r, _) in totals.items()}
    assert rate[True] >= rate[False], totals
