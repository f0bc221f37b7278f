"""The SP loop's counters: one set, one meaning each (docs/metrics.md).

:class:`SPStats` is the only place a Spexis counter is kept. The SP state
(:class:`~.sp_state.SPState`, :class:`~.slot_state.SlotState`) counts the rows it launches, the
verdicts it gives and the drafts it does not launch into it; the scheduler counts the rest
(iterations, admissions, retractions, forwards, alpha) into the same object. ``/server_info``
(``internal_states[i]["spexis"]``, through :meth:`SPStats.as_dict`) and the ``spexis:*``
Prometheus series both read this object, so the two can never disagree.

Every field is a cumulative count since the server started, except the gauges
(:meth:`SPStats.gauge_names`): levels in force, whose difference means nothing.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Dict, Tuple

__all__ = ["SPStats"]


def _gauge(default: float = 0.0) -> Any:
    """A field that is a level in force, not a count."""
    return field(default=default, metadata={"gauge": True})


@dataclass
class SPStats:
    """The Spexis counters of one scheduler (see the module docstring)."""

    # -- iterations (the scheduler) ---------------------------------------------------------
    #: batches launched (prefill and decode)
    iterations: int = 0
    #: batches of SP rows launched (decode batches, and rows riding along a prefill chunk)
    decode_iterations: int = 0
    #: prefill chunks SP rows rode along (``--enable-mixed-chunk``; a subset of both counts)
    mixed_iterations: int = 0

    # -- rows and verdicts (the SP state) ---------------------------------------------------
    #: decode rows launched on a verified input token
    rows_normal: int = 0
    #: decode rows launched on a draft (speculative rows)
    rows_spec: int = 0
    #: speculative rows the device ran as the normal row a rejection asked for, because the
    #: verdict arrived before they ran (a subset of ``rows_spec``)
    rows_redone: int = 0
    #: rows whose result was discarded: built on a rejected draft, or of a released request
    rows_stale: int = 0
    #: verified drafts the target agreed with
    accepted: int = 0
    #: verified drafts the target disagreed with (each makes the rows built on it stale)
    rejected: int = 0
    #: tokens committed by decode rows (every row that was not stale)
    tokens_committed: int = 0
    #: drafts selective speculation declined (the ⌊αB⌋ least confident per iteration)
    drafts_dropped: int = 0
    #: drafts not launched for another reason: past the request's length limit, or no KV
    #: memory for the speculative row
    drafts_withheld: int = 0
    #: stage 0's decode forwards that made no drafts (the draft head's LM head skipped): alpha
    #: 1 iterations whose drafts no row would run on unverified and nothing would learn from
    drafts_unmade_forwards: int = 0
    #: rows built on a draft that was never made, verified against its placeholder (the
    #: device ran them on the true token): counted in neither ``accepted`` nor ``rejected``
    unmade_drafts_verified: int = 0

    # -- admission and memory (the scheduler) -----------------------------------------------
    #: look-ahead admission: requests held back at least once that SGLang's reservation would
    #: have admitted (each counted once)
    admissions_delayed: int = 0
    #: look-ahead admission: iterations that held some waiting requests back
    admission_gated_iterations: int = 0
    #: look-ahead admission: requests admitted while SGLang's reservation would still have
    #: held them back
    admissions_early: int = 0
    #: requests retracted because the verified rows did not fit the KV pool
    retractions: int = 0
    #: SGLang's admission reservation ratio in force (decayed and reset as stock does)
    new_token_ratio: float = _gauge()
    #: decode rows the length predictor said end within 64 tokens
    rows_predicted_ending: int = 0
    #: requests decoding under SP when the latest decode batch was built (a benchmark reads
    #: its steady state as the span where every request it sent is still running)
    running_requests: int = _gauge(0)

    # -- forwards (the scheduler) -----------------------------------------------------------
    #: this rank's decode forwards replayed from a captured CUDA graph
    decode_graph_replays: int = 0
    #: this rank's decode forwards run eagerly (every CPU forward; on a GPU a batch above
    #: ``--cuda-graph-max-bs``)
    decode_eager_forwards: int = 0
    #: this rank's forwards of SP rows riding along a prefill chunk (always eager)
    mixed_forwards: int = 0
    #: stage 0's draft passes replayed from a CUDA graph (on a GPU; the rest ran eagerly)
    draft_pass_replays: int = 0

    # -- selective speculation on stage 0 (the alpha controller) ----------------------------
    #: the drop ratio in force (fixed, or the latest online choice under ``--spexis-alpha auto``)
    alpha: float = _gauge()
    #: how often the online choice changed alpha
    alpha_changes: int = 0
    #: iterations run at alpha 0 to explore the ranks alpha drops
    alpha_explore_iterations: int = 0
    #: iterations run at alpha 1 while alpha is 0, to time B/N rows
    alpha_probe_iterations: int = 0

    # -- derived ----------------------------------------------------------------------------
    @property
    def appended(self) -> int:
        """Committed tokens no launched row was built on (no draft to verify)."""
        return self.tokens_committed - self.accepted - self.rejected

    @property
    def rows(self) -> int:
        """Decode rows launched."""
        return self.rows_normal + self.rows_spec

    @property
    def acceptance_rate(self) -> float:
        """Accepted over verified drafts."""
        n = self.accepted + self.rejected
        return self.accepted / n if n else 0.0

    @property
    def effective_batch_ratio(self) -> float:
        """Committed tokens per launched decode row (1.0: no row wasted)."""
        return self.tokens_committed / self.rows if self.rows else 0.0

    @property
    def avg_rows_per_decode_iteration(self) -> float:
        return self.rows / self.decode_iterations if self.decode_iterations else 0.0

    @property
    def avg_tokens_per_decode_iteration(self) -> float:
        """Committed tokens per decode iteration: the paper's effective batch B_eff."""
        n = self.decode_iterations
        return self.tokens_committed / n if n else 0.0

    # -- export -----------------------------------------------------------------------------
    @classmethod
    def gauge_names(cls) -> Tuple[str, ...]:
        """Fields that are levels, not counts."""
        return tuple(f.name for f in dataclasses.fields(cls) if f.metadata.get("gauge"))

    @classmethod
    def counter_names(cls) -> Tuple[str, ...]:
        """Fields that only grow: the difference of two snapshots is what happened between."""
        return tuple(f.name for f in dataclasses.fields(cls) if not f.metadata.get("gauge"))

    def counters(self) -> Dict[str, int]:
        return {name: getattr(self, name) for name in self.counter_names()}

    def as_dict(self) -> Dict[str, float]:
        """Every field and the derived ratios, flat (``/server_info``'s ``spexis``)."""
        d: Dict[str, float] = dataclasses.asdict(self)
        d["acceptance_rate"] = self.acceptance_rate
        d["effective_batch_ratio"] = self.effective_batch_ratio
        d["avg_rows_per_decode_iteration"] = self.avg_rows_per_decode_iteration
        d["avg_tokens_per_decode_iteration"] = self.avg_tokens_per_decode_iteration
        return d
