"""The committed SmolLM2-135M-Instruct artifacts: checksums, configs, and that they load."""

import hashlib
import json
import os

import pytest
import torch

from spexis_sglang.models import (
    ArtifactMismatchError,
    default_artifact_dir,
    load_draft_head,
    load_length_predictor,
)

# SmolLM2-135M-Instruct as converted by spexis_sglang.default_model (transformers 5 config keys)
SMOLLM2 = {
    "model_type": "llama",
    "hidden_size": 576,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 64,
    "vocab_size": 49152,
    "rope_parameters": {"rope_theta": 100000.0, "rope_type": "default"},
    "rms_norm_eps": 9.999999747378752e-06,
}
ROOT = os.path.dirname(default_artifact_dir("x"))


def test_checksums_match():
    with open(os.path.join(ROOT, "SHA256SUMS")) as f:
        lines = [l.split() for l in f if l.strip()]
    assert len(lines) == 6
    for digest, rel in lines:
        with open(os.path.join(ROOT, rel), "rb") as g:
            assert hashlib.sha256(g.read()).hexdigest() == digest, rel


@pytest.mark.parametrize("name,exit_layer", [("draft-exit15", 15), ("draft-exit7", 7)])
def test_draft_heads_load_and_are_small(name, exit_layer):
    path = default_artifact_dir(name)
    assert os.path.getsize(os.path.join(path, "model.safetensors")) < 4 * 2**20
    head, cfg = load_draft_head(path, SMOLLM2, exit_layer=exit_layer)
    assert cfg.base_model == "SmolLM2-135M-Instruct" and cfg.exit_layer == exit_layer
    h = torch.randn(1, 3, 576)
    z, _ = head(h, torch.arange(3)[None])
    assert torch.isfinite(z).all()
    with pytest.raises(ArtifactMismatchError, match="'num_hidden_layers' is 30 in the artifact"):
        load_draft_head(path, dict(SMOLLM2, num_hidden_layers=32))


def test_length_predictor_loads_with_calibrated_cutoffs():
    lp, cfg = load_length_predictor(default_artifact_dir("length"), SMOLLM2, exit_layer=15)
    assert list(lp.cfg.thresholds) == [4, 8, 16, 32, 64]
    assert all(0.0 < c <= 1.0 for c in lp.cfg.cutoffs)
    assert cfg.extra["target_precision"] == 0.8
    assert len(cfg.extra["precision"]) == 5
    # the current recipe: hidden state only, monotone cumulative outputs, trained on
    # the unbiased window mask
    assert cfg.extra["features"] == [] and lp.cfg.features == ()
    assert lp.cfg.output == "cumulative" and cfg.extra["label_mask"] == "window"
    probs = torch.sigmoid(lp(torch.randn(64, 576)))
    assert (probs[:, 1:] >= probs[:, :-1] - 1e-6).all(), "cumulative outputs must be monotone"


def test_default_model_config_matches_if_converted():
    """When the default model is converted here, its real config must match the artifacts."""
    from spexis_sglang.default_model import default_model_dir, is_converted

    if not is_converted(default_model_dir()):
        pytest.skip("default model not converted on this machine")
    with open(os.path.join(default_model_dir(), "config.json")) as f:
        real = json.load(f)
    load_draft_head(default_artifact_dir("draft-exit15"), real, exit_layer=15)
    load_length_predictor(default_artifact_dir("length"), real, exit_layer=15)
