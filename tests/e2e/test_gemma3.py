"""Gemma 3 under SP: SGLang 0.5.17's Gemma 3 has no pipeline stages, Spexis' class adds them
(``srt/model_gemma3.py``); greedy output equals plain SGLang's PP=1 token for token.

A tiny random Gemma 3 (5 layers, one KV head, sliding window 8, per-layer-type RoPE, tied
embedding) keeps it fast; the real Gemma 3 270M run is ``benchmark/quality/gemma3_serving.py``.
"""

from __future__ import annotations

import os

import pytest
import torch

from .compare import compare_outputs
from .conftest import model_modules_env
from .prompts import templated
from .test_sp_lossless import sp_args, spexis_stats

pytestmark = pytest.mark.e2e

NEW_TOKENS = 32


@pytest.fixture(scope="module")
def tiny_gemma_dir(tmp_path_factory) -> str:
    from transformers import AutoTokenizer, Gemma3ForCausalLM, Gemma3TextConfig

    from spexis_sglang.default_model import ensure_default_model

    out = str(tmp_path_factory.mktemp("tiny-gemma3"))
    torch.manual_seed(0)
    types = ["sliding_attention", "sliding_attention", "full_attention"] * 2
    config = Gemma3TextConfig(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=5,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=16,
        query_pre_attn_scalar=16,
        sliding_window=8,
        layer_types=types[:5],
        max_position_embeddings=512,
        rope_parameters={
            "full_attention": {"rope_type": "default", "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
        },
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )
    model = Gemma3ForCausalLM(config)
    with torch.no_grad():  # a peaked output distribution: greedy far from ties
        model.model.embed_tokens.weight.mul_(8.0)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(ensure_default_model()).save_pretrained(out)
    assert os.path.isfile(os.path.join(out, "model.safetensors"))
    return out


def test_gemma3_pp2_sp_equals_plain_sglang(server_factory, tiny_gemma_dir):
    prompts = templated(
        tiny_gemma_dir,
        [f"Story {i}: tell me about the {i * 3} lighthouses of the coast." for i in range(8)],
    )
    assert all(len(p) > 8 for p in prompts)  # past the sliding window
    env = model_modules_env("gemma3_causal")
    baseline = server_factory(["--model-path", tiny_gemma_dir, "--pp-size", "1"], env)
    expected = baseline.greedy_ids(prompts, NEW_TOKENS)
    sp_server = server_factory(["--model-path", tiny_gemma_dir, *sp_args(2, "random:0")], env)
    before = spexis_stats(sp_server)
    got = sp_server.greedy_ids(prompts, NEW_TOKENS)
    after = spexis_stats(sp_server)
    cmp = compare_outputs(tiny_gemma_dir, prompts, expected, got)
    print("tiny Gemma 3, PP=2 SP vs plain PP=1:", cmp.summary())
    assert cmp.all_identical, cmp.summary()
    assert after["rows_spec"] > before["rows_spec"]  # it speculated
