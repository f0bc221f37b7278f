"""Spexis scheduling core: pure Python + numpy, no torch, no SGLang (docs/design.md §1).

What the scheduler decides, and nothing about how SGLang is made to do it:

* :mod:`.cost_model` — Eq. 1-4 and Table 1: effective batch of speculative parallelism,
  selective speculation, throughput estimates over profiled latency tables.
* :mod:`.planner` — the PP x TP x SP x alpha planner over a profile JSON
  (``python -m spexis_sglang.plan``).
* :mod:`.lookahead` — Algorithm 1 as an exact, vectorised expectation.
* :mod:`.admission` — the gain ``G`` of delaying an admission and the admission policy.
* :mod:`.selection` — which drafts to speculate on (drop the lowest ``alpha``) and the
  alpha chooser.
* :mod:`.online_alpha` — the chooser's inputs measured while serving, alpha re-chosen
  every few iterations (``--spexis-alpha auto``).
* :mod:`.slot_state` — per-request epoch bookkeeping of speculative rows, in numpy arrays by
  request slot, a batch per call (the scheduler's hot path).
* :mod:`.sp_state` — the same bookkeeping one request at a time: ``slot_state``'s test oracle,
  never imported by the server (``import spexis_sglang.core.sp_state``).
* :mod:`.simulation` — brute-force simulations that check all of the above (tests only).
* :mod:`.length_oracle` — benchmark only: remaining-length buckets from the true length,
  degraded to a stated precision / recall per threshold (``--spexis-benchmark-length-oracle``).
* :mod:`.row_hash` — the per-row uniform draws of the benchmark-only modes.
* :mod:`.pipeline_sim` — a discrete-event simulator of SGLang's pipeline loop (stock PP, SP,
  TP) over per-stage costs (:mod:`.stage_costs`) and its event kernel (:mod:`.des`); the
  planner's ``--model/--system`` mode (``spexis_sglang.planning``) ranks with it.
"""

from .admission import (
    AdmissionDecision,
    AdmissionPlan,
    AdmissionPlanner,
    EvictionForecast,
    gain,
)
from .cost_model import (
    LatencyTable,
    b_alpha_star,
    b_eff_alpha_star,
    b_eff_star,
    lookahead_theta,
    simulate_eq1,
    simulate_eq3,
    sp_alpha_exact,
    sp_alpha_paper,
    throughput_pp,
    throughput_sp,
    throughput_sp_alpha,
    throughput_tp,
)
from .lookahead import DEFAULT_THRESHOLDS, NO_BUCKET, LookaheadModel
from .online_alpha import OnlineAlpha
from .planner import (
    PlanRow,
    Profile,
    ProfileError,
    format_table,
    load_profile,
    parse_profile,
    rank_configurations,
)
from .selection import (
    AlphaChoice,
    RankAcceptanceProfile,
    choose_alpha,
    keep_mask,
    num_dropped,
    select_drops,
)
from .slot_state import Results, Rows, SlotState, SlotStateError, SlotStatus, Verdict
from .sp_outcome import Outcome, SPProtocolError
from .sp_stats import SPStats

__all__ = [
    "AdmissionDecision",
    "AdmissionPlan",
    "AdmissionPlanner",
    "AlphaChoice",
    "DEFAULT_THRESHOLDS",
    "EvictionForecast",
    "LatencyTable",
    "LookaheadModel",
    "NO_BUCKET",
    "OnlineAlpha",
    "Outcome",
    "PlanRow",
    "Profile",
    "ProfileError",
    "RankAcceptanceProfile",
    "Results",
    "Rows",
    "SPProtocolError",
    "SPStats",
    "SlotState",
    "SlotStateError",
    "SlotStatus",
    "Verdict",
    "b_alpha_star",
    "b_eff_alpha_star",
    "b_eff_star",
    "choose_alpha",
    "format_table",
    "gain",
    "keep_mask",
    "load_profile",
    "lookahead_theta",
    "num_dropped",
    "parse_profile",
    "rank_configurations",
    "select_drops",
    "simulate_eq1",
    "simulate_eq3",
    "sp_alpha_exact",
    "sp_alpha_paper",
    "throughput_pp",
    "throughput_sp",
    "throughput_sp_alpha",
    "throughput_tp",
]
