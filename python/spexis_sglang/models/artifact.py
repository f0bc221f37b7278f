"""Artifact directories (``config.json`` + ``model.safetensors``) and base-model fingerprints.

An artifact is only meaningful on the base model it was trained for: the draft head reuses that
model's LM head and reads one layer's residual stream, and the length predictor reads the same
stream. So every artifact records the base model's name and a fingerprint of its
architecture-defining fields, and loading compares them with the running model, naming the
first field that differs.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from safetensors.torch import load_file, save_file

logger = logging.getLogger(__name__)

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
FORMAT_VERSION = 1

# Fields that define the architecture a head depends on. Order is the order errors check them.
FINGERPRINT_FIELDS = (
    "model_type",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
    "rope_theta",
    "rope_type",
    "rms_norm_eps",
)


class ArtifactMismatchError(ValueError):
    """The artifact was trained for a different base model (or is malformed)."""


def _get(cfg: Any, name: str, default: Any = None) -> Any:
    if isinstance(cfg, Mapping):
        return cfg.get(name, default)
    return getattr(cfg, name, default)


def architecture_fields(base_config: Any) -> dict[str, Any]:
    """The fingerprinted fields of a base config (an HF config object or its ``to_dict()``).

    Handles transformers 5 (``rope_parameters``) and 4 (``rope_theta`` / ``rope_scaling``).
    """
    hidden = int(_get(base_config, "hidden_size"))
    heads = int(_get(base_config, "num_attention_heads"))
    kv_heads = _get(base_config, "num_key_value_heads") or heads
    head_dim = _get(base_config, "head_dim") or hidden // heads
    rope = _get(base_config, "rope_parameters") or {}
    if not isinstance(rope, Mapping):
        rope = dict(rope)
    if isinstance(rope.get("full_attention"), Mapping):  # per layer type (Gemma 3): global
        rope = rope["full_attention"]
    scaling = _get(base_config, "rope_scaling") or {}
    rope_theta = rope.get("rope_theta", _get(base_config, "rope_theta", 10000.0))
    rope_type = (
        rope.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    )
    eps = _get(base_config, "rms_norm_eps", 1e-6)
    return {
        "model_type": str(_get(base_config, "model_type", "")),
        "hidden_size": hidden,
        "num_hidden_layers": int(_get(base_config, "num_hidden_layers")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(kv_heads),
        "head_dim": int(head_dim),
        "vocab_size": int(_get(base_config, "vocab_size")),
        "rope_theta": float(rope_theta),
        "rope_type": str(rope_type),
        # float32 round trip so a config that stores 1e-5 as 9.9999997e-06 matches
        "rms_norm_eps": float(torch.tensor(float(eps), dtype=torch.float32).item()),
    }


def architecture_name(base_config: Any) -> str:
    """The checkpoint's class name (``architectures[0]``), "" if not recorded."""
    names = _get(base_config, "architectures") or []
    return str(names[0]) if names else ""


# embedding / LM-head rows hashed by weights_fingerprint: spread over the vocabulary
WEIGHT_HASH_ROWS = 64
_EMBED_NAMES = ("embed_tokens.weight", "lm_head.weight")


def _weight_files(model_dir: str) -> list[str]:
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(model_dir, fn) for fn in files]
    single = os.path.join(model_dir, WEIGHTS_FILE)
    return [single] if os.path.isfile(single) else []


def weights_fingerprint(model_dir: str) -> str | None:
    """sha256 over fixed rows of the embedding and LM-head matrices, rounded to bfloat16.

    Tells two checkpoints of one architecture apart (a fine-tune drafts differently) in
    milliseconds at launch: only ``WEIGHT_HASH_ROWS`` rows per matrix are read, and the
    bfloat16 rounding makes an fp32 checkpoint and its bf16 copy agree. None when the
    directory has no safetensors weights (a config-only directory for dummy weights).
    """
    from safetensors import safe_open

    found: dict[str, torch.Tensor] = {}
    for path in _weight_files(model_dir):
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in f.keys():
                key = next((k for k in _EMBED_NAMES if name.endswith(k)), None)
                if key is None or key in found:
                    continue
                sl = f.get_slice(name)
                rows, _ = sl.get_shape()
                idx = sorted(
                    {
                        round(i * (rows - 1) / (WEIGHT_HASH_ROWS - 1))
                        for i in range(WEIGHT_HASH_ROWS)
                    }
                )
                found[key] = torch.cat([sl[i : i + 1] for i in idx]).to(torch.bfloat16)
    if "embed_tokens.weight" not in found:
        return None
    h = hashlib.sha256()
    for key in _EMBED_NAMES:
        if key in found:
            t = found[key].contiguous()
            h.update(f"{key}:{tuple(t.shape)}".encode())
            h.update(t.view(torch.int16).numpy().tobytes())
    return h.hexdigest()


