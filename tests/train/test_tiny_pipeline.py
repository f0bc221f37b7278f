"""End to end on a tiny Llama: collect is exact, the draft head and length predictor learn."""

import os

import pytest
import torch

from spexis_sglang.models.length_predictor import LengthPredictor, LengthPredictorConfig
from spexis_sglang.train.collect import CollectConfig, collect, load_collected
from spexis_sglang.train.draft import (
    DraftTrainConfig,
    draft_predictions,
    new_draft_head,
    train_draft_head,
)
from spexis_sglang.train.length import (
    LengthTrainConfig,
    calibrate_cutoffs,
    length_rows,
    precision_recall,
    predict_probs,
    train_length_predictor,
)

from .tiny_base import EXIT_LAYER, prompt_for


@pytest.fixture(scope="module")
def collected(base, tmp_path_factory):
    root = tmp_path_factory.mktemp("collect")
    cfg = CollectConfig(
        exits=(EXIT_LAYER, 3), max_prompt_tokens=64, max_new_tokens=30, batch_size=7
    )
    train = [prompt_for(s % 23, uid=f"t{s}") for s in range(46)]
    val = [prompt_for(s, uid=f"v{s}") for s in range(0, 23, 2)]
    collect(base, train, str(root / "train"), cfg, "train")
    collect(base, val, str(root / "val"), cfg, "val")
    return load_collected(str(root / "train")), load_collected(str(root / "val"))


def test_collect_records_exactly_what_the_base_model_does(base, collected):
    """Recorded greedy next tokens = HF generate; hidden_L = HF output_hidden_states[L] =
    stage-0 output."""
    _, val = collected
    model = base.model
    for i, m in enumerate(val.meta):
        tokens = val.sequence(i, "tokens").long()
        plen = m["prompt_len"]
        ref = model.generate(
            input_ids=tokens[None, :plen],
            attention_mask=torch.ones(1, plen, dtype=torch.long),
            max_new_tokens=30,
            do_sample=False,
            eos_token_id=list(base.eos_ids),
            pad_token_id=base.pad_id,
        )[0, plen:]
        ref = (
            ref[: (ref == base.eos_ids[0]).nonzero()[0, 0] + 1]
            if (ref == base.eos_ids[0]).any()
            else ref
        )
        answer = tokens[plen:]
        assert torch.equal(answer, ref), m["uid"]
        # acceptance target: base's greedy token on each answer row, given the same prefix
        assert torch.equal(val.sequence(i, "next")[plen - 1 : m["length"] - 1].long(), ref)
        with torch.no_grad():
            out = model(input_ids=tokens[None], output_hidden_states=True)
            h = model.model.embed_tokens(tokens[None])
            pos = torch.arange(len(tokens))[None]
            pe = model.model.rotary_emb(h, pos)
            for layer in model.model.layers[:EXIT_LAYER]:  # stage 0 = the first EXIT_LAYER layers
                h = layer(h, position_embeddings=pe, position_ids=pos)
                h = h[0] if isinstance(h, tuple) else h
        stored = val.sequence(i, f"hidden_{EXIT_LAYER}").float()
        torch.testing.assert_close(stored, out.hidden_states[EXIT_LAYER][0], atol=2e-2, rtol=2e-3)
        torch.testing.assert_close(stored, h[0], atol=2e-2, rtol=2e-3)
        torch.testing.assert_close(
            val.sequence(i, "final").float(), out.hidden_states[-1][0], atol=2e-2, rtol=2e-3
        )
    # the pattern was learnt, so answers are the rest of the alphabet (sanity of the fixture)
    assert sum(m["finished"] for m in val.meta) >= len(val.meta) - 1


def test_parallel_collect_workers_record_the_same_data_as_one_process(base, tmp_path):
    """Two workers (one per GPU on the device) make disjoint shards; the last one writes meta."""
    prompts = [prompt_for(s % 23, uid=f"w{s}") for s in range(20)]
    kw = dict(exits=(EXIT_LAYER,), max_prompt_tokens=64, max_new_tokens=12, batch_size=4)
    single = collect(base, prompts, str(tmp_path / "one"), CollectConfig(**kw), "train")
    par = str(tmp_path / "two")
    first = collect(base, prompts, par, CollectConfig(**kw, worker=1, num_workers=2), "train")
    assert first["partial"] and first["missing_shards"] == 3  # shards 0, 2, 4 are worker 0's
    assert not os.path.exists(os.path.join(par, "meta.json"))
    merged = collect(base, prompts, par, CollectConfig(**kw, worker=0, num_workers=2), "train")
    assert merged["sequences"] == single["sequences"]
    assert merged["config"] == single["config"] and merged["parallel_workers"] == 2
    a, b = load_collected(str(tmp_path / "one")), load_collected(par)
    assert a.tensors.keys() == b.tensors.keys()
    for k in a.tensors:
        assert torch.equal(a.tensors[k], b.tensors[k]), k
    # a plain (single-process) collect afterwards finds the set complete
    again = collect(base, prompts, par, CollectConfig(**kw), "train")
    assert again["sequences"] == single["sequences"]
    with pytest.raises(ValueError, match="need 0 <= worker < num_workers"):
        CollectConfig(**kw, worker=2, num_workers=2)


