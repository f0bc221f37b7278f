"""The Spexis draft head: stage 0's early-exit drafter (paper §6, after Kangaroo).

It runs on stage 0's *output hidden state*, i.e. the residual stream after decoder layer
``exit_layer`` (in SGLang Llama PP that is ``hidden_states + residual`` after stage 0's last
layer; in HF it is ``output_hidden_states[exit_layer]``), and drafts the next token with the
base model's own LM head. It is built from Llama parts so an SGLang port maps weights 1:1.

Forward, for one request, at every token position ``p`` (all math in fp32)::

    x_p  = h_p                                   # exit-layer residual stream, [H]
    y_p  = fc(RMSNorm_norm(x_p))                 # fc: Linear(H, H) with bias
    for i in range(num_layers):                  # attention-only Llama decoder layers
        a = RMSNorm_{layers.i.input_layernorm}(y)
        q, k, v = a Wq^T, a Wk^T, a Wv^T          # no bias (attention_bias of the base)
        q, k = RoPE(q, pos_p), RoPE(k, pos_p)     # Llama rotate-half RoPE, theta of the base;
                                                  # (default RoPE whatever the base's scaling)
                                                  # pos_p = the token's position in the request
                                                  # (the same `positions` the base layers use)
        o_p = softmax(q_p K_{<=p}^T / sqrt(head_dim)) V_{<=p} Wo^T   # causal, GQA, own KV
        y = y + o                                # residual; no MLP, no post-attention norm
    z_p  = RMSNorm_final_norm(y_p)
    logits_p = z_p W_lmhead^T                    # the base model's LM head (not stored)
    draft_p = argmax(logits_p)
    confidence_p = softmax(logits_p)[draft_p] = 1 / sum exp(logits_p - max)

Each layer's K/V cover every position of the request, prompt included: prefill runs the head on
all prompt tokens to fill its KV (one extra attention layer in stage 0's KV pool per head
layer, indexed by the request's token slots), decode rows append one position each. Under
speculative parallelism a rejected row's K/V slot is overwritten when the position is
re-executed, exactly like the base layers' KV.

Parameters (H = hidden_size, nh/nkv = the base's attention / KV heads, d = head_dim):
``norm.weight [H]``, ``fc.weight [H, H]``, ``fc.bias [H]``,
``layers.{i}.input_layernorm.weight [H]``, ``layers.{i}.self_attn.q_proj.weight [nh*d, H]``,
``k_proj.weight [nkv*d, H]``, ``v_proj.weight [nkv*d, H]``, ``o_proj.weight [H, nh*d]``,
``final_norm.weight [H]``. All RMSNorms use the base's ``rms_norm_eps``.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from spexis_sglang.models.artifact import (
    ArtifactConfig,
    ArtifactMismatchError,
    architecture_fields,
    check_compatible,
    check_weights_file,
    load_state_strict,
    read_artifact,
    save_artifact,
)

logger = logging.getLogger(__name__)

KIND = "draft_head"


@dataclass
class DraftHeadConfig:
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    vocab_size: int
    num_layers: int = 1

    @classmethod
    def from_base(cls, base_config: Any, num_layers: int = 1) -> "DraftHeadConfig":
        f = architecture_fields(base_config)
        # the head's own attention always uses the default RoPE with the base's theta (the
        # base's scaling, e.g. Llama 3's "llama3", is not carried over; the SGLang head does
        # the same: srt.draft_model._rope_args)
        return cls(
            hidden_size=f["hidden_size"],
            num_attention_heads=f["num_attention_heads"],
            num_key_value_heads=f["num_key_value_heads"],
            head_dim=f["head_dim"],
            rope_theta=f["rope_theta"],
            rms_norm_eps=f["rms_norm_eps"],
            vocab_size=f["vocab_size"],
            num_layers=num_layers,
        )


class RMSNorm(nn.Module):
    """Llama RMSNorm, computed in fp32 (as HF and SGLang do)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * x).to(dtype)


