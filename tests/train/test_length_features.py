"""The length predictor's scalar features: trained end to end they carry what the hidden lacks."""

import json

import pytest
import torch

from spexis_sglang.models.length_predictor import LengthPredictor, LengthPredictorConfig
from spexis_sglang.train.length import (
    LengthRows,
    LengthTrainConfig,
    calibrate_cutoffs,
    precision_recall,
    predict_probs,
    train_length_predictor,
)

CAP = 16


def synthetic_rows(n_seq: int, seed: int) -> LengthRows:
    """Answers of 10-14 tokens, all ended; the hidden state is pure noise, so only the number
    of tokens generated so far tells how much is left."""
    g = torch.Generator().manual_seed(seed)
    hid, rem, fin, seq, gen, plen = [], [], [], [], [], []
    for i in range(n_seq):
        length = int(torch.randint(10, 15, (1,), generator=g))
        p = torch.arange(length)
        hid.append(torch.randn(length, 16, generator=g))
        rem.append(length - p)
        fin.append(torch.ones(length, dtype=torch.bool))
        seq.append(torch.full((length,), i))
        gen.append(p)
        plen.append(torch.full((length,), int(torch.randint(5, 200, (1,), generator=g))))
    gen_t = torch.cat(gen)
    return LengthRows(
        torch.cat(hid).half(),
        torch.cat(rem),
        torch.cat(fin),
        torch.cat(seq),
        gen_t,
        torch.cat(plen),
        torch.full_like(gen_t, CAP),
    )


def _recall(features, train, val, test, thresholds=(4, 8)):
    torch.manual_seed(0)
    model = LengthPredictor(
        LengthPredictorConfig(
            hidden_size=16,
            mlp_hidden=32,
            thresholds=thresholds,
            cutoffs=[0.5] * len(thresholds),
            features=features,
            output="cumulative",
        )
    )
    model, _ = train_length_predictor(
        model,
        train,
        LengthTrainConfig(epochs=40, lr=3e-3, batch_rows=256, mask="window", pos_weight="sqrt"),
        val,
    )
    cutoffs, _ = calibrate_cutoffs(
        predict_probs(model, val), val, thresholds, 0.8, min_predicted=5, mask="window"
    )
    probs = predict_probs(model, test).numpy()
    y, known = test.labels(thresholds, "window")
    return [
        precision_recall(probs[:, k], y[:, k].numpy(), known[:, k].numpy(), cutoffs[k])
        for k in range(len(thresholds))
    ]


def test_tokens_generated_feature_lifts_recall_above_hidden_only():
    train, val, test = synthetic_rows(200, 0), synthetic_rows(60, 1), synthetic_rows(60, 2)
    hidden_only = _recall((), train, val, test)
    with_feature = _recall(("tokens_generated", "prompt_len"), train, val, test)
    for k, (h, f) in enumerate(zip(hidden_only, with_feature)):
        assert f["recall"] >= 0.4 and f["precision"] >= 0.7, (k, f)
        assert f["recall"] >= h["recall"] + 0.3, (k, h, f)


def test_window_mask_drops_rows_whose_label_depends_on_the_answer_having_ended():
    # cap 10: an ended answer and a cut one, 10 answer rows each
    rows = LengthRows(
        torch.zeros(20, 4),
        torch.cat([torch.arange(10, 0, -1), torch.arange(10, 0, -1)]),
        torch.tensor([True] * 10 + [False] * 10),
        torch.tensor([0] * 10 + [1] * 10),
        torch.cat([torch.arange(10), torch.arange(10)]),
        torch.full((20,), 7),
        torch.full((20,), 10),
    )
    y, known = rows.labels((4,))
    yw, kw = rows.labels((4,), "window")
    assert torch.equal(yw, y)
    # "known" keeps the ended answer's last rows (all positive) but not the cut one's: biased
    assert known[:10, 0].all() and known[10:, 0].tolist() == [True] * 8 + [False] * 2
    # "window": generated + 4 <= 11, the same rows of both answers
    assert kw[:, 0].tolist() == ([True] * 8 + [False] * 2) * 2
    with pytest.raises(ValueError, match="window"):
        LengthRows(rows.hidden, rows.remaining, rows.finished, rows.seq).labels((4,), "window")


def test_pipeline_trains_calibrates_and_reloads_the_length_recipe(tmp_path):
    """train-length and calibrate of the pipeline use the recipe's features, output and mask."""
    from spexis_sglang.train import pipeline
    from spexis_sglang.train.collect import CollectConfig, collect

    from .tiny_base import EXIT_LAYER, make_base, prompt_for

    base = make_base(steps=20)
    cfg = pipeline.replace(
        pipeline.PipelineConfig(preset="tiny"),
        **pipeline.PRESETS["tiny"],
        model_path=str(tmp_path / "model"),
        work_dir=str(tmp_path / "work"),
        length_exit=EXIT_LAYER,
        length_min_predicted=2,
        length_features=("tokens_generated", "prompt_len"),
        threads=1,
    )
    pipeline._BASE_CACHE.clear()
    pipeline._BASE_CACHE[(cfg.model_path, cfg.device, cfg.base_dtype)] = base
    ccfg = CollectConfig(exits=(EXIT_LAYER,), max_prompt_tokens=64, max_new_tokens=12)
    for name, starts in (("train", range(12)), ("val", range(1, 12, 3))):
        prompts = [prompt_for(s, uid=f"{name}{s}") for s in starts]
        collect(base, prompts, pipeline._data_dir(cfg, name), ccfg, name)
    try:
        info = pipeline.step_train_length(cfg)
        cal = pipeline.step_calibrate(cfg)
        model, _ = pipeline._load_length(cfg)
    finally:
        pipeline._BASE_CACHE.clear()
    assert info["rows"] > 0 and len(cal["cutoffs"]) == 5
    assert model.cfg.features == ("tokens_generated", "prompt_len")
    assert model.cfg.output == "cumulative" == pipeline.PipelineConfig().length_output
    assert model.cfg.cutoffs == cal["cutoffs"]
    with open(pipeline._ckpt(cfg, "calibration.json")) as f:
        assert json.load(f)["mask"] == "window" == pipeline.PipelineConfig().length_mask
    h = torch.zeros(2, 64)
    with pytest.raises(ValueError, match="tokens_generated="):
        model.probabilities(h)
    p = model.probabilities(h, tokens_generated=torch.tensor([0, 9]), prompt_len=torch.tensor(9))
    assert p.shape == (2, 5)
