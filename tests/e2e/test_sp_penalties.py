"""Penalties and min_new_tokens under SP: greedy outputs equal plain SGLang's with them on.

The penalizers must advance on verified tokens only (a speculative row is penalised by the
committed output plus the drafts it was built on): a penalizer that missed a token, counted
a rejected draft, or lagged a step would change the greedy continuation within 32 tokens.

The baseline is plain SGLang PP=1 with ``--disable-overlap-schedule``. With its default
overlap scheduler, SGLang 0.5.17's penalizers lag one token: ``prepare_for_decode`` cumulates
``req.output_ids[-1]`` before the previous step's result is processed, so the token sampled
at step k is penalised by the prompt's last token and the output up to k - 2 instead of the
output up to k - 1 (``min_new_tokens`` only counts, so it is unaffected). SP penalises by the
exact prefix, as SGLang does without overlap. On these prompts the overlap baseline differed
from SP at 1/8 (frequency, presence) and 4/8 (repetition) prompts, each time where counting
the prompt's last token ("\n") or missing the newest output token decides the argmax.
"""

from __future__ import annotations

from typing import Dict, List, Tuple

import pytest

from .compare import compare_outputs
from .prompts import lossless_prompts, templated
from .test_sp_lossless import sp_args, spexis_stats, trained_head  # noqa: F401

pytestmark = pytest.mark.e2e

NEW_TOKENS = 32
PENALTIES = [
    {"frequency_penalty": 0.5},
    {"presence_penalty": 0.5},
    {"repetition_penalty": 1.3},
]
# answered in a few tokens when nothing forbids the end of sequence
SHORT_ANSWERS = [
    "Answer with one word: what colour is grass?",
    "Say hello.",
    "Reply with just the number: what is 2 + 2?",
    "Is water wet? Answer yes or no.",
]
MIN_NEW_TOKENS = 20
# prompts each penalty is applied to alone (the mixed batch has every penalty on others)
PENALISED = 5
# plain SGLang whose penalizers see exactly the output so far (see the module docstring)
BASELINE = ["--pp-size", "1", "--disable-overlap-schedule"]
# a reasoning parser: requests with ``require_reasoning`` count their reasoning tokens. Only
# this module's pair of servers has it (on the servers other modules share it would move chat
# answers into reasoning_content); this module's requests all go to ``/generate`` without a
# grammar, where a parser changes nothing but that count (SGLang's scheduler uses the parser's
# end-of-thinking ids for ``require_reasoning`` counts and grammar gating only).
REASONING = ["--reasoning-parser", "deepseek-r1"]


@pytest.fixture(scope="module")
def servers(server_factory, trained_head):  # noqa: F811
    return server_factory([*BASELINE, *REASONING]), server_factory(
        sp_args(2, trained_head, *REASONING)
    )


# The four batches below (each penalty on the same prompts; short answers under
# min_new_tokens; penalised and plain requests side by side; reasoning tokens counted) run as
# one request on each server (float64: a request's output does not depend on the batch it
# shares; ``require_reasoning``, a request-wide flag, changes nothing but the counts on
# ``/generate`` without a grammar); each test checks its part.
MIXED_PARAMS = [
    {},
    PENALTIES[0],
    PENALTIES[1],
    PENALTIES[2],
    {"min_new_tokens": MIN_NEW_TOKENS, "ignore_eos": False},
    {"frequency_penalty": 0.3, "presence_penalty": 0.2, "repetition_penalty": 1.1},
    {},
    {"frequency_penalty": -0.4},
]
# stop at the model's end token, <|im_end|> (min_new_tokens holds it off): no extra stop ids
STOP = {"ignore_eos": False}


def _parts(model_dir: str) -> Dict[str, Tuple[List[List[int]], List[dict]]]:
    """name -> (prompts, per-request sampling parameters)."""
    greedy = {"temperature": 0.0, "max_new_tokens": NEW_TOKENS}
    prompts = lossless_prompts(model_dir, 8)
    short = templated(model_dir, SHORT_ANSWERS) + lossless_prompts(model_dir, 2)
    reasoning = templated(model_dir, ["Repeat exactly: </think> done.", *SHORT_ANSWERS[:2]])
    reasoning += lossless_prompts(model_dir, 2)
    penalised = prompts[:PENALISED]
    return {
        "penalties": (
            [p for _ in PENALTIES for p in penalised],
            [{**greedy, "ignore_eos": True, **q} for q in PENALTIES for _ in penalised],
        ),
        "min_new_tokens": (
            short,
            [{**greedy, **STOP, "min_new_tokens": MIN_NEW_TOKENS} for _ in short],
        ),
        "mixed": (prompts, [{**greedy, "ignore_eos": True, **q} for q in MIXED_PARAMS]),
        "reasoning": (reasoning, [{**greedy, **STOP} for _ in reasoning]),
    }


