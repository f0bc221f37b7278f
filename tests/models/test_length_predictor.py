"""Length predictor: shapes, cutoffs, artifact round trip and rejection."""

import json

import pytest
import torch

from spexis_sglang.models import (
    DEFAULT_THRESHOLDS,
    ArtifactMismatchError,
    LengthPredictor,
    LengthPredictorConfig,
    load_length_predictor,
    save_length_predictor,
)

BASE = {
    "model_type": "llama",
    "hidden_size": 64,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 97,
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-5,
}


def test_shapes_and_predict_uses_cutoffs():
    torch.manual_seed(0)
    m = LengthPredictor(LengthPredictorConfig(hidden_size=64, cutoffs=[0.0, 0.3, 0.5, 0.7, 1.01]))
    names = {k: tuple(v.shape) for k, v in m.state_dict().items()}
    assert names == {
        "norm.weight": (64,),
        "fc1.weight": (512, 64),
        "fc1.bias": (512,),
        "fc2.weight": (512, 512),
        "fc2.bias": (512,),
        "fc3.weight": (5, 512),
        "fc3.bias": (5,),
    }
    h = torch.randn(10, 64) * 5
    logits = m(h)
    assert logits.shape == (10, 5) and logits.dtype == torch.float32
    p = m.probabilities(h.half())  # any float dtype in, fp32 out
    assert p.dtype == torch.float32 and ((p >= 0) & (p <= 1)).all()
    pred = m.predict(h)
    assert pred.dtype == torch.bool
    assert pred[:, 0].all() and not pred[:, 4].any()
    assert torch.equal(pred[:, 2], m.probabilities(h)[:, 2] >= 0.5)


def test_bad_configs_rejected():
    with pytest.raises(ValueError, match="one cutoff per threshold"):
        LengthPredictor(LengthPredictorConfig(hidden_size=8, cutoffs=[0.5]))
    with pytest.raises(ValueError, match="increase"):
        LengthPredictor(LengthPredictorConfig(hidden_size=8, thresholds=(8, 4, 16, 32, 64)))


def test_round_trip_keeps_cutoffs_and_checks_base(tmp_path):
    torch.manual_seed(1)
    m = LengthPredictor(LengthPredictorConfig(hidden_size=64, cutoffs=[0.9, 0.8, 0.7, 0.6, 0.55]))
    path = str(tmp_path / "length")
    save_length_predictor(
        path, m, BASE, "tiny-llama", exit_layer=2, metadata={"precision": [0.8] * 5}
    )
    loaded, cfg = load_length_predictor(path, BASE, exit_layer=2)
    assert loaded.cfg.cutoffs == pytest.approx([0.9, 0.8, 0.7, 0.6, 0.55])
    assert tuple(loaded.cfg.thresholds) == DEFAULT_THRESHOLDS
    assert cfg.extra["precision"] == [0.8] * 5
    h = torch.randn(4, 64)
    torch.testing.assert_close(loaded.probabilities(h), m.probabilities(h), atol=5e-3, rtol=5e-3)
    with pytest.raises(
        ArtifactMismatchError, match="'hidden_size' is 64 in the artifact .* but 128"
    ):
        load_length_predictor(path, dict(BASE, hidden_size=128))
    with pytest.raises(
        ArtifactMismatchError, match="kind is 'length_predictor', expected 'draft_head'"
    ):
        from spexis_sglang.models import load_draft_head

        load_draft_head(path, BASE)