def base_fingerprint(base_config: Any) -> str:
    """sha256 of the canonical JSON of :func:`architecture_fields`."""
    fields = architecture_fields(base_config)
    blob = json.dumps(fields, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()


@dataclass
class ArtifactConfig:
    """What ``config.json`` holds. ``extra`` keeps kind-specific settings and training metadata."""

    kind: str  # "draft_head" | "length_predictor"
    base_model: str
    base_fingerprint: str
    base_architecture: dict[str, Any]
    hidden_size: int
    exit_layer: int
    weights_dtype: str = "float16"
    format_version: int = FORMAT_VERSION
    extra: dict[str, Any] = field(default_factory=dict)
    # the checkpoint class and :func:`weights_fingerprint` ("" / None: not recorded, as in
    # artifacts exported before they were; then not checked)
    base_architecture_name: str = ""
    base_weights_hash: str | None = None

    @classmethod
    def for_base(
        cls,
        kind: str,
        base_config: Any,
        base_model: str,
        hidden_size: int,
        exit_layer: int,
        extra: dict[str, Any],
        weights_hash: str | None = None,
    ) -> "ArtifactConfig":
        """The config of an artifact trained on ``base_config`` (fingerprint and fields filled
        in)."""
        return cls(
            kind=kind,
            base_model=base_model,
            base_fingerprint=base_fingerprint(base_config),
            base_architecture=architecture_fields(base_config),
            hidden_size=hidden_size,
            exit_layer=exit_layer,
            extra=extra,
            base_architecture_name=architecture_name(base_config),
            base_weights_hash=weights_hash,
        )

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "ArtifactConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        missing = [
            n for n in ("kind", "base_fingerprint", "hidden_size", "exit_layer") if n not in data
        ]
        if missing:
            raise ArtifactMismatchError(f"artifact config.json lacks field(s) {missing}")
        return cls(**{k: v for k, v in data.items() if k in names})


def check_compatible(
    cfg: ArtifactConfig,
    base_config: Any,
    *,
    expected_kind: str,
    exit_layer: int | None = None,
    where: str = "artifact",
) -> None:
    """Raise :class:`ArtifactMismatchError` naming the field, the artifact's and the base's
    value."""
    if cfg.kind != expected_kind:
        raise ArtifactMismatchError(f"{where}: kind is {cfg.kind!r}, expected {expected_kind!r}")
    if cfg.format_version > FORMAT_VERSION:
        raise ArtifactMismatchError(
            f"{where}: format_version {cfg.format_version} is newer than supported "
            f"({FORMAT_VERSION})"
        )
    base = architecture_fields(base_config)
    if cfg.base_fingerprint != base_fingerprint(base_config):
        for name in FINGERPRINT_FIELDS:
            mine = cfg.base_architecture.get(name)
            if mine != base[name]:
                raise ArtifactMismatchError(
                    f"{where} does not match the base model: field {name!r} is {mine!r} in the "
                    f"artifact (trained on {cfg.base_model!r}) but {base[name]!r} in the base model"
                )
        raise ArtifactMismatchError(
            f"{where} does not match the base model: fingerprint {cfg.base_fingerprint[:12]} "
            f"(artifact) != {base_fingerprint(base_config)[:12]} (base model)"
        )
    name = architecture_name(base_config)
    if cfg.base_architecture_name and name and cfg.base_architecture_name != name:
        raise ArtifactMismatchError(
            f"{where} does not match the base model: it was trained on a "
            f"{cfg.base_architecture_name} ({cfg.base_model!r}), the base model is a {name}"
        )
    if cfg.hidden_size != base["hidden_size"]:
        raise ArtifactMismatchError(
            f"{where}: field 'hidden_size' is {cfg.hidden_size} in the artifact but "
            f"{base['hidden_size']} in the base model"
        )
    if not 0 < cfg.exit_layer <= base["num_hidden_layers"]:
        raise ArtifactMismatchError(
            f"{where}: exit_layer {cfg.exit_layer} is outside 1..{base['num_hidden_layers']}"
        )
    if exit_layer is not None and exit_layer != cfg.exit_layer:
        raise ArtifactMismatchError(
            f"{where}: field 'exit_layer' is {cfg.exit_layer} in the artifact but the server's "
            f"stage 0 ends after layer {exit_layer}"
        )


