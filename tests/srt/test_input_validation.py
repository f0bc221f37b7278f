"""Token ids the model cannot embed are refused with a clear message before any scheduler
runs them (an out-of-vocabulary id used to kill every rank of the server)."""

from __future__ import annotations

from array import array
from types import SimpleNamespace

import pytest

from spexis_sglang.srt.input_validation import input_ids_error, request_input_error

VOCAB = 49152


@pytest.mark.parametrize("ids", [None, [], [0], [1, 2, VOCAB - 1], array("q", [5, 7])])
def test_valid_ids_pass(ids):
    assert input_ids_error(ids, VOCAB) is None


@pytest.mark.parametrize(
    "ids, bad, position",
    [
        ([999999999], 999999999, 0),
        ([1, 2, VOCAB], VOCAB, 2),
        ([3, -1, 4], -1, 1),
        (array("q", [1, -(2**62)]), -(2**62), 1),
    ],
)
def test_out_of_vocabulary_ids_are_named(ids, bad, position):
    assert input_ids_error(ids, VOCAB) == (
        f"input_ids contains the out-of-vocabulary token id {bad} at position {position}; "
        f"valid ids are 0 to {VOCAB - 1} (vocab size {VOCAB})"
    )


def test_scheduler_side_check_skips_multimodal_prompts():
    bad = array("q", [VOCAB + 5])
    assert "out-of-vocabulary" in request_input_error(
        SimpleNamespace(origin_input_ids=bad, multimodal_inputs=None, return_logprob=False), VOCAB
    )
    # multimodal prompts carry pad values outside the vocabulary by design
    assert (
        request_input_error(
            SimpleNamespace(origin_input_ids=bad, multimodal_inputs={}, return_logprob=False), VOCAB
        )
        is None
    )


def test_tokenizer_manager_refuses_before_sglang_validation(monkeypatch):
    from spexis_sglang.srt.tokenizer_manager import SpexisTokenizerManager

    calls = []

    class Fake(SpexisTokenizerManager):
        def __init__(self):
            self.model_config = SimpleNamespace(vocab_size=VOCAB)

    def stock(self, obj, input_ids):
        calls.append(list(input_ids))

    import sglang.srt.managers.tokenizer_manager as tm

    monkeypatch.setattr(tm.TokenizerManager, "_validate_one_request", stock)
    obj = SimpleNamespace(contains_mm_input=lambda: False)
    with pytest.raises(ValueError, match="out-of-vocabulary token id 999999999"):
        Fake()._validate_one_request(obj, [999999999])
    with pytest.raises(ValueError, match="top_logprobs_num must be in"):
        Fake()._validate_one_request(
            SimpleNamespace(
                contains_mm_input=lambda: False, return_logprob=True, top_logprobs_num=10**6
            ),
            [1],
        )
    Fake()._validate_one_request(obj, [1, 2])
    assert calls == [[1, 2]]


def test_top_logprobs_num_beyond_the_vocabulary_is_refused():
    from spexis_sglang.srt.input_validation import top_logprobs_num_error

    assert top_logprobs_num_error(None, VOCAB) is None
    assert top_logprobs_num_error(5, VOCAB) is None
    assert top_logprobs_num_error(VOCAB, VOCAB) is None
    for bad in (VOCAB + 1, 1000000, -1):
        assert top_logprobs_num_error(bad, VOCAB) == (
            f"top_logprobs_num must be in [0, {VOCAB}] (the vocab size), got {bad}"
        )
    req = SimpleNamespace(
        origin_input_ids=[1],
        multimodal_inputs=None,
        return_logprob=True,
        logprob=SimpleNamespace(top_logprobs_num=10**6),
    )
    assert "top_logprobs_num" in request_input_error(req, VOCAB)


@pytest.mark.parametrize(
    "params, message",
    [
        ({"max_new_tokens": "x"}, "sampling parameter 'max_new_tokens': Expected `int | null`"),
        ({"temperature": "hot"}, "sampling parameter 'temperature': Expected `float`, got `str`"),
        ({"stop": [1]}, "sampling parameter 'stop': Expected `str`, got `int` - at `$[0]`"),
        ({"foo": 1}, "unknown sampling parameter 'foo'"),
        ([1], "sampling_params must be an object, got list"),
    ],
)
def test_sampling_params_sglang_would_answer_with_a_500_are_refused(params, message):
    """SGLang builds ``SamplingParams(**params)`` and does arithmetic on them: an unknown name
    or a string where a number belongs raised a TypeError, a bare HTTP 500."""
    from spexis_sglang.srt.input_validation import sampling_params_error
    from spexis_sglang.srt.tokenizer_manager import sampling_param_types

    assert sampling_params_error(params, sampling_param_types()).startswith(message)


@pytest.mark.parametrize(
    "params",
    [
        None,
        {},
        {"max_new_tokens": 8, "temperature": 0, "top_p": 1, "stop": ["\n"], "n": 2},
        {"temperature": None, "max_new_tokens": None},  # None: SGLang's default
        {"ignore_eos": 1, "stop_token_ids": [2]},  # SGLang reads any value as a boolean
    ],
)
def test_sampling_params_sglang_accepts_pass(params):
    from spexis_sglang.srt.input_validation import sampling_params_error
    from spexis_sglang.srt.tokenizer_manager import sampling_param_types

    assert sampling_params_error(params, sampling_param_types()) is None
