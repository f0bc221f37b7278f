"""HF transformers references for end-to-end tests (no SGLang involved)."""

from __future__ import annotations

from functools import lru_cache
from typing import List

import torch

CHAT_PROMPTS = [
    "What is the capital of France?",
    "Write a Python function that returns the n-th Fibonacci number.",
    "Name the three primary colours.",
    "Explain in two sentences why the sky is blue.",
    "Translate 'good morning, my friend' into Spanish.",
    "What is 17 times 23? Show your reasoning.",
    "Give me three tips for sleeping better.",
    "Summarise the plot of Romeo and Juliet in one paragraph.",
]


@lru_cache(maxsize=4)
def load_tokenizer(model_dir: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


@lru_cache(maxsize=2)
def load_model(model_dir: str):
    """The reference in float64, like the test servers (``exact_test_args``)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64).eval()


def chat_prompt_ids(model_dir: str, prompts: List[str] = CHAT_PROMPTS) -> List[List[int]]:
    from .prompts import templated

    return templated(model_dir, list(prompts))


@torch.no_grad()
def hf_greedy(model_dir: str, prompts: List[List[int]], max_new_tokens: int) -> List[List[int]]:
    """Greedy continuations of ``prompts`` in one left-padded batch with a KV cache; never
    stops at EOS (like ``ignore_eos``). In float64 the padding moves no logit by more than
    rounding: the same tokens as one prompt at a time, several times faster."""
    model = load_model(model_dir)
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    out = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True)
    past, logits = out.past_key_values, out.logits[:, -1]
    generated = []
    for _ in range(max_new_tokens):
        nxt = logits.argmax(-1)
        generated.append(nxt)
        mask = torch.cat([mask, torch.ones(len(prompts), 1, dtype=mask.dtype)], dim=1)
        positions = positions[:, -1:] + 1
        out = model(
            input_ids=nxt[:, None],
            attention_mask=mask,
            position_ids=positions,
            past_key_values=past,
            use_cache=True,
        )
        past, logits = out.past_key_values, out.logits[:, -1]
    return torch.stack(generated, dim=1).tolist()