def rope_cos_sin(
    positions: torch.Tensor, head_dim: int, theta: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin for Llama's default RoPE, shape ``positions.shape + (head_dim,)``."""
    inv_freq = 1.0 / (
        theta
        ** (
            torch.arange(0, head_dim, 2, dtype=torch.int64, device=positions.device).float()
            / head_dim
        )
    )
    freqs = positions.float()[..., None] * inv_freq
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x``: [B, heads, T, d]; ``cos``/``sin``: [B, T, d]."""
    cos, sin = cos[:, None].to(x.dtype), sin[:, None].to(x.dtype)
    return x * cos + _rotate_half(x) * sin


class DraftAttention(nn.Module):
    """Llama self-attention (GQA, RoPE, no bias) with an optional explicit KV cache."""

    def __init__(self, cfg: DraftHeadConfig) -> None:
        super().__init__()
        self.cfg = cfg
        h, d = cfg.hidden_size, cfg.head_dim
        self.q_proj = nn.Linear(h, cfg.num_attention_heads * d, bias=False)
        self.k_proj = nn.Linear(h, cfg.num_key_value_heads * d, bias=False)
        self.v_proj = nn.Linear(h, cfg.num_key_value_heads * d, bias=False)
        self.o_proj = nn.Linear(cfg.num_attention_heads * d, h, bias=False)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        key_padding_mask: torch.Tensor | None,
        past: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        cfg = self.cfg
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, cfg.num_attention_heads, cfg.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, cfg.num_key_value_heads, cfg.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, cfg.num_key_value_heads, cfg.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if past is not None:
            k = torch.cat([past[0], k], dim=2)
            v = torch.cat([past[1], v], dim=2)
        present = (k, v)
        groups = cfg.num_attention_heads // cfg.num_key_value_heads
        kk = k.repeat_interleave(groups, dim=1)
        vv = v.repeat_interleave(groups, dim=1)
        s = kk.shape[2]
        # causal over the full (past + new) key range; new queries sit at the end
        causal = torch.ones(t, s, dtype=torch.bool, device=x.device).tril(diagonal=s - t)
        mask = causal[None, None]
        if key_padding_mask is not None:  # [B, s] True = real token
            mask = mask & key_padding_mask[:, None, None, :]
        out = F.scaled_dot_product_attention(
            q, kk, vv, attn_mask=mask, scale=1.0 / math.sqrt(cfg.head_dim)
        )
        out = out.transpose(1, 2).reshape(b, t, cfg.num_attention_heads * cfg.head_dim)
        return self.o_proj(out), present


class DraftLayer(nn.Module):
    def __init__(self, cfg: DraftHeadConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = DraftAttention(cfg)


class DraftHead(nn.Module):
    """See the module docstring for the exact forward. The LM head weight is passed in."""

    def __init__(self, cfg: DraftHeadConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.fc = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=True)
        self.layers = nn.ModuleList(DraftLayer(cfg) for _ in range(cfg.num_layers))
        self.final_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self, final_norm_weight: torch.Tensor | None = None) -> None:
        """Start as the exit layer's "logit lens": fc = identity, attention output = 0.

        With ``final_norm`` set to the base's final norm the untrained head is exactly
        ``lm_head(final_norm(h))``, a sensible early-exit drafter that training improves on.
        """
        self.fc.weight.copy_(torch.eye(self.cfg.hidden_size))
        self.fc.bias.zero_()
        for layer in self.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                nn.init.normal_(proj.weight, std=0.02)
            layer.self_attn.o_proj.weight.zero_()
        if final_norm_weight is not None:
            self.final_norm.weight.copy_(final_norm_weight)

    def forward(
        self,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        key_padding_mask: torch.Tensor | None = None,
        past_key_values: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
    ) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
        """Head hidden states before the LM head.

        ``hidden``: [B, T, H] exit-layer residual stream; ``positions``: [B, T] token positions;
        ``key_padding_mask``: [B, past+T] (True = real) for padded batches;
        ``past_key_values``: per layer (K, V) of [B, nkv, past, d] from earlier calls.
        Returns ([B, T, H], new per-layer (K, V)).
        """
        y = self.fc(self.norm(hidden.float()))
        cos, sin = rope_cos_sin(positions, self.cfg.head_dim, self.cfg.rope_theta)
        presents = []
        for i, layer in enumerate(self.layers):
            past = past_key_values[i] if past_key_values is not None else None
            a, present = layer.self_attn(layer.input_layernorm(y), cos, sin, key_padding_mask, past)
            y = y + a
            presents.append(present)
        return self.final_norm(y), presents

    def logits(self, head_hidden: torch.Tensor, lm_head_weight: torch.Tensor) -> torch.Tensor:
        return head_hidden.float() @ lm_head_weight.float().t()

    @torch.no_grad()
    def draft(
        self,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        lm_head_weight: torch.Tensor,
        key_padding_mask: torch.Tensor | None = None,
        past_key_values: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
        """Greedy draft token (int64) and its confidence (fp32 top-1 probability) per position."""
        z, presents = self.forward(hidden, positions, key_padding_mask, past_key_values)
        tokens, confidence = greedy_with_confidence(self.logits(z, lm_head_weight))
        return tokens, confidence, presents


def greedy_with_confidence(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """argmax and its softmax probability, ``1 / sum(exp(logits - max))``, in fp32."""
    logits = logits.float()
    top, tokens = logits.max(dim=-1)
    confidence = 1.0 / torch.exp(logits - top[..., None]).sum(dim=-1)
    return tokens, confidence


def draft_head_config_dict(cfg: DraftHeadConfig) -> dict:
    return {
        "num_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "rope_theta": cfg.rope_theta,
        "rms_norm_eps": cfg.rms_norm_eps,
        "vocab_size": cfg.vocab_size,
    }


def save_draft_head(
    path: str,
    head: DraftHead,
    base_config: Any,
    base_model: str,
    exit_layer: int,
    dtype: torch.dtype = torch.float16,
    metadata: dict | None = None,
    weights_hash: str | None = None,
) -> ArtifactConfig:
    """Write the artifact; ``weights_hash``: the base's ``weights_fingerprint`` (checked at
    launch)."""
    cfg = ArtifactConfig.for_base(
        KIND,
        base_config,
        base_model,
        head.cfg.hidden_size,
        exit_layer,
        extra={"head": draft_head_config_dict(head.cfg), **(metadata or {})},
        weights_hash=weights_hash,
    )
    save_artifact(path, cfg, head.state_dict(), dtype)
    return cfg


def load_draft_head(
    path: str,
    base_config: Any,
    exit_layer: int | None = None,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
) -> tuple[DraftHead, ArtifactConfig]:
    """Load a draft-head artifact for ``base_config``; weights are upcast to ``dtype``.

    Raises :class:`ArtifactMismatchError` (naming the field and both values) if the artifact
    was trained for another base model or another exit layer.
    """
    cfg, state = read_artifact(path)
    check_compatible(
        cfg, base_config, expected_kind=KIND, exit_layer=exit_layer, where=f"draft head {path!r}"
    )
    head = DraftHead(_draft_head_config(cfg, base_config))
    load_state_strict(head, state, where=f"draft head {path!r}")
    return head.to(device=device, dtype=dtype).eval(), cfg


def _draft_head_config(cfg: ArtifactConfig, base_config: Any) -> DraftHeadConfig:
    num_layers = int(cfg.extra.get("head", {}).get("num_layers", 1))
    return DraftHeadConfig.from_base(base_config, num_layers=num_layers)


def check_draft_head_weights(path: str, cfg: ArtifactConfig, base_config: Any, where: str) -> None:
    """The artifact's weights file is intact and its tensors have the module's shapes.

    Reads only the safetensors header and builds the module on the meta device, so it is
    cheap enough for a launcher (raises :class:`ArtifactMismatchError`)."""
    head_cfg = _draft_head_config(cfg, base_config)
    with torch.device("meta"):
        head = DraftHead(head_cfg)
    check_weights_file(path, {k: v.shape for k, v in head.state_dict().items()}, where)


__all__ = [
    "ArtifactMismatchError",
    "check_draft_head_weights",
    "DraftHead",
    "DraftHeadConfig",
    "greedy_with_confidence",
    "load_draft_head",
    "save_draft_head",
]
