"""The user's own prompts: a JSONL file or a ShareGPT-style JSON array, split train/val/test.

A head drafts best on the traffic it will serve, so ``python -m spexis_sglang.train --data
FILE`` trains on the user's prompts instead of our offline datasets. Each record is one of::

    {"prompt": "..."}                                   # also "text", "instruction", "question"
    {"messages": [{"role": "user", "content": "..."}, ...]}          # OpenAI chat
    {"conversations": [{"from": "human", "value": "..."}, ...]}      # ShareGPT

with optional ``"id"`` and ``"category"`` (acceptance is reported per category). A chat is cut
after its last user turn before the first answer the record carries: the base model answers
for itself (self-distillation), so recorded answers are never training targets.
"""

from __future__ import annotations

import hashlib
import json
import logging

from spexis_sglang.data.sources import Prompt

logger = logging.getLogger(__name__)

_TEXT_KEYS = ("prompt", "text", "instruction", "question", "input")
_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "bard": "assistant",
    "bing": "assistant",
    "model": "assistant",
    "system": "system",
}
# fractions of the prompts held out for validation (checkpoint choice, calibration) and test
VAL_FRACTION = 0.1
TEST_FRACTION = 0.1
USER_CATEGORY = "user"


class UserDataError(ValueError):
    """The prompts file cannot be read as prompts (names the record)."""


def _records(path: str):
    with open(path, encoding="utf-8") as f:
        text = f.read()
    stripped = text.lstrip()
    if stripped.startswith("["):
        try:
            data = json.loads(stripped)
        except json.JSONDecodeError as e:
            raise UserDataError(f"{path}: not a valid JSON array ({e})") from None
        yield from ((i + 1, r) for i, r in enumerate(data))
        return
    for n, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                yield n, json.loads(line)
            except json.JSONDecodeError as e:
                raise UserDataError(f"{path}: line {n} is not JSON ({e})") from None


def _turns(rec: dict) -> list[tuple[str, str]]:
    if "messages" in rec:
        return [(str(m.get("role", "")), str(m.get("content", ""))) for m in rec["messages"]]
    if "conversations" in rec:
        return [(str(m.get("from", "")), str(m.get("value", ""))) for m in rec["conversations"]]
    for key in _TEXT_KEYS:
        if isinstance(rec.get(key), str):
            return [("user", rec[key])]
    return []


def _messages(turns: list[tuple[str, str]]) -> tuple[tuple[str, str], ...]:
    """System turns and the user turns up to the first answer."""
    out = []
    for role, content in turns:
        role = _ROLES.get(role.lower())
        if role == "assistant":
            break
        if role is not None and content.strip():
            out.append((role, content))
    while out and out[-1][0] != "user":
        out.pop()
    return tuple(out)


def read_user_prompts(path: str) -> list[Prompt]:
    """Every usable record of ``path`` as a :class:`Prompt` (source "user")."""
    prompts, skipped = [], 0
    for n, rec in _records(path):
        if not isinstance(rec, dict):
            raise UserDataError(f"{path}: record {n} is not a JSON object")
        messages = _messages(_turns(rec))
        if not messages:
            skipped += 1
            continue
        uid = str(rec.get("id") or hashlib.sha256(repr(messages).encode()).hexdigest()[:16])
        prompts.append(
            Prompt(
                source="user",
                uid=uid,
                messages=messages,
                category=str(rec.get("category") or USER_CATEGORY),
            )
        )
    if skipped:
        logger.info("%s: %d records without a user turn skipped", path, skipped)
    if not prompts:
        raise UserDataError(
            f"{path}: no prompts found; each record needs one of {list(_TEXT_KEYS)}, "
            "'messages' (role/content) or 'conversations' (from/value)"
        )
    return prompts


def split_user_prompts(prompts: list[Prompt], seed: int = 0) -> dict[str, list[Prompt]]:
    """``train`` / ``val`` / ``user_test`` by a seeded hash of each prompt's id (stable when
    prompts are added); at least one validation and one test prompt from three prompts on."""

    def unit(p: Prompt) -> float:
        h = hashlib.sha256(f"{seed}:user:{p.uid}".encode()).hexdigest()
        return int(h[:12], 16) / float(16**12)

    ranked = sorted(prompts, key=unit)
    n = len(ranked)
    n_val = max(1, round(n * VAL_FRACTION)) if n >= 3 else 0
    n_test = max(1, round(n * TEST_FRACTION)) if n >= 3 else 0
    return {
        "val": ranked[:n_val],
        "user_test": ranked[n_val : n_val + n_test],
        "train": ranked[n_val + n_test :],
    }
