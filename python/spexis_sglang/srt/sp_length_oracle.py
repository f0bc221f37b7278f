"""Benchmark-only length oracle in the server (``--spexis-benchmark-length-oracle``).

Stage 0's scheduler asks :class:`LengthOracle` for the remaining-length bucket of every decode
row it launched, in place of the predictor's (``sp_apply_drafts``); look-ahead admission then
reads them as it reads the predictor's, with the oracle's stated precision. Only stage 0 reads
buckets (the admission decision travels in the plan), so no other rank needs the oracle; the
draws are still a hash of (seed, request id, position), so a rerun of the same workload gets
the same predictions whatever slot or batch a row lands in.

The truth is known only for a request that runs to a length fixed in advance: ``ignore_eos``
with no stop strings, regexes or grammar (then it ends at ``max_new_tokens`` or the context
length). Any other request gets no prediction (bucket -1), as the predictor's "no ending in
sight". The degradation is ``core/length_oracle.py``'s; the base rate it needs is the share of
rows below each threshold over the requests admitted so far (per position, as Table 4 counts).

Benchmark only: refused unless ``--load-format dummy`` (launch_server), labelled in the
startup log, the periodic log line, ``/server_info`` (``spexis_benchmark_length_oracle``) and
the ``spexis:benchmark_mode`` metric.
"""

from __future__ import annotations

import json
import os
import zlib
from typing import Any, Optional

import numpy as np

from spexis_sglang.core.length_oracle import (
    OracleQuality,
    base_rate_counts,
    buckets_of,
    degraded_predictions,
    false_positive_rate,
    parse_oracle_spec,
)
from spexis_sglang.core.row_hash import uniform64
from spexis_sglang.core.slot_state import Rows

__all__ = [
    "LENGTH_ORACLE_LABEL",
    "LengthOracle",
    "oracle_eligible",
    "resolve_oracle_quality",
    "shipped_predictor_quality",
]

#: the key of the oracle's state in /server_info's internal_states[0], and the mode's name
LENGTH_ORACLE_LABEL = "spexis_benchmark_length_oracle"
#: the shipped predictor whose calibration is the ``ours`` preset
SHIPPED_PREDICTOR = os.path.join("smollm2-135m-instruct", "length")
#: hash stream of the oracle, apart from forced acceptance's (same seed, same request id)
_STREAM = 0x4C454E


def shipped_predictor_quality() -> OracleQuality:
    """``ours``: the precision and recall the shipped predictor's cutoffs reached on the
    validation split (its artifact's ``extra.precision`` / ``extra.recall``)."""
    from spexis_sglang.srt.bundled import ARTIFACTS_DIR

    path = os.path.join(ARTIFACTS_DIR, SHIPPED_PREDICTOR, "config.json")
    with open(path) as f:
        extra = json.load(f)["extra"]
    return OracleQuality(
        "ours",
        tuple(float(p) for p in extra["precision"]),
        tuple(float(r) for r in extra["recall"]),
        tuple(int(t) for t in extra["thresholds"]),
        source=f"the shipped predictor's validation calibration ({SHIPPED_PREDICTOR})",
    )


def resolve_oracle_quality(spec: str) -> OracleQuality:
    """The flag's value as targets (raises ``OracleSpecError``)."""
    ours = shipped_predictor_quality() if str(spec).strip() == "ours" else None
    return parse_oracle_spec(spec, ours)


def oracle_eligible(req: Any) -> bool:
    """The request's length is fixed in advance: it ignores EOS, has ``max_new_tokens`` and
    nothing else that could end it early (stop strings or regexes, a grammar)."""
    sp = req.sampling_params
    return bool(
        sp.ignore_eos
        and sp.max_new_tokens is not None
        and not sp.stop_strs
        and not getattr(sp, "stop_regex_strs", None)
        and getattr(req, "grammar", None) is None
    )