def _run(server, parts) -> Dict[str, List[dict]]:
    """Every part's requests in one batch; the outputs per part."""
    prompts = [p for ps, _ in parts.values() for p in ps]
    sampling = [q for _, qs in parts.values() for q in qs]
    payload = {"input_ids": prompts, "sampling_params": sampling, "require_reasoning": True}
    out = server.generate(payload)
    got, at = {}, 0
    for name, (ps, _) in parts.items():
        got[name], at = out[at : at + len(ps)], at + len(ps)
    return got


def _ids(outputs: List[dict]) -> List[List[int]]:
    return [o["output_ids"] for o in outputs]


@pytest.fixture(scope="module")
def runs(servers, model_dir):
    """The parts on plain SGLang and on SP, SP's counters over its run, and plain SGLang's
    outputs without the penalties (greedy, same prompts) and without min_new_tokens."""
    baseline_server, sp_server = servers
    parts = _parts(model_dir)
    greedy = {"temperature": 0.0, "max_new_tokens": NEW_TOKENS}
    # the references, in the baseline's batch (one batch decodes them in the same steps)
    references = {
        "unpenalized": (
            parts["penalties"][0][:PENALISED],
            [{**greedy, "ignore_eos": True}] * PENALISED,
        ),
        "free": (
            parts["min_new_tokens"][0],
            [{**greedy, **STOP}] * len(parts["min_new_tokens"][0]),
        ),
    }
    expected = _run(baseline_server, {**parts, **references})
    before = spexis_stats(sp_server)
    got = _run(sp_server, parts)
    after = spexis_stats(sp_server)
    unpenalized, free = _ids(expected.pop("unpenalized")), _ids(expected.pop("free"))
    stats = {k: after[k] - before[k] for k in ("rows_spec", "rejected")}
    return parts, expected, got, stats, unpenalized, free


def test_greedy_with_penalties_equals_plain_sglang(runs, model_dir):
    """Each penalty on the same prompts."""
    parts, expected, got, stats, unpenalized, _ = runs
    expected_ids = _ids(expected["penalties"])
    cmp = compare_outputs(model_dir, parts["penalties"][0], expected_ids, _ids(got["penalties"]))
    print("penalties: SP PP=2 vs plain PP=1:", cmp.summary())
    assert cmp.all_identical, cmp.summary()
    # each penalty changes the output (so SP applied it), and SP speculated meanwhile
    n = len(unpenalized)
    for k, params in enumerate(PENALTIES):
        penalized = expected_ids[k * n : (k + 1) * n]
        assert sum(a != b for a, b in zip(penalized, unpenalized)) >= 2, params
    assert stats["rows_spec"] > 0 and stats["rejected"] > 0


def test_min_new_tokens_equals_plain_sglang(runs, model_dir):
    parts, expected, got, _, _, free = runs
    prompts = parts["min_new_tokens"][0]
    want, have = _ids(expected["min_new_tokens"]), _ids(got["min_new_tokens"])
    cmp = compare_outputs(model_dir, prompts, want, have)
    print("min_new_tokens: SP PP=2 vs plain PP=1:", cmp.summary())
    print("lengths without / with min_new_tokens:", [len(x) for x in free], [len(x) for x in have])
    assert cmp.all_identical, cmp.summary()
    # the prompts really stop early without it, and not before MIN_NEW_TOKENS with it
    assert sum(len(x) < MIN_NEW_TOKENS for x in free) >= 2
    assert all(len(x) >= MIN_NEW_TOKENS for x in have)
    assert any(len(x) < NEW_TOKENS for x in have)  # EOS is allowed again afterwards


def test_mixed_batch_equals_plain_sglang(runs, model_dir):
    """Penalised and plain requests share SP's batches; each gets its own parameters."""
    parts, expected, got, _, _, _ = runs
    cmp = compare_outputs(model_dir, parts["mixed"][0], _ids(expected["mixed"]), _ids(got["mixed"]))
    print("mixed batch: SP PP=2 vs plain PP=1:", cmp.summary())
    assert cmp.all_identical, cmp.summary()


def test_reasoning_tokens_equal_plain_sglang(runs, model_dir):
    """``require_reasoning`` requests count the tokens before the parser's end-of-thinking
    marker (``</think>``) per emitted token in SGLang: under SP per verified token, never a
    rejected draft, so the counts equal plain SGLang's."""
    parts, expected, got, _, _, _ = runs
    expected, got = expected["reasoning"], got["reasoning"]
    cmp = compare_outputs(model_dir, parts["reasoning"][0], _ids(expected), _ids(got))
    assert cmp.all_identical, cmp.summary()
    counts = [o["meta_info"]["reasoning_tokens"] for o in expected]
    print("reasoning tokens (plain):", counts, "of", [len(o["output_ids"]) for o in expected])
    assert [o["meta_info"]["reasoning_tokens"] for o in got] == counts
    assert max(counts) > 8  # counted past the first (prefill) token
