"""Serving workloads for ``benchmark/serving/serving.py``: real prompts, realistic output lengths.

Three request sets, each built from the packaged data (no download) and the served model's
tokenizer, so that every length is in the tokens the server counts:

=============  ==============================================================================
workload       prompt / output length
=============  ==============================================================================
sharegpt       the first human turn of a ShareGPT conversation (test split), chat-formatted;
               output length = the token length of its ChatGPT answer, capped at
               ``max_output_len`` (answers shorter than ``min_output_len`` are skipped).
specbench      the SpecBench-like mix of :func:`spexis_sglang.data.mix.evaluation_mix` (math,
               QA, summarisation, RAG, translation, MT-Bench turn 1), categories interleaved;
               output length = ``max_output_len`` for every request (SpecBench generates to
               EOS under a fixed ``max_new_tokens``: with real weights the model stops where it
               stops, with dummy weights and ``ignore_eos`` every request runs to the cap).
long           ShareGPT conversations (validation and test splits) whose answer is at least
               ``long_min_output_len`` tokens; output length = the answer's length, capped.
=============  ==============================================================================

A workload is a list of :class:`Request` (uid, source, category, prompt text, prompt and
output length). :func:`lengths_doc` drops the prompt text: the few-KB result is all a run on
dummy weights needs (:func:`synthetic_prompt` makes a prompt of the same length from a
synthetic vocabulary, :func:`write_synthetic_tokenizer` a tokenizer for it), so the GPU
machines, which have neither the data packages nor the default model's tokenizer, replay the
same lengths.

:func:`sharegpt_file_rows` writes a workload in the ShareGPT format that SGLang's
``bench_serving --dataset-name sharegpt --dataset-path FILE`` reads: the prompt is the human
turn, and the "gpt" turn is a filler text of exactly ``output_len`` tokens (bench_serving takes
a request's ``max_new_tokens`` from the token count of that turn).
"""

from __future__ import annotations

import json
import logging
import math
import random
from dataclasses import asdict, dataclass
from typing import Iterable, List, Optional, Sequence

logger = logging.getLogger(__name__)

WORKLOADS = ("sharegpt", "specbench", "long")
LENGTHS_FORMAT = "spexis-serving-workload/1"
#: Word prefix of the synthetic vocabulary: token ``i`` is the word ``t<i>``.
SYNTHETIC_PREFIX = "t"


@dataclass(frozen=True)
class Request:
    uid: str
    source: str
    category: str
    prompt: str  # chat-formatted text; "" in a lengths-only document
    prompt_len: int  # tokens of ``prompt`` as the served model's tokenizer counts them
    output_len: int  # max_new_tokens of the request
    answer_len: Optional[int] = None  # tokens of the reference answer, where there is one


def chat_text(tokenizer, user_text: str) -> str:
    """``user_text`` as one user turn in the tokenizer's chat template (raw if it has none)."""
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(
            [{"role": "user", "content": user_text}],
            add_generation_prompt=True,
            tokenize=False,
        )
    return user_text


def num_tokens(tokenizer, text: str) -> int:
    """Token count as bench_serving computes it (``tokenizer.encode`` with its defaults)."""
    return len(tokenizer.encode(text))


def _sharegpt_pool(splits: Sequence[str], seed: int, tag: str):
    from spexis_sglang.data.splits import DEFAULT_SEED, deterministic_sample, source_split

    # the project's fixed splits (the heads never trained on these); ``seed`` only orders
    pool = [p for split in splits for p in source_split("sharegpt", split, DEFAULT_SEED)]
    return deterministic_sample(pool, len(pool), seed, tag)


def _from_conversations(
    pool,
    tokenizer,
    num: int,
    max_input_len: int,
    max_output_len: int,
    min_answer_len: int,
    category: str,
) -> List[Request]:
    out: List[Request] = []
    for p in pool:
        if len(out) == num:
            break
        answer_len = num_tokens(tokenizer, p.reference)
        if answer_len < min_answer_len:
            continue
        prompt = chat_text(tokenizer, p.messages[0][1])
        prompt_len = num_tokens(tokenizer, prompt)
        if prompt_len > max_input_len:
            continue
        out.append(
            Request(
                uid=p.uid,
                source=p.source,
                category=category,
                prompt=prompt,
                prompt_len=prompt_len,
                output_len=min(answer_len, max_output_len),
                answer_len=answer_len,
            )
        )
    return out


