"""Data splits and evaluation mix, calibration, rank profile / alpha, report rendering, CLI."""

import json

import numpy as np
import pytest
import torch

from spexis_sglang.data import CATEGORIES, evaluation_mix, split_of, training_prompts
from spexis_sglang.data.splits import source_split
from spexis_sglang.train.cli import build_parser
from spexis_sglang.train.length import LengthRows, calibrate_cutoffs, precision_recall
from spexis_sglang.train.report import choose_alpha_for, rank_profile, write_report


def test_splits_are_deterministic_disjoint_and_seeded():
    gsm = (
        source_split("gsm8k", "train")
        + source_split("gsm8k", "val")
        + source_split("gsm8k", "test")
    )
    assert len(gsm) == 1319 and len({p.uid for p in gsm}) == 1319
    assert [split_of("sharegpt", f"id{i}") for i in range(50)] == [
        split_of("sharegpt", f"id{i}") for i in range(50)
    ]
    assert [split_of("sharegpt", f"id{i}", seed=1) for i in range(50)] != [
        split_of("sharegpt", f"id{i}") for i in range(50)
    ]
    assert all(split_of("mt_bench", str(i)) == "test" for i in range(81, 161))
    a, b = training_prompts(40, "train"), training_prompts(40, "train")
    assert [p.uid for p in a] == [p.uid for p in b] and len(a) == 40
    assert all(split_of(p.source, p.uid) == "train" for p in a)


def test_evaluation_mix_has_six_categories_from_test_splits_only():
    mix = evaluation_mix(6)
    cats = [p.category for p in mix]
    assert set(cats) == set(CATEGORIES) and all(cats.count(c) == 6 for c in CATEGORIES)
    for p in mix:
        base_uid = p.uid.split(":")[0]
        assert split_of(p.source, base_uid) == "test", p.uid
        assert p.messages[-1][0] == "user" and p.messages[-1][1].strip()
    assert all(p.followups for p in mix if p.category == "multi_turn")
    rag = [p for p in mix if p.category == "rag"][0].messages[0][1]
    assert "Document [1]" in rag and "Document [2]" in rag and "Question:" in rag
    assert [p.uid for p in evaluation_mix(6)] == [p.uid for p in mix]


def _rows(remaining, finished):
    n = len(remaining)
    return LengthRows(
        torch.zeros(n, 4),
        torch.tensor(remaining),
        torch.tensor(finished),
        torch.zeros(n, dtype=torch.long),
    )


def test_labels_respect_censoring():
    rows = _rows([2, 10, 2, 70], [True, True, False, False])
    y, known = rows.labels((4, 64))
    assert y.tolist() == [[True, True], [False, True], [False, False], [False, False]]
    # an answer cut at max_new_tokens with 2 rows left: remaining >= 3, unknown for < 4 and < 64
    assert known.tolist() == [[True, True], [True, True], [False, False], [True, True]]


def test_calibration_reaches_target_precision_with_most_recall():
    rng = np.random.default_rng(0)
    n = 4000
    y = rng.random(n) < 0.3
    p = np.clip(np.where(y, rng.normal(0.7, 0.15, n), rng.normal(0.4, 0.15, n)), 0, 1)
    rows = _rows(np.where(y, 2, 100).tolist(), [True] * n)
    probs = torch.tensor(np.stack([p] * 5, 1), dtype=torch.float32)
    cutoffs, stats = calibrate_cutoffs(probs, rows, (4, 8, 16, 32, 64), 0.8)
    st = precision_recall(p, y, np.ones(n, bool), cutoffs[0])
    assert st["precision"] >= 0.8 and st["recall"] > 0.3
    lower = precision_recall(p, y, np.ones(n, bool), cutoffs[0] - 0.02)
    assert lower["precision"] < 0.8 or lower["recall"] == st["recall"]  # no lower cutoff qualifies
    # hopeless predictor: never predicts
    cut, _ = calibrate_cutoffs(torch.rand(n, 5), rows, (4, 8, 16, 32, 64), 0.99)
    assert cut == [1.0] * 5


def test_rank_profile_and_alpha():
    rng = np.random.default_rng(0)
    conf = rng.random(6400)
    accept = (rng.random(6400) < conf).astype(float)  # acceptance grows with confidence
    prof = rank_profile(conf, accept, batch=64)
    acc = prof["acceptance"]
    assert (
        len(acc) == 10
        and acc[0] > 0.8
        and acc[-1] < 0.2
        and all(a >= b - 0.05 for a, b in zip(acc, acc[1:]))
    )
    a = choose_alpha_for(acc, num_stages=2, batch=64)
    assert (
        0.0 <= a["affine"]["alpha"] <= 0.5 and a["affine"]["theta_alpha"] >= a["affine"]["theta_0"]
    )
    assert a["flat"]["alpha"] == 0.0  # dropping saves no time when latency is flat
    flat = choose_alpha_for([0.5] * 10, num_stages=2, batch=64)
    assert flat["affine"]["theta_alpha"] == pytest.approx(0.5)


def test_report_files(tmp_path):
    ex = {
        "exit_layer": 15,
        "exit_fraction": "1/2",
        "acceptance": {c: {"acceptance": 0.5, "rows": 10} for c in CATEGORIES}
        | {"avg": {"acceptance": 0.5, "rows": 60, "micro": 0.5}},
        "rank_profile": {
            "batch": 64,
            "bins": 10,
            "acceptance": [0.9 - 0.08 * i for i in range(10)],
        },
    }
    ex["alpha"] = choose_alpha_for(ex["rank_profile"]["acceptance"], 2, 64)
    lp = {
        "exit_layer": 15,
        "thresholds": [4, 8, 16, 32, 64],
        "cutoffs": [0.5] * 5,
        "target_precision": 0.8,
        "eval": {
            "ShareGPT": [
                {"threshold": t, "precision": 0.8, "recall": 0.4, "rows": 9, "positives": 3}
                for t in (4, 8, 16, 32, 64)
            ]
        },
    }
    paths = write_report({"base_model": "m", "draft": {"exit15": ex}, "length": lp}, str(tmp_path))
    md = open(paths[1]).read()
    assert "| S135 | 1/2 (layer 15) | .500 |" in md and "L<64" in md and "80.0%" in md
    assert json.load(open(paths[0]))["draft"]["exit15"]["exit_layer"] == 15
    assert open(paths[2], "rb").read(4) == b"\x89PNG"


def test_cli_parses_every_step():
    p = build_parser()
    for step in (
        "prompts",
        "collect",
        "train-draft",
        "train-length",
        "calibrate",
        "evaluate",
        "export",
        "all",
    ):
        assert p.parse_args([step]).step == step
    args = p.parse_args(["all", "--preset", "gpu", "--exits", "15,7", "--device", "cuda"])
    assert args.exits == (15, 7) and args.preset == "gpu"
    with pytest.raises(SystemExit):
        p.parse_args(["all", "--preset", "nope"])
    assert p.parse_args(["collect", "--collect-worker", "1/2"]).collect_worker == (1, 2)
    for bad in ("2/2", "x", "1"):
        with pytest.raises(SystemExit):
            p.parse_args(["collect", "--collect-worker", bad])
