"""A SpecBench-like evaluation mix built from the data we have.

SpecBench (Xia et al., 2024) has six categories: multi-turn conversation (MT-Bench),
translation (WMT14 de-en), summarisation (CNN/DailyMail), question answering (Natural
Questions), mathematical reasoning (GSM8K) and retrieval-augmented generation (NQ with
retrieved passages). Only MT-Bench and GSM8K are on PyPI, so the other four are rebuilt from
held-out (test-split) records of the packaged data:

=============  ==============================================================================
category       construction
=============  ==============================================================================
math           GSM8K questions (test split), as is.
qa             short questions (<= 300 chars, ending in "?") from AlpacaEval's test split,
               topped up with ShareGPT test-split questions of the same shape.
summarization  ShareGPT test-split prompts (300-4000 chars) that ask for a summary, topped up
               by wrapping a passage: "Summarize the following text in a few
               sentences.\n\n<passage>", the passage being a 120-400-word ChatGPT answer from
               ShareGPT's test split.
rag            "Answer the question using the documents below." + two documents (the
               ShareGPT test-split ChatGPT answer to the question, truncated to 200 words, and
               a distractor answer to another question, in a seeded order) + the question.
translation    ShareGPT test-split prompts (>= 100 chars) that ask for a translation, topped up with
               "Translate the following text into {French|German|Spanish}.\n\n<text>", the
               text being the first 40-120 words of an English ShareGPT test-split answer.
multi_turn     MT-Bench, both turns; the base model answers turn 1 itself, and acceptance is
               measured on its turn-2 answer (as SpecBench runs MT-Bench).
=============  ==============================================================================

No evaluation prompt is in the training split of any source (only test splits are used).
"""

from __future__ import annotations

import logging
import random
import re

from spexis_sglang.data.sources import Prompt
from spexis_sglang.data.splits import DEFAULT_SEED, deterministic_sample, source_split

logger = logging.getLogger(__name__)

CATEGORIES = ("math", "qa", "summarization", "rag", "translation", "multi_turn")
CATEGORY_LABELS = {
    "math": "Math",
    "qa": "QA",
    "summarization": "Sum",
    "rag": "RAG",
    "translation": "Tran",
    "multi_turn": "Mult",
}
_LANGS = ("French", "German", "Spanish")


def _words(text: str) -> list[str]:
    return text.split()


def _is_english(text: str) -> bool:
    if not text:
        return False
    ascii_letters = sum(c.isascii() and c.isalpha() for c in text)
    letters = sum(c.isalpha() for c in text)
    return letters > 0 and ascii_letters / letters > 0.97


def _clean_passage(text: str) -> str:
    text = re.sub(r"```.*?```", " ", text, flags=re.S)  # no code blocks in prose passages
    return re.sub(r"\s+", " ", text).strip()


def _short_question(text: str) -> bool:
    t = text.strip()
    return 15 <= len(t) <= 300 and t.endswith("?") and "\n" not in t


def _with_category(p: Prompt, category: str, **changes) -> Prompt:
    fields = dict(
        source=p.source,
        uid=p.uid,
        messages=p.messages,
        followups=p.followups,
        category=category,
        reference=p.reference,
        meta=dict(p.meta),
    )
    fields.update(changes)
    return Prompt(**fields)


def _math(n: int, seed: int) -> list[Prompt]:
    pool = source_split("gsm8k", "test", seed)
    return [_with_category(p, "math") for p in deterministic_sample(pool, n, seed, "math")]


def _qa(n: int, seed: int) -> list[Prompt]:
    alpaca = [
        p for p in source_split("alpaca_eval", "test", seed) if _short_question(p.messages[0][1])
    ]
    out = deterministic_sample(alpaca, n, seed, "qa:alpaca")
    if len(out) < n:
        share = [
            p
            for p in source_split("sharegpt", "test", seed)
            if _short_question(p.messages[0][1]) and _is_english(p.messages[0][1])
        ]
        out += deterministic_sample(share, n - len(out), seed, "qa:sharegpt")
    return [_with_category(p, "qa") for p in out]


def _english_answers(seed: int, lo: int, hi: int) -> list[Prompt]:
    return [
        p
        for p in source_split("sharegpt", "test", seed)
        if _is_english(p.reference) and lo <= len(_words(_clean_passage(p.reference))) <= hi
    ]