def test_batch_gather_equals_per_sequence_padding(collected):
    """The vectorized batch assembly = copying each sequence into a zero-padded row."""
    from spexis_sglang.train.draft import _pad_batch

    train, _ = collected
    idx, max_len, prompt_w = [3, 0, 7, 5], 24, 0.1
    got = _pad_batch(train, idx, EXIT_LAYER, max_len, "cpu", prompt_w)
    lens = [min(train.meta[i]["length"], max_len) for i in idx]
    assert max(lens) == max_len  # one row is cut at max_len
    b, t = len(idx), max(lens)
    want = {
        "hidden": torch.zeros(b, t, train.tensors[f"hidden_{EXIT_LAYER}"].shape[-1]),
        "final": torch.zeros(b, t, train.tensors["final"].shape[-1]),
        "next": torch.zeros(b, t, dtype=torch.long),
        "weight": torch.zeros(b, t),
        "mask": torch.zeros(b, t, dtype=torch.bool),
    }
    for j, (i, n) in enumerate(zip(idx, lens)):
        s = int(train.offsets[i])
        want["hidden"][j, :n] = train.tensors[f"hidden_{EXIT_LAYER}"][s : s + n].float()
        want["final"][j, :n] = train.tensors["final"][s : s + n].float()
        want["next"][j, :n] = train.tensors["next"][s : s + n].long()
        want["mask"][j, :n] = True
        plen, full = train.meta[i]["prompt_len"], train.meta[i]["length"]
        want["weight"][j, : min(plen - 1, n)] = prompt_w
        want["weight"][j, plen - 1 : min(full - 1, n)] = 1.0
    for k, v in want.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k], v), k
    assert torch.equal(got["positions"], torch.arange(t).expand(b, t))


def test_draft_head_training_beats_chance_and_the_untrained_head(base, collected):
    train, val = collected
    cfg = DraftTrainConfig(
        exit_layer=EXIT_LAYER, epochs=25, lr=3e-3, batch_tokens=512, warmup_steps=5
    )
    # start from a scrambled head (the logit lens of this easy pattern is already right), so
    # the test measures what training does
    head = new_draft_head(base.config, base.final_norm_weight, 1, seed=0)
    with torch.no_grad():
        torch.manual_seed(0)
        head.fc.weight.normal_(0.0, 0.2)
    before = (
        draft_predictions(head, val, EXIT_LAYER, base.lm_head_weight)["accept"]
        .float()
        .mean()
        .item()
    )
    head, info = train_draft_head(head, train, val, base.lm_head_weight, cfg)
    pred = draft_predictions(head, val, EXIT_LAYER, base.lm_head_weight)
    after = pred["accept"].float().mean().item()
    chance = 1.0 / base.config.vocab_size
    assert before < 0.5 and after > max(0.8, before + 0.3, 10 * chance), (before, after)
    assert info["best_val_acceptance"] == pytest.approx(after, abs=1e-6)
    # confidence is informative: accepted drafts are more confident on average
    if (~pred["accept"]).any():
        assert (
            pred["confidence"][pred["accept"]].mean() > pred["confidence"][~pred["accept"]].mean()
        )


def test_length_predictor_learns_the_remaining_length(base, collected):
    train, val = collected
    rows, vrows = length_rows(train, EXIT_LAYER), length_rows(val, EXIT_LAYER)
    # remaining = tokens still to emit from this row on, this row's included: R on the last
    # prompt token, 1 on the row that emits EOS
    first = val.meta[0]
    r0 = vrows.remaining[vrows.seq == 0]
    assert r0[0].item() == first["answer_len"] and r0[-1].item() == 1
    torch.manual_seed(0)
    model = LengthPredictor(LengthPredictorConfig(hidden_size=64, mlp_hidden=64))
    model, _ = train_length_predictor(
        model, rows, LengthTrainConfig(exit_layer=EXIT_LAYER, epochs=60, lr=3e-3, batch_rows=64)
    )
    probs = predict_probs(model, vrows)
    cutoffs, stats = calibrate_cutoffs(probs, vrows, model.cfg.thresholds, 0.8, min_predicted=5)
    y, known = vrows.labels(model.cfg.thresholds)
    k = model.cfg.thresholds.index(8)
    st = precision_recall(probs[:, k].numpy(), y[:, k].numpy(), known[:, k].numpy(), cutoffs[k])
    assert st["precision"] >= 0.8 and st["recall"] >= 0.4, st
