"""SP's decode batches ask for logprobs like stock SGLang's, and only committed rows record them."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from spexis_sglang.srt.sp_logprobs import DecodeLogprobs, set_decode_logprob_fields


def _req(return_logprob: bool, top: int = 0, ids=None):
    lp = SimpleNamespace(
        top_logprobs_num=top,
        token_ids_logprob=ids,
        output_token_logprobs_val=[],
        output_token_logprobs_idx=[],
        output_top_logprobs_val=[],
        output_top_logprobs_idx=[],
        output_token_ids_logprobs_val=[],
        output_token_ids_logprobs_idx=[],
    )
    return SimpleNamespace(return_logprob=return_logprob, logprob=lp)


def test_batch_fields_follow_the_rows():
    batch = SimpleNamespace()
    set_decode_logprob_fields(batch, [_req(False), _req(False)])
    assert batch.return_logprob is False and batch.top_logprobs_nums is None
    set_decode_logprob_fields(batch, [_req(False), _req(True, 3, [7]), _req(True, 3, [7])])
    assert batch.return_logprob is True
    assert batch.top_logprobs_nums == [0, 3, 3]
    assert batch.token_ids_logprobs == [None, [7], [7]]


def test_only_recorded_rows_reach_the_request():
    out = SimpleNamespace(
        next_token_logprobs=torch.tensor([-0.5, -1.5, -2.5]),
        next_token_top_logprobs_val=[[], torch.tensor([-0.1, -2.0]), [-0.2, -3.0]],
        next_token_top_logprobs_idx=[[], [4, 5], [6, 7]],
        next_token_token_ids_logprobs_val=[[], [-9.0], [-8.0]],
        next_token_token_ids_logprobs_idx=[[], [7], [7]],
    )
    batch = SimpleNamespace(return_logprob=True)
    lp = DecodeLogprobs.from_result(batch, SimpleNamespace(logits_output=out))
    plain, a = _req(False), _req(True, 2, [7])
    lp.record(plain, 0, 11)
    # row 1 is a stale row of request a (never recorded); row 2 is its committed one
    lp.record(a, 2, 12)
    assert plain.logprob.output_token_logprobs_val == []
    assert a.logprob.output_token_logprobs_val == [-2.5]
    assert a.logprob.output_token_logprobs_idx == [12]
    assert a.logprob.output_top_logprobs_val == [[-0.2, -3.0]]
    assert a.logprob.output_top_logprobs_idx == [[6, 7]]
    assert a.logprob.output_token_ids_logprobs_val == [[-8.0]]
    assert a.logprob.output_token_ids_logprobs_idx == [[7]]
    assert DecodeLogprobs.from_result(SimpleNamespace(return_logprob=False), None) is None