def _specbench(tokenizer, num: int, seed: int, max_input_len: int, max_output_len: int):
    from spexis_sglang.data.mix import CATEGORIES, evaluation_mix
    from spexis_sglang.data.splits import deterministic_sample

    # a margin per category for the prompts longer than max_input_len; the mix is the
    # project's fixed evaluation mix (test splits), ``seed`` only orders it
    per_category = math.ceil(num / len(CATEGORIES)) * 2 + 4
    by_cat = {c: [] for c in CATEGORIES}
    mix = evaluation_mix(per_category)
    for p in deterministic_sample(mix, len(mix), seed, "serving:specbench"):
        prompt = chat_text(tokenizer, p.messages[0][1])
        prompt_len = num_tokens(tokenizer, prompt)
        if prompt_len <= max_input_len:
            by_cat[p.category].append(
                Request(
                    uid=p.uid,
                    source=p.source,
                    category=p.category,
                    prompt=prompt,
                    prompt_len=prompt_len,
                    output_len=max_output_len,
                )
            )
    out: List[Request] = []
    i = 0
    while len(out) < num and any(i < len(v) for v in by_cat.values()):
        for c in CATEGORIES:  # round robin: every category equally represented
            if i < len(by_cat[c]) and len(out) < num:
                out.append(by_cat[c][i])
        i += 1
    return out


def build_workload(
    name: str,
    tokenizer,
    num: int,
    seed: int = 0,
    max_input_len: int = 1024,
    max_output_len: int = 256,
    min_output_len: int = 4,
    long_min_output_len: int = 512,
) -> List[Request]:
    """``num`` requests of workload ``name`` (fewer only when the data runs out, logged).

    The prompts come from the project's fixed held-out splits (``DEFAULT_SEED``: the bundled
    draft head and length predictor never trained on them); ``seed`` only picks their order.
    """
    if max_output_len < min_output_len or min_output_len < 2:
        raise ValueError(
            f"need 2 <= min_output_len <= max_output_len, got {min_output_len}, {max_output_len}"
        )
    if name == "sharegpt":
        rows = _from_conversations(
            _sharegpt_pool(("test",), seed, "serving:sharegpt"),
            tokenizer,
            num,
            max_input_len,
            max_output_len,
            min_output_len,
            "chat",
        )
    elif name == "specbench":
        rows = _specbench(tokenizer, num, seed, max_input_len, max_output_len)
    elif name == "long":
        rows = _from_conversations(
            _sharegpt_pool(("val", "test"), seed, "serving:long"),
            tokenizer,
            num,
            max_input_len,
            max_output_len,
            max(min_output_len, long_min_output_len),
            "long",
        )
    else:
        raise ValueError(f"unknown workload {name!r}: one of {WORKLOADS}")
    if len(rows) < num:
        logger.warning("workload %s: only %d of %d requests", name, len(rows), num)
    return rows


def summary(rows: Sequence[Request]) -> dict:
    """Counts and length statistics (what a reader of a result needs to know of the load)."""
    import numpy as np

    def stats(values):
        if not values:
            return {}
        a = np.asarray(values, dtype=float)
        return {
            "mean": round(float(a.mean()), 1),
            "p50": round(float(np.percentile(a, 50)), 1),
            "p90": round(float(np.percentile(a, 90)), 1),
            "max": int(a.max()),
            "total": int(a.sum()),
        }

    cats: dict = {}
    for r in rows:
        cats[r.category] = cats.get(r.category, 0) + 1
    return {
        "requests": len(rows),
        "categories": cats,
        "prompt_len": stats([r.prompt_len for r in rows]),
        "output_len": stats([r.output_len for r in rows]),
    }