class LengthOracle:
    """Per-slot truth and hash base; buckets for a batch of rows (module docstring)."""

    def __init__(self, capacity: int, seed: int, quality: OracleQuality) -> None:
        self.quality = quality
        self.seed = seed
        self.thresholds = np.asarray(quality.thresholds, dtype=np.int64)
        k = self.thresholds.shape[0]
        #: position + 1 at which the request's last token is produced (-1: no prediction)
        self._end = np.full(capacity, -1, dtype=np.int64)
        self._base = np.zeros(capacity, dtype=np.uint64)
        # base rate: positive rows per threshold / rows, over the requests admitted so far
        self._positive_rows = np.zeros(k, dtype=np.int64)
        self._rows = 0
        # what the oracle predicted, against the truth (per threshold, over every row asked)
        self.true_pos = np.zeros(k, dtype=np.int64)
        self.false_pos = np.zeros(k, dtype=np.int64)
        self.false_neg = np.zeros(k, dtype=np.int64)
        self.rows_asked = 0
        self.rows_unpredictable = 0
        #: rows that produce a request's last token (at least one per request that ends), and
        #: rows past it (none: SP launches no row beyond a request's length)
        self.rows_at_last_token = 0
        self.rows_past_end = 0
        # admissions to SP decoding (a retracted request counts again when it resumes)
        self.admissions_predicted = 0
        self.admissions_unpredictable = 0

    def admit(self, slot: int, req: Any, verified_len: int, limit: int) -> None:
        """A request starts (or resumes) decoding in ``slot`` with ``verified_len`` tokens known
        and ends when it has ``limit`` (prompt + max_new_tokens, or the context length)."""
        if not oracle_eligible(req):
            self._end[slot] = -1
            self.admissions_unpredictable += 1
            return
        self._end[slot] = limit
        self._base[slot] = zlib.crc32(f"{self.seed}:{_STREAM}:{req.rid}".encode())
        self.admissions_predicted += 1
        # its rows from here on: the first at V - 1 has limit - V tokens to go, the last 1
        remaining = limit - verified_len
        self._positive_rows += base_rate_counts(remaining, self.thresholds)
        self._rows += max(0, remaining)

    @property
    def base_rate(self) -> np.ndarray:
        if self._rows == 0:
            return np.zeros(self.thresholds.shape[0])
        return self._positive_rows / self._rows

    @property
    def false_positive_rate(self) -> np.ndarray:
        q = self.quality
        return false_positive_rate(q.precision, q.recall, self.base_rate)

    def buckets(self, rows: Rows) -> np.ndarray:
        """Int64 ``[rows]``: each row's bucket (-1: none, or a request without a truth)."""
        end = self._end[rows.slot]
        known = end >= 0
        # the row at position p produces the token at p + 1; the last one is at end - 1
        raw = end - rows.position - 1
        # self-checks of that convention against the server's rows (/server_info)
        self.rows_at_last_token += int(np.count_nonzero(known & (raw == 1)))
        self.rows_past_end += int(np.count_nonzero(known & (raw < 1)))
        remaining = np.maximum(raw, 1)
        u = uniform64(
            self._base[rows.slot], rows.position.astype(np.uint64), np.zeros(len(rows), np.uint64)
        )
        predicted = degraded_predictions(
            remaining, u, self.thresholds, self.quality.recall, self.false_positive_rate
        )
        predicted &= known[:, None]
        self._count(remaining[known], predicted[known])
        self.rows_unpredictable += int(np.count_nonzero(~known))
        return buckets_of(predicted)

    def _count(self, remaining: np.ndarray, predicted: np.ndarray) -> None:
        positive = remaining[:, None] < self.thresholds[None, :]
        self.rows_asked += int(remaining.shape[0])
        self.true_pos += np.count_nonzero(predicted & positive, axis=0)
        self.false_pos += np.count_nonzero(predicted & ~positive, axis=0)
        self.false_neg += np.count_nonzero(~predicted & positive, axis=0)

    def measured(self) -> dict:
        """Precision and recall per threshold over the rows asked so far (None: undefined)."""
        tp, fp, fn = self.true_pos, self.false_pos, self.false_neg

        def ratio(a: np.ndarray, b: np.ndarray) -> list:
            return [None if d == 0 else round(float(n) / float(d), 4) for n, d in zip(a, b)]

        return {"precision": ratio(tp, tp + fp), "recall": ratio(tp, tp + fn)}

    def as_dict(self) -> dict:
        """``/server_info``'s ``spexis_benchmark_length_oracle``: targets, the rates in force,
        and what was reached on the rows asked."""
        measured = self.measured()
        return {
            "benchmark_only": True,
            "preset": self.quality.name,
            "source": self.quality.source,
            "thresholds": self.thresholds.tolist(),
            "target_precision": list(self.quality.precision),
            "target_recall": list(self.quality.recall),
            "base_rate": [round(float(x), 4) for x in self.base_rate],
            "false_positive_rate": [round(float(x), 5) for x in self.false_positive_rate],
            "measured_precision": measured["precision"],
            "measured_recall": measured["recall"],
            "rows_asked": self.rows_asked,
            "rows_unpredictable": self.rows_unpredictable,
            "rows_at_last_token": self.rows_at_last_token,
            "rows_past_end": self.rows_past_end,
            "admissions_predicted": self.admissions_predicted,
            "admissions_unpredictable": self.admissions_unpredictable,
        }

    def log_line(self) -> str:
        q = self.quality
        return (
            f"Spexis BENCHMARK MODE: remaining-length predictions come from a length oracle "
            f"('{q.name}': {q.source}), the true remaining length degraded to precision "
            f"{list(q.precision)} and recall {list(q.recall)} at thresholds "
            f"{self.thresholds.tolist()}; only requests with ignore_eos (and no stop strings or "
            f"grammar) get predictions; labelled '{LENGTH_ORACLE_LABEL}' in /server_info"
        )


def make_length_oracle(
    config_quality: Optional[dict], capacity: int, seed: int
) -> Optional[LengthOracle]:
    """The oracle ``SpexisConfig.length_oracle`` asks for (None: off)."""
    if config_quality is None:
        return None
    return LengthOracle(capacity, seed, OracleQuality.from_dict(config_quality))
