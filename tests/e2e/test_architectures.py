"""Architectures SP serves besides Llama and Gemma 3: Qwen2 (q/k/v biases, tied embedding),
GLM-4 (partial rotary embedding, extra norms) and the mixture-of-experts Qwen3-MoE (q/k norms)
and Mixtral, each a tiny random model served at PP=2 with SP; greedy output equals plain
SGLang's PP=1 token for token, and stage 0 speculated.

(Llama is every other e2e test's model; Gemma 3, whose PP class is Spexis' own, has
``test_gemma3.py``.)
"""

from __future__ import annotations

import pytest

from .compare import compare_outputs
from .conftest import model_modules_env
from .prompts import templated
from .test_sp_lossless import sp_args, spexis_stats
from .tiny_model import make_tiny_model

pytestmark = pytest.mark.e2e

NEW_TOKENS = 24
# -> SGLang's module. Left out to keep the suite short (each passed once; their classes are
# checked in tests/srt/test_draft_model.py): Mistral and Phi-3 (SGLang's Llama class under
# other names) and Qwen3 (Spexis' class is Qwen2's on another base; Qwen3-MoE has its q/k norms)
ARCHITECTURES = {"qwen2": "qwen2", "qwen3_moe": "qwen3_moe", "mixtral": "mixtral", "glm4": "glm4"}


@pytest.mark.parametrize("architecture", sorted(ARCHITECTURES))
def test_pp2_sp_equals_plain_sglang(architecture, server_factory, tmp_path_factory):
    model_dir = make_tiny_model(str(tmp_path_factory.mktemp(architecture)), architecture)
    prompts = templated(
        model_dir, [f"Note {i}: list the {i + 2} rivers that cross the old town." for i in range(4)]
    )
    env = model_modules_env(ARCHITECTURES[architecture])
    common = ["--model-path", model_dir, "--dtype", "float32"]
    # no other test asks for these servers: stopped when this one ends
    baseline = server_factory([*common, "--pp-size", "1"], env, keep=False)
    expected = baseline.greedy_ids(prompts, NEW_TOKENS)
    sp_server = server_factory([*common, *sp_args(2, "random:0")], env, keep=False)
    before = spexis_stats(sp_server)
    got = sp_server.greedy_ids(prompts, NEW_TOKENS)
    after = spexis_stats(sp_server)
    cmp = compare_outputs(model_dir, prompts, expected, got)
    print(f"tiny {architecture}, PP=2 SP vs plain PP=1:", cmp.summary())
    assert cmp.all_identical, cmp.summary()
    assert after["rows_spec"] > before["rows_spec"]  # it speculated
    # each stage's loader skips the parameters other stages hold, without a warning
    with open(sp_server.log_path) as f:
        assert "not found in params_dict" not in f.read()
