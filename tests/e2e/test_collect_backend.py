"""The SGLang collect backend on a real server: the default model's greedy answers, token ids in
and out, equal HF greedy ``generate`` (the teacher-forced pass then labels what SGLang wrote).
It asks the suite's plain PP=1 server (float64 on CPU, exact mode) instead of starting one."""

from __future__ import annotations

import pytest

from spexis_sglang.train.collect import chat_ids, generate_greedy, load_base_model, sglang_generate

from .test_sp_lossless import BASELINE

pytestmark = pytest.mark.e2e


def test_sglang_server_answers_equal_hf_generate(server_factory, model_dir):
    hf_base = load_base_model(model_dir)
    msgs = ["What is the capital of France? One word.", "Write a haiku about rain.", "Say hi"]
    ids = [chat_ids(hf_base, [{"role": "user", "content": m}]) for m in msgs]
    expected = generate_greedy(hf_base, ids, 8)
    got = sglang_generate(server_factory(BASELINE).base_url, ids, 8, hf_base.eos_ids)
    assert got == expected