def _summarization(n: int, seed: int) -> list[Prompt]:
    native = [
        p
        for p in source_split("sharegpt", "test", seed)
        if re.search(r"\bsummari[sz]e\b|\bsummary of\b", p.messages[0][1][:300], re.I)
        and 300 <= len(p.messages[0][1]) <= 4000
        and _is_english(p.messages[0][1])
    ]
    out = [
        _with_category(p, "summarization", meta={**p.meta, "construction": "native"})
        for p in deterministic_sample(native, n // 2, seed, "sum:native")
    ]
    passages = _english_answers(seed, 120, 400)
    for p in deterministic_sample(passages, n - len(out), seed, "sum:wrap"):
        text = "Summarize the following text in a few sentences.\n\n" + _clean_passage(p.reference)
        out.append(
            _with_category(
                p,
                "summarization",
                uid=p.uid + ":sum",
                messages=(("user", text),),
                meta={**p.meta, "construction": "wrapped"},
            )
        )
    return out


def _rag(n: int, seed: int) -> list[Prompt]:
    pool = [
        p
        for p in source_split("sharegpt", "test", seed)
        if _is_english(p.reference)
        and _is_english(p.messages[0][1])
        and len(p.messages[0][1]) <= 300
        and len(_words(_clean_passage(p.reference))) >= 60
    ]
    chosen = deterministic_sample(pool, n, seed, "rag")
    rng = random.Random(f"{seed}:rag:docs")
    out = []
    for i, p in enumerate(chosen):
        distractor = chosen[(i + 1) % len(chosen)]
        docs = [
            " ".join(_words(_clean_passage(p.reference))[:200]),
            " ".join(_words(_clean_passage(distractor.reference))[:200]),
        ]
        rng.shuffle(docs)
        text = (
            "Answer the question using the documents below.\n\n"
            + "\n\n".join(f"Document [{k + 1}]: {d}" for k, d in enumerate(docs))
            + f"\n\nQuestion: {p.messages[0][1].strip()}"
        )
        out.append(_with_category(p, "rag", uid=p.uid + ":rag", messages=(("user", text),)))
    return out


def _translation(n: int, seed: int) -> list[Prompt]:
    native = [
        p
        for p in source_split("sharegpt", "test", seed)
        if re.search(r"\btranslate\b", p.messages[0][1][:300], re.I)
        and 100 <= len(p.messages[0][1]) <= 2000
    ]
    out = [
        _with_category(p, "translation", meta={**p.meta, "construction": "native"})
        for p in deterministic_sample(native, n // 4, seed, "tran:native")
    ]
    passages = _english_answers(seed, 40, 100000)
    for i, p in enumerate(deterministic_sample(passages, n - len(out), seed, "tran:wrap")):
        words = _words(_clean_passage(p.reference))
        text = " ".join(words[: min(len(words), 40 + (i * 37) % 81)])
        lang = _LANGS[i % len(_LANGS)]
        out.append(
            _with_category(
                p,
                "translation",
                uid=p.uid + ":tran",
                messages=(("user", f"Translate the following text into {lang}.\n\n{text}"),),
                meta={**p.meta, "construction": "wrapped", "language": lang},
            )
        )
    return out


def _multi_turn(n: int, seed: int) -> list[Prompt]:
    pool = source_split("mt_bench", "test", seed)
    return [_with_category(p, "multi_turn") for p in deterministic_sample(pool, n, seed, "mt")]


_BUILDERS = {
    "math": _math,
    "qa": _qa,
    "summarization": _summarization,
    "rag": _rag,
    "translation": _translation,
    "multi_turn": _multi_turn,
}


def evaluation_mix(n_per_category: int = 40, seed: int = DEFAULT_SEED) -> list[Prompt]:
    """``n_per_category`` prompts for each of :data:`CATEGORIES` (fewer only if data runs out)."""
    out: list[Prompt] = []
    for cat in CATEGORIES:
        items = _BUILDERS[cat](n_per_category, seed)
        if len(items) < n_per_category:
            logger.warning("category %s: only %d prompts", cat, len(items))
        out.extend(items)
    return out
