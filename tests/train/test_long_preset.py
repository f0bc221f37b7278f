"""The gpu-long machinery: per-source training counts, token-budget batches, collect deadline
and partial merge with resume, the capped view, OOM halving, variant names, the compare report."""

import math

import pytest
import torch

from spexis_sglang.data import training_prompts
from spexis_sglang.train import pipeline
from spexis_sglang.train.cli import build_parser
from spexis_sglang.train.collect import (
    CollectConfig,
    _halving,
    capped,
    collect,
    load_collected,
    make_batches,
)
from spexis_sglang.train.report import render_compare

from .tiny_base import EXIT_LAYER, prompt_for


def test_train_counts_take_whole_sources_and_keep_the_smaller_runs_prompts():
    """gpu-long's counts: every ShareGPT train prompt; the gpu preset's 3,500 are among them."""
    counts = pipeline.PRESETS["gpu-long"]["train_counts"]
    long = training_prompts(0, "train", 0, counts=counts)
    gpu = training_prompts(5000, "train", 0)
    by_source = {}
    for p in long:
        by_source.setdefault(p.source, set()).add(p.uid)
    assert len(by_source["sharegpt"]) > 8000  # all of the split, not 70% of n
    assert len(by_source["gsm8k"]) == 500 and len(by_source["alpaca_eval"]) == 500
    assert all(p.uid in by_source[p.source] for p in gpu)
    assert len({(p.source, p.uid) for p in long}) == len(long)


def test_token_budget_batches():
    lengths = [3, 5, 5, 9, 20, 40, 41]
    b = make_batches(lengths, batch_size=3, batch_tokens=60, new_tokens=10)
    assert sorted(i for g in b for i in g) == list(range(len(lengths)))
    for g in b:
        assert len(g) <= 3
        assert len(g) == 1 or len(g) * (max(lengths[i] for i in g) + 10) <= 60
    assert make_batches(lengths, batch_size=3) == [[0, 1, 2], [3, 4, 5], [6]]


def test_oom_halving_keeps_order():
    calls = []

    def fn(items):
        calls.append(len(items))
        if len(items) > 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate")
        return [x * 10 for x in items]

    assert _halving(fn, [1, 2, 3, 4, 5]) == [10, 20, 30, 40, 50]
    with pytest.raises(ValueError):
        _halving(lambda items: (_ for _ in ()).throw(ValueError("other")), [1, 2])


def test_deadline_leaves_shards_a_partial_merge_trains_on_and_a_resume_completes(base, tmp_path):
    prompts = [prompt_for(s % 23, uid=f"d{s}") for s in range(16)]
    kw = dict(exits=(EXIT_LAYER,), max_prompt_tokens=64, max_new_tokens=12, batch_size=4)
    one = str(tmp_path / "one")
    full = collect(base, prompts, one, CollectConfig(**kw), "train")
    d = str(tmp_path / "deadline")
    # a worker past its deadline starts nothing; the other one does its shards
    none = collect(
        base, prompts, d, CollectConfig(**kw, worker=0, num_workers=2, deadline=1.0), "train"
    )
    assert none["partial"] and none["missing_shards"] == 4
    part = collect(base, prompts, d, CollectConfig(**kw, worker=1, num_workers=2), "train")
    assert part["partial"] and part["missing_shards"] == 2
    # the merge (no new shard, allow partial) writes meta.json over the shards present
    merged = collect(
        base, prompts, d, CollectConfig(**kw, deadline=1.0, allow_partial=True), "train"
    )
    assert merged["missing_shards"] == 2 and merged["shards"] == [1, 3]
    a, b = load_collected(one), load_collected(d)
    assert len(b) == 8 and [m["uid"] for m in b.meta] == [
        m["uid"] for m in a.meta if m["uid"] in {x["uid"] for x in b.meta}
    ]
    for i, m in enumerate(b.meta):
        j = [x["uid"] for x in a.meta].index(m["uid"])
        for k in a.tensors:
            assert torch.equal(b.sequence(i, k), a.sequence(j, k)), k
    # a resumed plain collect does the missing shards and equals the one-process collection
    again = collect(base, prompts, d, CollectConfig(**kw), "train")
    assert again["missing_shards"] == 0 and again["sequences"] == full["sequences"]
    c = load_collected(d)
    for k in a.tensors:
        assert torch.equal(a.tensors[k], c.tensors[k]), k


