"""Remaining-length predictor (paper §5.2): P(remaining < 4, 8, 16, 32, 64) per row.

Input: the same exit-layer residual stream the draft head reads, at the row's position.
Forward (fp32)::

    u = RMSNorm_norm(h)                     # the raw residual stream has outlier channels
    a = fc1(u) [+ fc_feat(log1p(f))]        # optional scalar features f (see below)
    o = fc3(GELU(fc2(GELU(a))))             # 3-layer MLP, two GELUs (exact erf GELU)
    z = o                                   # output "independent" (the paper's, default)
    z = o_1, o_1 + softplus(o_2), ...       # output "cumulative": z_k increases with k
    p = sigmoid(z)                          # [5]: P(remaining < t) for t in thresholds

Scalar features (``features`` in the artifact's config.json; missing = none, the hidden state
only, as in the paper): ``tokens_generated`` = output tokens the request had before this row
(0 on the last prompt token's row) and ``prompt_len`` = tokens of the request's prompt. Both
are known to the server at no cost; they enter as ``log1p(x)`` through ``fc_feat.weight [M,
F]`` (no bias), in the order of ``features``. The ``cumulative`` output makes the
probabilities non-decreasing across thresholds by construction.

"remaining" counts the tokens the request will still emit from this row on, the token this
row produces included (1 on the row that emits EOS). A threshold is predicted true when
``p[k] >= cutoffs[k]``; cutoffs are calibrated on validation data to a target precision and
stored in the artifact with the precision/recall they reached.

Parameters: ``norm.weight [H]``, ``fc1.weight [M, H]``, ``fc1.bias [M]``, ``fc2.weight [M, M]``,
``fc2.bias [M]``, ``fc3.weight [5, M]``, ``fc3.bias [5]`` (M = ``mlp_hidden``, 512), and
``fc_feat.weight [M, F]`` when there are F > 0 features.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from spexis_sglang.core.lookahead import DEFAULT_THRESHOLDS
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
from spexis_sglang.models.draft_head import RMSNorm

logger = logging.getLogger(__name__)

KIND = "length_predictor"
FEATURES = ("tokens_generated", "prompt_len")
OUTPUTS = ("independent", "cumulative")


@dataclass
class LengthPredictorConfig:
    hidden_size: int
    rms_norm_eps: float = 1e-5
    mlp_hidden: int = 512
    thresholds: tuple[int, ...] = DEFAULT_THRESHOLDS
    # calibrated on validation data; 0.5 until calibrated
    cutoffs: list[float] = field(default_factory=lambda: [0.5] * len(DEFAULT_THRESHOLDS))
    # scalar inputs besides the hidden state, a subset of FEATURES in this order; () = paper's
    features: tuple[str, ...] = ()
    output: str = "independent"


class LengthPredictor(nn.Module):
    def __init__(self, cfg: LengthPredictorConfig) -> None:
        super().__init__()
        if len(cfg.cutoffs) != len(cfg.thresholds):
            raise ValueError("one cutoff per threshold is needed")
        if list(cfg.thresholds) != sorted(set(cfg.thresholds)):
            raise ValueError(f"thresholds must increase strictly, got {cfg.thresholds}")
        unknown = [f for f in cfg.features if f not in FEATURES]
        if unknown or len(set(cfg.features)) != len(cfg.features):
            raise ValueError(f"features must be distinct names from {FEATURES}, got {cfg.features}")
        if cfg.output not in OUTPUTS:
            raise ValueError(f"output must be one of {OUTPUTS}, got {cfg.output!r}")
        cfg.features = tuple(cfg.features)
        self.cfg = cfg
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.fc1 = nn.Linear(cfg.hidden_size, cfg.mlp_hidden)
        self.fc2 = nn.Linear(cfg.mlp_hidden, cfg.mlp_hidden)
        self.fc3 = nn.Linear(cfg.mlp_hidden, len(cfg.thresholds))
        if cfg.features:
            self.fc_feat = nn.Linear(len(cfg.features), cfg.mlp_hidden, bias=False)
        # a buffer, not a tensor made per call: predict() runs inside captured CUDA graphs
        self.register_buffer(
            "cutoffs", torch.tensor(cfg.cutoffs, dtype=torch.float32), persistent=False
        )

    def feature_matrix(
        self,
        hidden: torch.Tensor,
        tokens_generated: torch.Tensor | None = None,
        prompt_len: torch.Tensor | None = None,
    ) -> torch.Tensor | None:
        """The [..., F] log1p-scaled feature inputs (None without features); checks presence."""
        if not self.cfg.features:
            return None
        given = {"tokens_generated": tokens_generated, "prompt_len": prompt_len}
        cols = []
        for name in self.cfg.features:
            v = given[name]
            if v is None:
                raise ValueError(
                    f"this length predictor was trained with features {list(self.cfg.features)}; "
                    f"pass {name}= (a tensor of shape {tuple(hidden.shape[:-1])})"
                )
            v = torch.as_tensor(v, device=hidden.device).float()
            cols.append(torch.log1p(v.clamp_min(0)).expand(hidden.shape[:-1]))
        return torch.stack(cols, -1)

    def forward(
        self,
        hidden: torch.Tensor,
        tokens_generated: torch.Tensor | None = None,
        prompt_len: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits [..., 5] (before the sigmoid), for training with BCE-with-logits.

        ``tokens_generated`` / ``prompt_len`` ([...], any numeric dtype) are required when the
        predictor was trained with them (``cfg.features``) and ignored otherwise.
        """
        x = self.norm(hidden.float())
        a = self.fc1(x)
        f = self.feature_matrix(hidden, tokens_generated, prompt_len)
        if f is not None:
            a = a + self.fc_feat(f)
        o = self.fc3(F.gelu(self.fc2(F.gelu(a))))
        if self.cfg.output == "cumulative":
            o = torch.cat([o[..., :1], F.softplus(o[..., 1:])], -1).cumsum(-1)
        return o

    @torch.no_grad()
    def probabilities(
        self,
        hidden: torch.Tensor,
        tokens_generated: torch.Tensor | None = None,
        prompt_len: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return torch.sigmoid(self.forward(hidden, tokens_generated, prompt_len))

    @torch.no_grad()
    def predict(
        self,
        hidden: torch.Tensor,
        tokens_generated: torch.Tensor | None = None,
        prompt_len: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Bool [..., 5]: remaining < threshold[k], using the calibrated cutoffs."""
        return self.probabilities(hidden, tokens_generated, prompt_len) >= self.cutoffs


def predicted_bucket(predicted: torch.Tensor) -> torch.Tensor:
    """Int64 [...]: the smallest threshold index predicted true per row, -1 where none is
    (the bucket convention of ``spexis_sglang.core.lookahead``)."""
    hit = predicted.to(torch.bool)
    first = torch.argmax(hit.to(torch.int8), dim=-1)
    return torch.where(hit.any(dim=-1), first, torch.full_like(first, -1)).to(torch.int64)


def save_length_predictor(
    path: str,
    model: LengthPredictor,
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
        model.cfg.hidden_size,
        exit_layer,
        extra={
            "thresholds": list(model.cfg.thresholds),
            "cutoffs": [float(c) for c in model.cfg.cutoffs],
            "mlp_hidden": model.cfg.mlp_hidden,
            "features": list(model.cfg.features),
            "feature_transform": "log1p",
            "output": model.cfg.output,
            **(metadata or {}),
        },
        weights_hash=weights_hash,
    )
    save_artifact(path, cfg, model.state_dict(), dtype)
    return cfg


def load_length_predictor(
    path: str,
    base_config: Any,
    exit_layer: int | None = None,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
) -> tuple[LengthPredictor, ArtifactConfig]:
    """Load a length-predictor artifact for ``base_config`` (fails clearly on a mismatch).

    Artifacts written before features existed (no ``features`` / ``output`` in config.json)
    load as hidden-state only with independent outputs.
    """
    cfg, state = read_artifact(path)
    where = f"length predictor {path!r}"
    check_compatible(cfg, base_config, expected_kind=KIND, exit_layer=exit_layer, where=where)
    model = LengthPredictor(_length_predictor_config(cfg, base_config, where))
    load_state_strict(model, state, where=where)
    return model.to(device=device, dtype=dtype).eval(), cfg


def check_length_predictor_weights(
    path: str, cfg: ArtifactConfig, base_config: Any, where: str
) -> None:
    """The artifact's settings are valid, its weights file intact and of the module's shapes.

    Reads only the safetensors header and builds the module on the meta device (cheap enough
    for a launcher; raises :class:`ArtifactMismatchError`)."""
    lp_cfg = _length_predictor_config(cfg, base_config, where)
    with torch.device("meta"):
        model = LengthPredictor(lp_cfg)
    check_weights_file(path, {k: v.shape for k, v in model.state_dict().items()}, where)


def _length_predictor_config(
    cfg: ArtifactConfig, base_config: Any, where: str
) -> LengthPredictorConfig:
    thresholds = tuple(int(t) for t in cfg.extra.get("thresholds", DEFAULT_THRESHOLDS))
    cutoffs = [float(c) for c in cfg.extra.get("cutoffs", [0.5] * len(thresholds))]
    if len(cutoffs) != len(thresholds):
        raise ArtifactMismatchError(
            f"{where}: {len(cutoffs)} cutoffs for {len(thresholds)} thresholds"
        )
    features = tuple(str(f) for f in cfg.extra.get("features", ()))
    if features and cfg.extra.get("feature_transform", "log1p") != "log1p":
        raise ArtifactMismatchError(
            f"{where}: feature_transform {cfg.extra['feature_transform']!r} is not supported"
        )
    if any(f not in FEATURES for f in features):
        raise ArtifactMismatchError(f"{where}: unknown features {features}; known: {FEATURES}")
    output = str(cfg.extra.get("output", "independent"))
    if output not in OUTPUTS:
        raise ArtifactMismatchError(f"{where}: unknown output {output!r}; known: {OUTPUTS}")
    return LengthPredictorConfig(
        hidden_size=cfg.hidden_size,
        rms_norm_eps=architecture_fields(base_config)["rms_norm_eps"],
        mlp_hidden=int(cfg.extra.get("mlp_hidden", 512)),
        thresholds=thresholds,
        cutoffs=cutoffs,
        features=features,
        output=output,
    )
