"""Tiny random models made on the fly (SmolLM2's tokenizer, a few MB of weights): Llama, and
the other Llama-style architectures SP serves."""

from __future__ import annotations

import os
import shutil

import torch

from spexis_sglang.default_model import ensure_default_model

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def make_tiny_llama(
    out_dir: str,
    num_layers: int = 8,
    hidden: int = 64,
    heads: int = 4,
    kv_heads: int = 2,
    live_tokens: int = 0,
    logit_scale: float = 1.5,
    seed: int = 0,
    vocab_size: int = 49152,
) -> str:
    """Save a random ``LlamaForCausalLM`` with the default model's tokenizer in ``out_dir``.

    ``live_tokens > 0`` concentrates the output distribution on that many token ids (the
    other LM-head rows are zero and the live ones scaled), so a sampling test can count
    next-token frequencies over a handful of outcomes ("a tiny vocabulary"). A ``vocab_size``
    below the tokenizer's (49152) makes the embedding and LM head small (benchmarks driven by
    token ids below it, with dummy weights: the tokenizer still knows every id).
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    if os.path.isfile(os.path.join(out_dir, "model.safetensors")):
        return out_dir
    src = ensure_default_model()
    torch.manual_seed(seed)
    config = LlamaConfig(
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        vocab_size=vocab_size,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
        rope_theta=10000.0,
    )
    model = LlamaForCausalLM(config).eval()
    if live_tokens:
        with torch.no_grad():
            g = torch.Generator().manual_seed(seed + 1)
            live = torch.randperm(config.vocab_size, generator=g)[:live_tokens] + 0
            live = live[live > 2]
            w = model.lm_head.weight
            # |h| ~ sqrt(hidden) after the final norm, so live logits ~ N(0, logit_scale^2)
            rows = w[live].clone() * logit_scale / w[live].norm(dim=-1, keepdim=True)
            w.zero_()
            w[live] = rows
            emb = model.model.embed_tokens.weight
            emb[live] = emb[live] * 4
    model.save_pretrained(out_dir)
    for name in TOKENIZER_FILES:
        if os.path.isfile(os.path.join(src, name)):
            shutil.copy(os.path.join(src, name), out_dir)
    return out_dir


def make_tiny_model(out_dir: str, architecture: str, seed: int = 0) -> str:
    """Save a random 4-layer ``architecture`` (``"qwen2"``: attention biases, tied embedding;
    ``"qwen3"``: q/k norms; ``"mistral"``: untied; ``"qwen3_moe"``, ``"mixtral"``: 4 experts,
    2 per token) with the default model's tokenizer.

    The embedding and LM head are scaled up so the output distribution is peaked and greedy
    choices are far from ties."""
    import transformers

    if os.path.isfile(os.path.join(out_dir, "model.safetensors")):
        return out_dir
    moe = {"num_experts_per_tok": 2, "tie_word_embeddings": False}
    classes = {
        "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {"tie_word_embeddings": True}),
        "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 16}),
        "mistral": ("MistralConfig", "MistralForCausalLM", {"tie_word_embeddings": False}),
        "qwen3_moe": (
            "Qwen3MoeConfig",
            "Qwen3MoeForCausalLM",
            {"head_dim": 16, "moe_intermediate_size": 32, "num_experts": 4, **moe},
        ),
        "mixtral": ("MixtralConfig", "MixtralForCausalLM", {"num_local_experts": 4, **moe}),
        "phi3": ("Phi3Config", "Phi3ForCausalLM", {"tie_word_embeddings": False}),
        "glm4": ("Glm4Config", "Glm4ForCausalLM", {"head_dim": 16, "tie_word_embeddings": False}),
    }
    config_name, model_name, extra = classes[architecture]
    torch.manual_seed(seed)
    config = getattr(transformers, config_name)(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        rope_theta=1e6,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
        **extra,
    )
    model = getattr(transformers, model_name)(config).eval()
    with torch.no_grad():
        for layer in model.model.layers:  # Qwen2's q/k/v biases (initialised to 0) count
            for name in ("q_proj", "k_proj", "v_proj"):
                proj = getattr(layer.self_attn, name, None)  # (Phi-3 fuses them: no bias)
                if proj is not None and proj.bias is not None:
                    proj.bias.normal_(0.0, 0.5)
        model.model.embed_tokens.weight.mul_(8.0)
        if not config.tie_word_embeddings:
            model.lm_head.weight.mul_(8.0)
    model.save_pretrained(out_dir)
    src = ensure_default_model()
    for name in TOKENIZER_FILES:
        if os.path.isfile(os.path.join(src, name)):
            shutil.copy(os.path.join(src, name), out_dir)
    return out_dir