def test_capped_view_equals_a_shorter_cap_collection(base, tmp_path):
    """Greedy answers are prefixes: the 12-cap data cut to 5 = a 5-cap collection."""
    prompts = [prompt_for(s, uid=f"c{s}") for s in (0, 7, 14, 19, 21)]
    kw = dict(exits=(EXIT_LAYER,), max_prompt_tokens=64, batch_size=8)
    collect(base, prompts, str(tmp_path / "long"), CollectConfig(**kw, max_new_tokens=12), "t")
    collect(base, prompts, str(tmp_path / "short"), CollectConfig(**kw, max_new_tokens=5), "t")
    view = capped(load_collected(str(tmp_path / "long")), 5)
    short = load_collected(str(tmp_path / "short"))
    assert view.max_new_tokens == short.max_new_tokens == 5
    assert any(m["finished"] for m in view.meta) and not all(m["finished"] for m in view.meta)
    for mv, ms in zip(view.meta, short.meta):
        for k in ("uid", "answer_len", "length", "finished", "prompt_len"):
            assert mv[k] == ms[k], k
    for i in range(len(view)):
        for k in ("tokens", "next"):
            assert torch.equal(view.sequence(i, k), short.sequence(i, k)), k
        torch.testing.assert_close(
            view.sequence(i, f"hidden_{EXIT_LAYER}").float(),
            short.sequence(i, f"hidden_{EXIT_LAYER}").float(),
            atol=2e-2,
            rtol=2e-3,
        )


def test_length_variant_names_and_cli():
    cfg = pipeline.PipelineConfig(length_tag="tg")
    assert pipeline._tagged(cfg, "length.pt") == "length-tg.pt"
    assert pipeline._tagged(cfg, "calibration.json") == "calibration-tg.json"
    assert pipeline._tagged(pipeline.PipelineConfig(), "length.pt") == "length.pt"
    a = build_parser().parse_args(
        ["compare", "--length-tag", "tg", "--collect-deadline", "1", "--collect-allow-partial"]
    )
    assert a.length_tag == "tg" and a.collect_deadline == 1.0 and a.collect_allow_partial
    assert build_parser().parse_args(["collect"]).collect_allow_partial is None


def _acc(v):
    return {c: {"acceptance": v} for c in ("math", "qa")} | {"avg": {"acceptance": v}}


def _len(recalls):
    return [
        {"threshold": t, "precision": 0.85, "recall": r, "predicted": 1, "positives": 1, "rows": 1}
        for t, r in zip((4, 8, 16, 32, 64), recalls)
    ]


def test_compare_report_shows_new_vs_shipped_and_marks_targets():
    c = {
        "preset": "gpu-long",
        "max_new_tokens": 768,
        "compare_cap": 256,
        "shipped": {
            "draft-exit15": _acc(0.6),
            "draft-exit15_cap256": _acc(0.66),
            "length_features": [],
            "length_eval": {"eval": {"ShareGPT": _len([0.1] * 5)}},
        },
        "new": {
            "hidden": {
                "draft": {"exit15": {"acceptance": _acc(0.71), "acceptance_cap256": _acc(0.72)}},
                "length": {"features": [], "eval": {"ShareGPT": _len([0.2, 0.2, 0.3, 0.3, 0.3])}},
            },
            "tg": {
                "draft": {"exit15": {"acceptance": _acc(0.71)}},
                "length": {
                    "features": ["tokens_generated"],
                    "eval": {"ShareGPT": _len([0.5, 0.5, 0.45, 0.41, math.nan])},
                },
            },
        },
        "target_recall": 0.4,
        "target_precision": 0.8,
    }
    md = render_compare(c)
    assert "shipped exit15" in md and "new exit15" in md and "**.710**" in md and "**.660**" in md
    assert "cut to 256-token answers" in md
    tg = next(line for line in md.splitlines() if line.startswith("| new (tg)"))
    assert tg.count("✓") == 2  # L<16 and L<32 meet it, L<64 (nan) does not; L<4/8 not counted
    hidden = next(line for line in md.splitlines() if line.startswith("| new (hidden)"))
    assert "✓" not in hidden and "hidden only" in hidden


def test_frozen_prompts_keep_what_collect_reads_and_drop_references(tmp_path):
    cfg = pipeline.PipelineConfig(preset="tiny-long", **pipeline.PRESETS["tiny-long"])
    path = str(tmp_path / "p.json")
    pipeline.write_prompt_sets(cfg, path)
    frozen, live = pipeline.read_prompt_sets(path), pipeline.data_sets(cfg)
    assert frozen.keys() == live.keys()
    for name in live:
        assert [(p.source, p.uid, p.messages, p.followups, p.category) for p in frozen[name]] == [
            (p.source, p.uid, p.messages, p.followups, p.category) for p in live[name]
        ]
        assert all(p.reference == "" for p in frozen[name])