def test_features_round_trip_and_missing_feature_is_a_clear_error(tmp_path):
    torch.manual_seed(2)
    cfg = LengthPredictorConfig(
        hidden_size=64, mlp_hidden=32, features=("tokens_generated", "prompt_len")
    )
    m = LengthPredictor(cfg)
    assert tuple(m.state_dict()["fc_feat.weight"].shape) == (32, 2)
    h = torch.randn(6, 64)
    gen = torch.tensor([0, 1, 5, 20, 100, 300])
    plen = torch.full((6,), 40)
    p = m.probabilities(h, tokens_generated=gen, prompt_len=plen)
    # the features change the output (they are not silently dropped)
    assert not torch.allclose(p, m.probabilities(h, tokens_generated=gen * 0, prompt_len=plen))
    with pytest.raises(
        ValueError, match="features \\['tokens_generated', 'prompt_len'\\].*tokens_generated="
    ):
        m(h)
    with pytest.raises(ValueError, match="prompt_len="):
        m.predict(h, tokens_generated=gen)
    path = str(tmp_path / "length")
    save_length_predictor(path, m, BASE, "tiny-llama", exit_layer=2)
    with open(f"{path}/config.json") as f:
        extra = json.load(f)["extra"]
    assert extra["features"] == ["tokens_generated", "prompt_len"]
    assert extra["feature_transform"] == "log1p"
    loaded, _ = load_length_predictor(path, BASE, exit_layer=2)
    assert loaded.cfg.features == ("tokens_generated", "prompt_len")
    torch.testing.assert_close(
        loaded.probabilities(h, tokens_generated=gen, prompt_len=plen), p, atol=5e-3, rtol=5e-3
    )
    with pytest.raises(ValueError, match="tokens_generated="):
        loaded.probabilities(h, prompt_len=plen)


def test_hidden_only_ignores_features_and_unknown_features_are_rejected():
    m = LengthPredictor(LengthPredictorConfig(hidden_size=16, mlp_hidden=8))
    h = torch.randn(3, 16)
    torch.testing.assert_close(m(h), m(h, tokens_generated=torch.tensor([1, 2, 3])))
    with pytest.raises(ValueError, match="features must be"):
        LengthPredictor(LengthPredictorConfig(hidden_size=16, features=("budget_left",)))
    with pytest.raises(ValueError, match="output must be"):
        LengthPredictor(LengthPredictorConfig(hidden_size=16, output="softmax"))


def test_cumulative_output_is_monotone_across_thresholds(tmp_path):
    torch.manual_seed(3)
    m = LengthPredictor(LengthPredictorConfig(hidden_size=64, mlp_hidden=32, output="cumulative"))
    p = m.probabilities(torch.randn(200, 64) * 3)
    assert (p[:, 1:] >= p[:, :-1]).all()
    path = str(tmp_path / "length")
    save_length_predictor(path, m, BASE, "tiny-llama", exit_layer=2)
    loaded, _ = load_length_predictor(path, BASE, exit_layer=2)
    assert loaded.cfg.output == "cumulative"


def test_old_format_config_loads_as_hidden_state_only(tmp_path):
    """Artifacts written before features existed (like the shipped one) have no such fields."""
    torch.manual_seed(4)
    m = LengthPredictor(LengthPredictorConfig(hidden_size=64, mlp_hidden=32))
    path = str(tmp_path / "length")
    save_length_predictor(path, m, BASE, "tiny-llama", exit_layer=2)
    with open(f"{path}/config.json") as f:
        raw = json.load(f)
    for key in ("features", "feature_transform", "output"):
        raw["extra"].pop(key)
    with open(f"{path}/config.json", "w") as f:
        json.dump(raw, f)
    loaded, _ = load_length_predictor(path, BASE, exit_layer=2)
    assert loaded.cfg.features == () and loaded.cfg.output == "independent"
    h = torch.randn(4, 64)
    torch.testing.assert_close(loaded.probabilities(h), m.probabilities(h), atol=5e-3, rtol=5e-3)


def test_predicted_bucket_is_the_smallest_threshold_predicted_or_minus_one():
    from spexis_sglang.models.length_predictor import predicted_bucket

    pred = torch.tensor(
        [
            [False, False, True, True, True],
            [True, True, True, True, True],
            [False, False, False, False, False],
            [False, True, False, True, False],  # independent outputs need not be monotone
        ]
    )
    assert predicted_bucket(pred).tolist() == [2, 0, -1, 1]
    assert predicted_bucket(pred).dtype == torch.int64
