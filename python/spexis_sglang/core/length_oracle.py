"""Benchmark-only length oracle: the true remaining length, degraded to a stated quality.

Why: look-ahead admission (§5.2) is only as good as the remaining-length predictions it is
fed, and a predictor exists only for the model it was trained with. With output lengths fixed
in advance (``ignore_eos``, ``max_new_tokens`` drawn from ShareGPT answer lengths) the server
knows every row's true remaining length, so the admission policy can be measured at any model
shape, on random weights, with predictions of a *stated* precision and recall per threshold
(ours, or the paper's Table 4) instead of whatever a predictor would reach.

Degradation, per threshold ``t_k`` (prediction ``remaining < t_k``), per row:

* a positive row (``remaining < t_k``) is predicted with probability ``R_k`` (the recall);
* a negative row is predicted with probability
  ``F_k = R_k pi_k (1 - P_k) / (P_k (1 - pi_k))`` where ``pi_k`` is the base rate (share of
  rows with ``remaining < t_k``): then ``P(positive | predicted) = R_k pi_k / (R_k pi_k +
  F_k (1 - pi_k)) = P_k``. ``F_k`` is capped at 1 (a precision below the base rate cannot be
  reached by predicting more; the precision is then higher than stated).

One uniform number ``u`` per row (a hash of the request and the position, ``core/row_hash``)
serves every threshold: threshold ``k`` is predicted when ``u < R_k`` (positive) or ``u <
F_k`` (negative). The marginals per threshold are as above; across thresholds the predictions
are correlated the way a real predictor's scores are (a row predicted at 4 is likely
predicted at 8). A row's bucket is then the smallest threshold predicted (-1: none), as for
the predictor (``models/length_predictor.predicted_bucket``).

Remaining length: as the predictor's (``models/length_predictor``), the tokens the request
will still emit from this row on, the row's own token included (1 on the request's last row).

Pure numpy (docs/design.md §1); the server side is ``srt/sp_length_oracle.py``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Sequence, Tuple

import numpy as np

from .lookahead import DEFAULT_THRESHOLDS

__all__ = [
    "OracleQuality",
    "PRESETS",
    "OracleSpecError",
    "false_positive_rate",
    "degraded_predictions",
    "buckets_of",
    "base_rate_counts",
    "parse_oracle_spec",
]


class OracleSpecError(ValueError):
    """A length-oracle specification that cannot be used (the message says why)."""


@dataclass(frozen=True)
class OracleQuality:
    """Target precision and recall per threshold, and where they come from."""

    name: str
    precision: Tuple[float, ...]
    recall: Tuple[float, ...]
    thresholds: Tuple[int, ...] = DEFAULT_THRESHOLDS
    source: str = ""

    def __post_init__(self) -> None:
        k = len(self.thresholds)
        if len(self.precision) != k or len(self.recall) != k:
            raise OracleSpecError(
                f"{k} thresholds need {k} precision and {k} recall values, got "
                f"{len(self.precision)} and {len(self.recall)}"
            )
        for p in self.precision:
            if not 0.0 < p <= 1.0:
                raise OracleSpecError(f"precision must be in (0, 1], got {p}")
        for r in self.recall:
            if not 0.0 <= r <= 1.0:
                raise OracleSpecError(f"recall must be in [0, 1], got {r}")

    def as_dict(self) -> dict:
        return {
            "name": self.name,
            "thresholds": list(self.thresholds),
            "precision": list(self.precision),
            "recall": list(self.recall),
            "source": self.source,
        }

    @classmethod
    def from_dict(cls, d: dict) -> "OracleQuality":
        return cls(
            name=str(d["name"]),
            precision=tuple(float(p) for p in d["precision"]),
            recall=tuple(float(r) for r in d["recall"]),
            thresholds=tuple(int(t) for t in d.get("thresholds", DEFAULT_THRESHOLDS)),
            source=str(d.get("source", "")),
        )


_TABLE4 = "paper Table 4, ShareGPT columns"
#: Named targets. ``ours`` (the shipped predictor's calibration) is read from its artifact by
#: the server side (``srt/sp_length_oracle.resolve_oracle_quality``), not kept here.
PRESETS: Dict[str, OracleQuality] = {
    "perfect": OracleQuality(
        "perfect", (1.0,) * 5, (1.0,) * 5, source="the true bucket, no degradation"
    ),
    # Llama-3.3-70B-Instruct, ShareGPT (the workload the oracle replays)
    "paper-l70": OracleQuality(
        "paper-l70",
        (0.790, 0.786, 0.812, 0.835, 0.852),
        (0.534, 0.552, 0.581, 0.640, 0.676),
        source=f"{_TABLE4}, L70 (Llama-3.3-70B-Instruct)",
    ),
    # Qwen3-32B, ShareGPT
    "paper-q32": OracleQuality(
        "paper-q32",
        (0.761, 0.784, 0.826, 0.870, 0.857),
        (0.539, 0.588, 0.658, 0.690, 0.628),
        source=f"{_TABLE4}, Q32 (Qwen3-32B)",
    ),
}
PRESET_NAMES = ("ours",) + tuple(PRESETS)


def parse_oracle_spec(text: str, ours: Optional[OracleQuality] = None) -> OracleQuality:
    """``--spexis-benchmark-length-oracle``'s value: a preset name (``ours``, ``perfect``,
    ``paper-l70``, ``paper-q32``), ``P/R`` (the same at every threshold) or five ``P/R``
    pairs separated by commas (thresholds 4, 8, 16, 32, 64). ``ours`` needs ``ours``."""
    spec = str(text).strip()
    if spec == "ours":
        if ours is None:
            raise OracleSpecError("the 'ours' preset needs the shipped predictor's calibration")
        return ours
    if spec in PRESETS:
        return PRESETS[spec]
    pairs = [p.strip() for p in spec.split(",")]
    k = len(DEFAULT_THRESHOLDS)
    if len(pairs) not in (1, k):
        raise OracleSpecError(
            f"expected a preset ({', '.join(PRESET_NAMES)}), P/R, or {k} comma-separated P/R "
            f"pairs, got {text!r}"
        )
    precision, recall = [], []
    for pair in pairs:
        try:
            p, r = (float(x) for x in pair.split("/"))
        except ValueError:
            raise OracleSpecError(
                f"expected a preset ({', '.join(PRESET_NAMES)}) or PRECISION/RECALL pairs "
                f"such as 0.8/0.5, got {text!r}"
            ) from None
        precision.append(p)
        recall.append(r)
    if len(pairs) == 1:
        precision, recall = precision * k, recall * k
    return OracleQuality(spec, tuple(precision), tuple(recall), source="given on the command line")


def false_positive_rate(
    precision: Sequence[float], recall: Sequence[float], base_rate: Sequence[float]
) -> np.ndarray:
    """``F_k``: the share of negative rows to predict so that precision is ``P_k`` when
    recall is ``R_k`` and ``pi_k`` of the rows are positive (capped to [0, 1]; 0 where there
    are no positives or no negatives)."""
    p = np.asarray(precision, dtype=np.float64)
    r = np.asarray(recall, dtype=np.float64)
    pi = np.asarray(base_rate, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        f = r * pi * (1.0 - p) / (p * (1.0 - pi))
    f = np.where((pi > 0.0) & (pi < 1.0), f, 0.0)
    return np.clip(f, 0.0, 1.0)


def degraded_predictions(
    remaining: np.ndarray,
    u: np.ndarray,
    thresholds: Sequence[int],
    recall: Sequence[float],
    fpr: Sequence[float],
) -> np.ndarray:
    """Bool ``[rows, K]``: threshold ``k`` predicted for each row (module docstring)."""
    rem = np.asarray(remaining, dtype=np.int64)[:, None]
    positive = rem < np.asarray(thresholds, dtype=np.int64)[None, :]
    rate = np.where(positive, np.asarray(recall)[None, :], np.asarray(fpr)[None, :])
    return np.asarray(u, dtype=np.float64)[:, None] < rate


def buckets_of(predicted: np.ndarray) -> np.ndarray:
    """Int64 ``[rows]``: the smallest threshold index predicted, -1 where none is (the
    predictor's convention)."""
    hit = np.asarray(predicted, dtype=bool)
    first = np.argmax(hit, axis=1)
    return np.where(hit.any(axis=1), first, -1).astype(np.int64)


def base_rate_counts(remaining: int, thresholds: Sequence[int]) -> np.ndarray:
    """Positive rows per threshold among the rows a request with ``remaining`` tokens to go
    still has (one per position, remaining ``remaining, ..., 1``): ``min(remaining, t - 1)``."""
    t = np.asarray(thresholds, dtype=np.int64)
    return np.minimum(max(0, int(remaining)), t - 1)
