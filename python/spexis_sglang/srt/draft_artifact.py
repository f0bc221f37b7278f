"""Stage 0's draft head as a user configures it (``SPEXIS_DRAFT_HEAD``): an artifact directory
or ``random:<seed>``, resolved to full weights and checked against the model being served and
its pipeline split before anything is loaded (a head for another model, or for a split whose
stage 0 does not end at its exit layer, is refused with a clear message). The model classes
that run it are in :mod:`~spexis_sglang.srt.draft_model`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from typing import Any, Dict, Optional, Tuple

import torch

from spexis_sglang.srt.config import ENV_DRAFT_HEAD, random_head_seed

RANDOM_NUM_LAYERS = 1
ARTIFACT_CONFIG = "config.json"
ARTIFACT_WEIGHTS = "model.safetensors"

LAYER_PARAM_RE = re.compile(r"^layers\.(\d+)\.(.+)$")


class DraftHeadError(ValueError):
    """The configured draft head cannot serve this model / pipeline split."""


@dataclasses.dataclass
class DraftHeadSpec:
    """A resolved draft head: where it came from, its shape and its full (unsharded) weights."""

    source: str
    num_layers: int
    exit_layer: int
    post_attention_norm: bool
    final_norm: bool
    weights: Dict[str, torch.Tensor]
    config: Dict[str, Any] = dataclasses.field(default_factory=dict)


# ------------------------------------------------------------------------------------------------
# Resolving SPEXIS_DRAFT_HEAD
# ------------------------------------------------------------------------------------------------


def head_dims(base_config: Any) -> Tuple[int, int, int, int]:
    hidden = int(base_config.hidden_size)
    num_heads = int(base_config.num_attention_heads)
    num_kv_heads = int(getattr(base_config, "num_key_value_heads", None) or num_heads)
    head_dim = int(getattr(base_config, "head_dim", None) or hidden // num_heads)
    return hidden, num_heads, num_kv_heads, head_dim


def expected_shapes(
    base_config: Any, num_layers: int, post_attention_norm: bool, final_norm: bool
) -> Dict[str, Tuple[int, ...]]:
    """Full (unsharded) parameter shapes of a head for ``base_config``."""
    hidden, num_heads, num_kv_heads, head_dim = head_dims(base_config)
    shapes: Dict[str, Tuple[int, ...]] = {
        "norm.weight": (hidden,),
        "fc.weight": (hidden, hidden),
        "fc.bias": (hidden,),
    }
    for i in range(num_layers):
        p = f"layers.{i}."
        shapes[p + "input_layernorm.weight"] = (hidden,)
        shapes[p + "self_attn.q_proj.weight"] = (num_heads * head_dim, hidden)
        shapes[p + "self_attn.k_proj.weight"] = (num_kv_heads * head_dim, hidden)
        shapes[p + "self_attn.v_proj.weight"] = (num_kv_heads * head_dim, hidden)
        shapes[p + "self_attn.o_proj.weight"] = (hidden, num_heads * head_dim)
        if post_attention_norm:
            shapes[p + "post_attention_layernorm.weight"] = (hidden,)
    if final_norm:
        shapes["final_norm.weight"] = (hidden,)
    return shapes


def random_draft_head_weights(
    base_config: Any, seed: int, num_layers: int = RANDOM_NUM_LAYERS
) -> Dict[str, torch.Tensor]:
    """Deterministic random head weights (fp32, CPU): the same on every rank for a given seed.

    Projections are N(0, 1/fan_in) so activations keep their scale; norms are ones; final norm
    on, no post-attention norm.
    """
    gen = torch.Generator(device="cpu")
    gen.manual_seed(int(seed))
    weights: Dict[str, torch.Tensor] = {}
    for name, shape in expected_shapes(base_config, num_layers, False, True).items():
        if name.endswith("layernorm.weight") or name.endswith("norm.weight"):
            weights[name] = torch.ones(shape, dtype=torch.float32, device="cpu")
        elif name.endswith(".bias"):
            weights[name] = torch.zeros(shape, dtype=torch.float32, device="cpu")
        else:
            std = shape[1] ** -0.5
            weights[name] = (
                torch.randn(shape, generator=gen, dtype=torch.float32, device="cpu") * std
            )
    return weights


def parse_draft_head_value(value: str) -> Tuple[str, Any]:
    """``("random", seed)`` or ``("artifact", directory)``; raises DraftHeadError when malformed."""
    value = value.strip()
    try:
        seed = random_head_seed(value)
    except ValueError as e:
        raise DraftHeadError(f"{ENV_DRAFT_HEAD}={e}") from None
    if seed is not None:
        return "random", seed
    path = os.path.expanduser(value)
    if not os.path.isdir(path):
        raise DraftHeadError(
            f"{ENV_DRAFT_HEAD}={value!r}: no such draft-head artifact directory "
            f"(expected a directory with {ARTIFACT_CONFIG} and {ARTIFACT_WEIGHTS}, "
            f"or 'random:<seed>')"
        )
    for f in (ARTIFACT_CONFIG, ARTIFACT_WEIGHTS):
        if not os.path.isfile(os.path.join(path, f)):
            raise DraftHeadError(f"draft-head artifact {value!r}: missing {f}")
    return "artifact", path


def _partition_hint(num_hidden_layers: int, pp_size: int, exit_layer: int) -> str:
    rest = num_hidden_layers - exit_layer
    if exit_layer <= 0 or pp_size < 2 or rest < pp_size - 1:
        return ""
    base, extra = divmod(rest, pp_size - 1)
    parts = [exit_layer] + [
        base + (1 if i >= pp_size - 1 - extra else 0) for i in range(pp_size - 1)
    ]
    return f"SGLANG_PP_LAYER_PARTITION={','.join(str(p) for p in parts)}"


def check_exit_layer(
    source: str,
    artifact_exit_layer: int,
    stage_end_layer: int,
    num_hidden_layers: int,
    pp_size: int,
) -> None:
    """The head was trained on the residual stream after ``exit_layer`` base layers; stage 0 must
    end exactly there, or its drafts are garbage."""
    if int(artifact_exit_layer) == int(stage_end_layer):
        return
    hint = _partition_hint(num_hidden_layers, pp_size, int(artifact_exit_layer))
    raise DraftHeadError(
        f"draft-head artifact {source!r} was trained at exit layer {artifact_exit_layer}, but "
        f"pipeline stage 0 ends at layer {stage_end_layer} (of {num_hidden_layers}, "
        f"pp_size={pp_size}). Split the layers so that stage 0 holds exactly "
        f"{artifact_exit_layer} layers"
        + (f", e.g. {hint}" if hint else " with SGLANG_PP_LAYER_PARTITION")
        + "."
    )


def _validate_against_base(source: str, cfg: Dict[str, Any], base_config: Any) -> None:
    hidden, num_heads, num_kv_heads, head_dim = head_dims(base_config)
    expected = {
        "hidden_size": hidden,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": head_dim,
        "vocab_size": int(base_config.vocab_size),
    }
    for key, want in expected.items():
        if key in cfg and cfg[key] is not None and int(cfg[key]) != want:
            raise DraftHeadError(
                f"draft-head artifact {source!r} does not fit the base model: "
                f"{key}={cfg[key]} in its {ARTIFACT_CONFIG}, but the base model has {key}={want}"
            )


def _layers_in(weights: Dict[str, torch.Tensor]) -> int:
    ids = {int(m.group(1)) for m in map(LAYER_PARAM_RE.match, weights) if m}
    return max(ids) + 1 if ids else 0


def _check_weights(
    source: str, weights: Dict[str, torch.Tensor], base_config: Any
) -> DraftHeadSpec:
    num_layers = _layers_in(weights)
    if num_layers == 0:
        raise DraftHeadError(f"draft-head artifact {source!r} has no attention layers (layers.0.*)")
    post = "layers.0.post_attention_layernorm.weight" in weights
    final = "final_norm.weight" in weights
    shapes = expected_shapes(base_config, num_layers, post, final)
    missing = sorted(set(shapes) - set(weights))
    unexpected = sorted(set(weights) - set(shapes))
    if missing or unexpected:
        raise DraftHeadError(
            f"draft-head artifact {source!r}: "
            + (f"missing tensors {missing}" if missing else "")
            + ("; " if missing and unexpected else "")
            + (f"unexpected tensors {unexpected}" if unexpected else "")
        )
    for name, shape in shapes.items():
        if tuple(weights[name].shape) != shape:
            raise DraftHeadError(
                f"draft-head artifact {source!r} does not fit the base model: tensor {name} has "
                f"shape {tuple(weights[name].shape)}, expected {shape}"
            )
    return DraftHeadSpec(
        source=source,
        num_layers=num_layers,
        exit_layer=-1,
        post_attention_norm=post,
        final_norm=final,
        weights=weights,
    )


def _load_with_models_package(path: str, base_config: Any) -> Optional[Tuple[Dict, Dict]]:
    """Use ``spexis_sglang.models``' loader when it exists: it validates the artifact against the
    base model (fingerprint, kind, shapes) and names the mismatching field."""
    try:
        from spexis_sglang.models.draft_head import load_draft_head
    except ImportError:
        return None
    try:
        head, cfg = load_draft_head(path, base_config, exit_layer=None, dtype=torch.float32)
    except (ValueError, FileNotFoundError) as e:
        raise DraftHeadError(str(e)) from e
    weights = {k: v.detach().to("cpu", torch.float32) for k, v in head.state_dict().items()}
    return dataclasses.asdict(cfg), weights


def load_artifact(path: str, base_config: Any) -> Tuple[Dict[str, Any], Dict[str, torch.Tensor]]:
    """Read and validate an artifact directory; returns ``(config, fp32 CPU weights)``."""
    loaded = _load_with_models_package(path, base_config)
    if loaded is not None:
        return loaded
    try:
        with open(os.path.join(path, ARTIFACT_CONFIG)) as f:
            cfg = json.load(f)
    except (OSError, ValueError) as e:
        raise DraftHeadError(f"draft-head artifact {path!r}: unreadable {ARTIFACT_CONFIG}: {e}")
    if not isinstance(cfg, dict):
        raise DraftHeadError(f"draft-head artifact {path!r}: {ARTIFACT_CONFIG} is not an object")
    _validate_against_base(path, cfg, base_config)
    from safetensors import safe_open

    weights: Dict[str, torch.Tensor] = {}
    try:
        with safe_open(os.path.join(path, ARTIFACT_WEIGHTS), framework="pt", device="cpu") as f:
            for name in f.keys():
                weights[name] = f.get_tensor(name).to(torch.float32)
    except Exception as e:
        raise DraftHeadError(f"draft-head artifact {path!r}: unreadable {ARTIFACT_WEIGHTS}: {e}")
    return cfg, weights


def resolve_draft_head(
    value: Optional[str],
    base_config: Any,
    stage_end_layer: int,
    pp_size: int,
) -> Optional[DraftHeadSpec]:
    """Turn ``SPEXIS_DRAFT_HEAD``'s value into a checked :class:`DraftHeadSpec` (None: no head)."""
    if value is None or value.strip() == "":
        return None
    kind, arg = parse_draft_head_value(value)
    if kind == "random":
        weights = random_draft_head_weights(base_config, arg)
        spec = _check_weights(value, weights, base_config)
        spec.exit_layer = stage_end_layer
        spec.config = {"random_seed": arg}
        return spec
    cfg, weights = load_artifact(arg, base_config)
    spec = _check_weights(arg, weights, base_config)
    if "exit_layer" not in cfg:
        raise DraftHeadError(
            f"draft-head artifact {arg!r}: {ARTIFACT_CONFIG} does not record 'exit_layer'"
        )
    check_exit_layer(
        arg, int(cfg["exit_layer"]), stage_end_layer, int(base_config.num_hidden_layers), pp_size
    )
    spec.exit_layer = int(cfg["exit_layer"])
    spec.config = cfg
    return spec


__all__ = [
    "ARTIFACT_CONFIG",
    "ARTIFACT_WEIGHTS",
    "DraftHeadError",
    "DraftHeadSpec",
    "LAYER_PARAM_RE",
    "check_exit_layer",
    "expected_shapes",
    "head_dims",
    "load_artifact",
    "parse_draft_head_value",
    "random_draft_head_weights",
    "resolve_draft_head",
]
