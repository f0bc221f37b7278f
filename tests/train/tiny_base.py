"""A tiny Llama that has learnt a pattern, with a word-level chat tokenizer, for pipeline tests.

The user names three consecutive letters; the model continues the alphabet up to "z" and ends
with <|im_end|>. So its greedy answers, the draft targets and the remaining lengths all follow a
pattern a small head can learn, and success is measurable against chance.
"""

from __future__ import annotations

import random
import string

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from spexis_sglang.data.sources import Prompt
from spexis_sglang.train.collect import BaseModel, chat_ids

SPECIALS = ["<unk>", "<|im_start|>", "<|im_end|>", "<pad>"]
WORDS = ["system", "user", "assistant"] + list(string.ascii_lowercase)
TEMPLATE = (
    "{% for m in messages %}<|im_start|> {{ m['role'] }} {{ m['content'] }} <|im_end|> {% endfor %}"
    "{% if add_generation_prompt %}<|im_start|> assistant {% endif %}"
)
EXIT_LAYER = 2


def make_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {w: i for i, w in enumerate(SPECIALS + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        pad_token="<pad>",
        eos_token="<|im_end|>",
        additional_special_tokens=["<|im_start|>"],
    )
    fast.chat_template = TEMPLATE
    return fast


def prompt_for(start: int, uid: str = "") -> Prompt:
    letters = " ".join(string.ascii_lowercase[start : start + 3])
    return Prompt(source="tiny", uid=uid or f"tiny-{start}", messages=(("user", letters),))


def answer_for(start: int) -> str:
    return " ".join(string.ascii_lowercase[start + 3 :])


def make_base(seed: int = 0, steps: int = 120) -> BaseModel:
    torch.manual_seed(seed)
    tok = make_tokenizer()
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    pad = tok.convert_tokens_to_ids("<pad>")
    cfg = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=128,
        rope_parameters={"rope_theta": 10000.0, "rope_type": "default"},
        eos_token_id=eos,
        pad_token_id=pad,
        bos_token_id=None,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(cfg)
    base = BaseModel(
        model=model, tokenizer=tok, config=cfg, eos_ids=(eos,), pad_id=pad, name="tiny"
    )
    seqs = []
    for s in range(0, 23):
        ids = chat_ids(base, prompt_for(s).chat())
        seqs.append((ids, tok(answer_for(s), add_special_tokens=False)["input_ids"] + [eos]))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    rng = random.Random(seed)
    model.train()
    for _ in range(steps):
        batch = [rng.choice(seqs) for _ in range(16)]
        width = max(len(p) + len(a) for p, a in batch)
        ids = torch.full((16, width), pad)
        labels = torch.full((16, width), -100)
        for i, (p, a) in enumerate(batch):
            ids[i, : len(p) + len(a)] = torch.tensor(p + a)
            labels[i, len(p) : len(p) + len(a)] = torch.tensor(a)
        loss = model(input_ids=ids, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    return base
