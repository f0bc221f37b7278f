"""Fixed, seeded train / validation / test splits.

A record's split is a pure function of ``(seed, source, uid)`` (a sha256 bucket), so it never
changes when a source gains or loses records, and no split file has to be stored. MT-Bench is
held out entirely (it is the multi-turn evaluation category).
"""

from __future__ import annotations

import hashlib
import logging
import random

from spexis_sglang.data.sources import Prompt, load_source

logger = logging.getLogger(__name__)

SPLITS = ("train", "val", "test")
SPLIT_FRACTIONS = {"train": 0.8, "val": 0.1, "test": 0.1}
TEST_ONLY_SOURCES = frozenset({"mt_bench"})
DEFAULT_SEED = 0


def _unit(seed: int, *parts: str) -> float:
    digest = hashlib.sha256("\x1f".join([str(seed), *parts]).encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def split_of(source: str, uid: str, seed: int = DEFAULT_SEED) -> str:
    if source in TEST_ONLY_SOURCES:
        return "test"
    u = _unit(seed, "split", source, uid)
    if u < SPLIT_FRACTIONS["train"]:
        return "train"
    if u < SPLIT_FRACTIONS["train"] + SPLIT_FRACTIONS["val"]:
        return "val"
    return "test"


def source_split(source: str, split: str, seed: int = DEFAULT_SEED) -> list[Prompt]:
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    return [p for p in load_source(source) if split_of(source, p.uid, seed) == split]


def deterministic_sample(items: list, n: int, seed: int, tag: str) -> list:
    """``n`` items in a seeded order (all of them if fewer)."""
    items = list(items)
    random.Random(f"{seed}:{tag}").shuffle(items)
    return items[:n]


# Training mix: mostly ShareGPT (as in the paper) plus some math, code and instruction data so
# that a small model's head sees the same kinds of text as the evaluation mix.
TRAIN_MIX = {
    "sharegpt": 0.70,
    "gsm8k": 0.10,
    "alpaca_eval": 0.10,
    "humaneval": 0.05,
    "arena_hard": 0.05,
}


def training_prompts(
    n: int,
    split: str = "train",
    seed: int = DEFAULT_SEED,
    mix: dict[str, float] | None = None,
    prompt_filter=None,
    counts: dict[str, int | None] | None = None,
) -> list[Prompt]:
    """``n`` prompts of ``split`` drawn from the training mix, in a fixed interleaved order.

    ``counts`` (source -> number, ``None`` = all of the split) replaces the mix fractions: a
    larger run can take every ShareGPT conversation while the other sources keep the numbers
    a smaller run drew (the seeded order makes those the same prompts); ``n`` is then ignored.
    """
    mix = mix or TRAIN_MIX
    total = sum(mix.values())
    per_source: list[list[Prompt]] = []
    for name, weight in (counts or mix).items():
        pool = source_split(name, split, seed)
        if prompt_filter is not None:
            pool = [p for p in pool if prompt_filter(p)]
        if counts is not None:
            k = len(pool) if weight is None else int(weight)
        else:
            k = max(1, round(n * weight / total))
        chosen = deterministic_sample(pool, k, seed, f"{split}:{name}")
        if len(chosen) < k:
            logger.info("%s/%s: only %d of %d prompts available", name, split, len(chosen), k)
        per_source.append(chosen)
    out: list[Prompt] = []
    for group in per_source:
        out.extend(group)
    out = deterministic_sample(out, len(out) if counts else n, seed, f"{split}:interleave")
    return out