def lengths_doc(
    name: str, rows: Sequence[Request], build_args: dict, with_text: bool = False
) -> dict:
    """The workload as a document: lengths only (small enough to commit; replayed with
    synthetic prompts on dummy weights), or ``with_text`` the prompts too (to carry real
    prompts to a machine without the data packages)."""
    return {
        "format": LENGTHS_FORMAT,
        "workload": name,
        "build_args": build_args,
        "summary": summary(rows),
        "with_text": with_text,
        "requests": [
            [r.uid, r.source, r.category, r.prompt_len, r.output_len, r.answer_len]
            + ([r.prompt] if with_text else [])
            for r in rows
        ],
    }


def rows_from_lengths_doc(doc: dict) -> List[Request]:
    if doc.get("format") != LENGTHS_FORMAT:
        raise ValueError(
            f"not a serving workload document (format {doc.get('format')!r}, "
            f"expected {LENGTHS_FORMAT!r})"
        )
    return [
        Request(
            uid=row[0],
            source=row[1],
            category=row[2],
            prompt=row[6] if len(row) > 6 else "",
            prompt_len=row[3],
            output_len=row[4],
            answer_len=row[5],
        )
        for row in doc["requests"]
    ]


# -- synthetic vocabulary (dummy weights: only lengths matter) ------------------------------


def synthetic_prompt(length: int, vocab_size: int, rng: random.Random) -> str:
    """``length`` tokens of the synthetic tokenizer: random words ``t<id>``."""
    return " ".join(f"{SYNTHETIC_PREFIX}{rng.randrange(vocab_size)}" for _ in range(length))


def write_synthetic_tokenizer(directory: str, vocab_size: int) -> str:
    """A word-level tokenizer whose token ``i`` is the word ``t<i>``, for ``vocab_size`` ids.

    Every id the model can emit decodes to a non-empty word, so a dummy-weight model with any
    vocabulary streams text that bench_serving counts; a prompt of ``n`` space-separated words
    is exactly ``n`` tokens (no special tokens are added).
    """
    import os

    from tokenizers import Tokenizer, models, pre_tokenizers

    os.makedirs(directory, exist_ok=True)
    vocab = {f"{SYNTHETIC_PREFIX}{i}": i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=f"{SYNTHETIC_PREFIX}0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(os.path.join(directory, "tokenizer.json"))
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
        json.dump(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "model_max_length": 1 << 20,
                "clean_up_tokenization_spaces": False,
            },
            f,
        )
    return directory


# -- the file bench_serving reads ---------------------------------------------------------


def filler(tokenizer, n: int) -> str:
    """A text of exactly ``n`` tokens for ``tokenizer`` (checked)."""
    for unit in (" a", f" {SYNTHETIC_PREFIX}0", " x", " the"):
        text = (unit * n).lstrip() if unit.startswith(f" {SYNTHETIC_PREFIX}") else unit * n
        if num_tokens(tokenizer, text) == n:
            return text
    raise ValueError(f"no filler text of exactly {n} tokens for this tokenizer")


def sharegpt_file_rows(
    rows: Iterable[Request],
    tokenizer,
    synthetic_vocab: Optional[int] = None,
    seed: int = 0,
) -> List[dict]:
    """Rows of a ShareGPT-format JSON for bench_serving (see the module docstring).

    With ``synthetic_vocab`` the prompts are synthetic words of each request's length (dummy
    weights); otherwise the request's own prompt text.
    """
    rng = random.Random(f"{seed}:synthetic-prompts")
    out = []
    for r in rows:
        if synthetic_vocab:
            prompt = synthetic_prompt(r.prompt_len, synthetic_vocab, rng)
        elif r.prompt:
            prompt = r.prompt
        else:
            raise ValueError(
                f"request {r.uid} has no prompt text (a lengths-only workload): "
                "pass a synthetic vocabulary"
            )
        out.append(
            {
                "id": r.uid,
                "category": r.category,
                "conversations": [
                    {"from": "human", "value": prompt},
                    {"from": "gpt", "value": filler(tokenizer, r.output_len)},
                ],
            }
        )
    return out


def request_dicts(rows: Sequence[Request]) -> List[dict]:
    return [asdict(r) for r in rows]
