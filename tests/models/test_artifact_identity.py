"""An artifact knows the model it belongs to: architecture, config fingerprint, a hash of the
embedding / LM-head weights and the exit layer; the launcher refuses any other model or split
before a process starts. Random Llama and Qwen3 configs of odd depths and GQA ratios."""

from __future__ import annotations

import json
import os

import pytest
import torch

from spexis_sglang.models import DraftHead, DraftHeadConfig, save_draft_head
from spexis_sglang.models.artifact import (
    ArtifactMismatchError,
    check_weights_fingerprint,
    read_artifact_config,
    weights_fingerprint,
)


def _save_model(path: str, arch: str, layers: int, heads: int, kv_heads: int, seed: int = 0) -> str:
    from transformers import (
        AutoTokenizer,
        LlamaConfig,
        LlamaForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    from spexis_sglang.default_model import ensure_default_model

    torch.manual_seed(seed)
    common = dict(
        vocab_size=49152,
        hidden_size=48,
        intermediate_size=96,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=16,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    if arch == "llama":
        model = LlamaForCausalLM(
            LlamaConfig(
                **common,
                rope_parameters={
                    "rope_theta": 5e5,
                    "rope_type": "llama3",
                    "factor": 8.0,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 64,
                },
            )
        )
    else:
        model = Qwen3ForCausalLM(Qwen3Config(**common))
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(ensure_default_model()).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("identity")
    return {
        # 7 layers, 6:2 GQA, Llama 3 RoPE scaling; its retrained twin; a 5-layer Qwen3, 4:1
        "llama7": _save_model(str(root / "llama7"), "llama", 7, 6, 2, seed=0),
        "llama7b": _save_model(str(root / "llama7b"), "llama", 7, 6, 2, seed=1),
        "qwen5": _save_model(str(root / "qwen5"), "qwen3", 5, 4, 1, seed=0),
    }


def _head_for(model_dir: str, out: str, exit_layer: int) -> str:
    with open(os.path.join(model_dir, "config.json")) as f:
        config = json.load(f)
    head = DraftHead(DraftHeadConfig.from_base(config))
    save_draft_head(
        out,
        head,
        config,
        os.path.basename(model_dir),
        exit_layer,
        weights_hash=weights_fingerprint(model_dir),
    )
    return out


def test_weights_fingerprint_tells_checkpoints_apart_not_dtypes(models, tmp_path):
    a, b = weights_fingerprint(models["llama7"]), weights_fingerprint(models["llama7b"])
    assert a and b and a != b
    from transformers import AutoModelForCausalLM

    bf16 = str(tmp_path / "bf16")
    AutoModelForCausalLM.from_pretrained(models["llama7"], dtype=torch.bfloat16).save_pretrained(
        bf16
    )
    assert weights_fingerprint(bf16) == a
    os.makedirs(tmp_path / "config-only")
    assert weights_fingerprint(str(tmp_path / "config-only")) is None


def test_artifact_records_what_it_belongs_to(models, tmp_path):
    d = _head_for(models["llama7"], str(tmp_path / "h"), 3)
    cfg = read_artifact_config(d)
    assert cfg.base_architecture_name == "LlamaForCausalLM" and cfg.exit_layer == 3
    assert cfg.base_architecture["num_hidden_layers"] == 7
    assert cfg.base_architecture["vocab_size"] == 49152
    assert cfg.base_weights_hash == weights_fingerprint(models["llama7"])
    check_weights_fingerprint(cfg, models["llama7"])
    with pytest.raises(ArtifactMismatchError, match="does not match the base model's weights"):
        check_weights_fingerprint(cfg, models["llama7b"], "draft head")


def _launch(argv, monkeypatch):
    from spexis_sglang.srt.config import ENV_CONFIG, ENV_DRAFT_HEAD
    from spexis_sglang.srt.launch import prepare_server_args

    for name in (ENV_CONFIG, ENV_DRAFT_HEAD):  # restored after the test
        monkeypatch.setenv(name, "")
    return prepare_server_args(argv)


def test_launcher_refuses_a_head_for_another_model_or_split(models, tmp_path, monkeypatch):
    from spexis_sglang.srt.launch import LaunchError
    from spexis_sglang.train.pipeline import stage0_layers

    llama_head = _head_for(models["llama7"], str(tmp_path / "llama-exit3"), stage0_layers(7, 2))
    qwen_head = _head_for(models["qwen5"], str(tmp_path / "qwen-exit2"), stage0_layers(5, 2))
    ok = ["--model-path", models["llama7"], "--pp-size", "2", "--spexis-draft-head", llama_head]
    _, cfg = _launch(ok, monkeypatch)
    assert cfg.draft_head == llama_head
    _, cfg = _launch(
        ["--model-path", models["qwen5"], "--pp-size", "2", "--spexis-draft-head", qwen_head],
        monkeypatch,
    )
    cases = [
        # same architecture and config, other weights
        (
            [
                "--model-path",
                models["llama7b"],
                "--pp-size",
                "2",
                "--spexis-draft-head",
                llama_head,
            ],
            "does not match the base model's weights: it was trained on 'llama7'",
        ),
        # another architecture
        (
            ["--model-path", models["qwen5"], "--pp-size", "2", "--spexis-draft-head", llama_head],
            "field 'model_type' is 'llama' in the artifact",
        ),
        # the split: 7 layers over 3 stages end stage 0 at layer 2, not 3
        (
            ["--model-path", models["llama7"], "--pp-size", "3", "--spexis-draft-head", llama_head],
            "'exit_layer' is 3 in the artifact but the server's stage 0 ends after layer 2",
        ),
    ]
    for argv, message in cases:
        with pytest.raises(LaunchError) as e:
            _launch(argv, monkeypatch)
        assert message in str(e.value)
    # the split a user sets to match the head is accepted
    monkeypatch.setenv("SGLANG_PP_LAYER_PARTITION", "3,2,2")
    _launch(
        ["--model-path", models["llama7"], "--pp-size", "3", "--spexis-draft-head", llama_head],
        monkeypatch,
    )
