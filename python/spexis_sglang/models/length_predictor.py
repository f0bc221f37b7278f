"""Remaining-length predictor (paper §5.2): P(remaining < 4, 8, 16, 32, 64) per row.

Input: the same exit-layer residual stream the draft head reads, at the row's position.
Forward (fp32)::

    u = RMSNorm_norm(h)                     # the raw residual stream has outlier channels
    z = fc3(GELU(fc2(GELU(fc1(u)))))        # 3-layer MLP, two GELUs (exact erf GELU)
    p = sigmoid(z)                          # [5]: P(remaining < t) for t in thresholds

"remaining" counts the tokens the request will still emit from this row on, the token this
row produces included (1 on the row that emits EOS). A threshold is predicted true when
``p[k] >= cutoffs[k]``; cutoffs are calibrated on validation data to a target precision and
stored in the artifact with the precision/recall they reached.

Parameters: ``norm.weight [H]``, ``fc1.weight [M, H]``, ``fc1.bias [M]``, ``fc2.weight [M, M]``,
``fc2.bias [M]``, ``fc3.weight [5, M]``, ``fc3.bias [5]`` (M = ``mlp_hidden``, 512).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from spexis_sglang.models.artifact import (
    ArtifactConfig,
    ArtifactMismatchError,
    architecture_fields,
    check_compatible,
    load_state_strict,
    read_artifact,
    save_artifact,
)
from spexis_sglang.models.draft_head import RMSNorm

logger = logging.getLogger(__name__)

KIND = "length_predictor"
DEFAULT_THRESHOLDS = (4, 8, 16, 32, 64)


@dataclass
class LengthPredictorConfig:
    hidden_size: int
    rms_norm_eps: float = 1e-5
    mlp_hidden: int = 512
    thresholds: tuple[int, ...] = DEFAULT_THRESHOLDS
    # calibrated on validation data; 0.5 until calibrated
    cutoffs: list[float] = field(default_factory=lambda: [0.5] * len(DEFAULT_THRESHOLDS))


class LengthPredictor(nn.Module):
    def __init__(self, cfg: LengthPredictorConfig) -> None:
        super().__init__()
        if len(cfg.cutoffs) != len(cfg.thresholds):
            raise ValueError("one cutoff per threshold is needed")
        if list(cfg.thresholds) != sorted(set(cfg.thresholds)):
            raise ValueError(f"thresholds must increase strictly, got {cfg.thresholds}")
        self.cfg = cfg
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.fc1 = nn.Linear(cfg.hidden_size, cfg.mlp_hidden)
        self.fc2 = nn.Linear(cfg.mlp_hidden, cfg.mlp_hidden)
        self.fc3 = nn.Linear(cfg.mlp_hidden, len(cfg.thresholds))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [..., 5] (before the sigmoid), for training with BCE-with-logits."""
        x = self.norm(hidden.float())
        return self.fc3(F.gelu(self.fc2(F.gelu(self.fc1(x)))))

    @torch.no_grad()
    def probabilities(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.forward(hidden))

    @torch.no_grad()
    def predict(self, hidden: torch.Tensor) -> torch.Tensor:
        """Bool [..., 5]: remaining < threshold[k], using the calibrated cutoffs."""
        cut = torch.tensor(self.cfg.cutoffs, device=hidden.device)
        return self.probabilities(hidden) >= cut


def save_length_predictor(
    path: str,
    model: LengthPredictor,
    base_config: Any,
    base_model: str,
    exit_layer: int,
    dtype: torch.dtype = torch.float16,
    metadata: dict | None = None,
) -> ArtifactConfig:
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
            **(metadata or {}),
        },
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
    """Load a length-predictor artifact for ``base_config`` (fails clearly on a mismatch)."""
    cfg, state = read_artifact(path)
    where = f"length predictor {path!r}"
    check_compatible(cfg, base_config, expected_kind=KIND, exit_layer=exit_layer, where=where)
    thresholds = tuple(int(t) for t in cfg.extra.get("thresholds", DEFAULT_THRESHOLDS))
    cutoffs = [float(c) for c in cfg.extra.get("cutoffs", [0.5] * len(thresholds))]
    if len(cutoffs) != len(thresholds):
        raise ArtifactMismatchError(
            f"{where}: {len(cutoffs)} cutoffs for {len(thresholds)} thresholds"
        )
    model = LengthPredictor(
        LengthPredictorConfig(
            hidden_size=cfg.hidden_size,
            rms_norm_eps=architecture_fields(base_config)["rms_norm_eps"],
            mlp_hidden=int(cfg.extra.get("mlp_hidden", 512)),
            thresholds=thresholds,
            cutoffs=cutoffs,
        )
    )
    load_state_strict(model, state, where=where)
    return model.to(device=device, dtype=dtype).eval(), cfg