def check_weights_fingerprint(cfg: ArtifactConfig, model_dir: str, where: str = "artifact") -> None:
    """The model's embedding / LM-head rows hash as the artifact's base model's did.

    Same architecture, other weights (a fine-tune, another size of one config family) would
    pass every config check and draft badly; this refuses it. Skipped when either side has no
    hash (an artifact that does not record one, a model directory without weights)."""
    if not cfg.base_weights_hash:
        return
    have = weights_fingerprint(model_dir)
    if have is None:
        logger.info(
            "%s: %s has no safetensors weights; weights fingerprint not checked", where, model_dir
        )
        return
    if have != cfg.base_weights_hash:
        raise ArtifactMismatchError(
            f"{where} does not match the base model's weights: it was trained on "
            f"{cfg.base_model!r}, whose embedding / LM-head hash is {cfg.base_weights_hash[:12]}, "
            f"but {model_dir} has {have[:12]} (same architecture, other weights: train a head "
            "for this checkpoint)"
        )


def save_artifact(
    path: str, cfg: ArtifactConfig, state: Mapping[str, torch.Tensor], dtype: torch.dtype
) -> None:
    """Write ``config.json`` and ``model.safetensors`` (weights cast to ``dtype``)."""
    os.makedirs(path, exist_ok=True)
    cfg.weights_dtype = str(dtype).replace("torch.", "")
    tensors = {k: v.detach().to("cpu", dtype).contiguous() for k, v in state.items()}
    save_file(tensors, os.path.join(path, WEIGHTS_FILE), metadata={"kind": cfg.kind})
    with open(os.path.join(path, CONFIG_FILE), "w") as f:
        f.write(cfg.to_json())


def read_artifact_config(path: str) -> ArtifactConfig:
    """An artifact directory's ``config.json`` alone (no weights read)."""
    cfg_path = os.path.join(path, CONFIG_FILE)
    if not os.path.isfile(cfg_path):
        raise FileNotFoundError(f"artifact directory {path!r} has no {CONFIG_FILE}")
    with open(cfg_path) as f:
        try:
            data = json.load(f)
        except json.JSONDecodeError as e:
            raise ArtifactMismatchError(f"{cfg_path} is not valid JSON: {e}") from e
    return ArtifactConfig.from_dict(data)


def read_artifact(path: str) -> tuple[ArtifactConfig, dict[str, torch.Tensor]]:
    """Read an artifact directory; weights stay in their stored dtype."""
    weights_path = os.path.join(path, WEIGHTS_FILE)
    cfg = read_artifact_config(path)
    if not os.path.isfile(weights_path):
        raise FileNotFoundError(f"artifact directory {path!r} has no {WEIGHTS_FILE}")
    return cfg, load_file(weights_path)


def check_weights_file(
    path: str, expected: Mapping[str, tuple[int, ...]], where: str = "artifact"
) -> None:
    """Check an artifact's ``model.safetensors`` without reading its tensors.

    Reads only the header: a truncated or unparsable file, a missing or unexpected tensor, or
    a shape that differs from ``expected`` (name -> shape, e.g. a module's state dict built on
    the meta device) raises :class:`ArtifactMismatchError` naming the problem.
    """
    from safetensors import SafetensorError, safe_open

    weights_path = os.path.join(path, WEIGHTS_FILE)
    if not os.path.isfile(weights_path):
        raise FileNotFoundError(f"artifact directory {path!r} has no {WEIGHTS_FILE}")
    try:
        with safe_open(weights_path, framework="pt", device="cpu") as f:
            shapes = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
    except (SafetensorError, OSError) as e:
        raise ArtifactMismatchError(
            f"{where}: {WEIGHTS_FILE} is corrupt or truncated ({e})"
        ) from None
    _check_shapes(shapes, expected, where)


def _check_shapes(artifact: Mapping[str, Any], module: Mapping[str, Any], where: str) -> None:
    """The artifact's tensor names and shapes are exactly the module's (ArtifactMismatchError)."""
    missing = sorted(set(module) - set(artifact))
    unexpected = sorted(set(artifact) - set(module))
    if missing or unexpected:
        raise ArtifactMismatchError(
            f"{where}: weights do not fit the module (missing {missing}, unexpected {unexpected})"
        )
    for name, shape in artifact.items():
        if tuple(shape) != tuple(module[name]):
            raise ArtifactMismatchError(
                f"{where}: tensor {name!r} has shape {tuple(shape)} in the artifact but "
                f"{tuple(module[name])} in the module"
            )


def load_state_strict(
    module: torch.nn.Module, state: Mapping[str, torch.Tensor], where: str
) -> None:
    """Like ``load_state_dict(strict=True)`` but with shape errors that say which artifact."""
    own = module.state_dict()
    _check_shapes(
        {k: v.shape for k, v in state.items()}, {k: v.shape for k, v in own.items()}, where
    )
    module.load_state_dict({k: v.to(own[k].dtype) for k, v in state.items()})
