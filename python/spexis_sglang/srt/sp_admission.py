"""Look-ahead admission on stage 0 (``--spexis-lookahead-admission``): how many waiting requests
the KV projection allows this iteration, lowered by Algorithm 1 and the gain G; the later
stages take stage 0's count from the relayed plan.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Optional

from spexis_sglang.srt.protocol import SpexisPlan
from spexis_sglang.srt.sp_records import max_new_left

if TYPE_CHECKING:
    from spexis_sglang.srt.sp_scheduler import SpexisScheduler

logger = logging.getLogger(__name__)


class SPAdmissionMixin:
    """Look-ahead admission's count per iteration. (A mixin of
    :class:`~.sp_scheduler.SpexisScheduler`.)"""

    def _sp_make_admission_gate(self: SpexisScheduler):
        """Stage 0's look-ahead admission (``--spexis-lookahead-admission``), else None."""
        cfg = self.spexis_config
        if not (cfg.lookahead_admission and self.sp.rank0):
            return None
        from spexis_sglang.core.lookahead import DEFAULT_THRESHOLDS
        from spexis_sglang.models.artifact import read_artifact_config
        from spexis_sglang.srt.admission_gate import AdmissionGate

        if cfg.length_oracle is not None:  # benchmark only: the oracle's stated precision
            extra = cfg.length_oracle
        else:
            extra = read_artifact_config(cfg.length_predictor).extra
        thresholds = extra.get("thresholds", DEFAULT_THRESHOLDS)
        gate = AdmissionGate(
            num_stages=self.ps.pp_size,
            capacity=self.max_total_num_tokens,
            thresholds=thresholds,
            # the precision each cutoff reached on validation (what the look-ahead trusts)
            precision=extra.get("precision") or [0.0] * len(thresholds),
            pdr=cfg.admission_pdr,
        )
        logger.info(
            "Spexis look-ahead admission: KV capacity %d tokens, %d stages, pdr %.2f, "
            "predictor precision %s",
            gate.capacity,
            gate.num_stages,
            gate.pdr,
            [round(p, 3) for p in gate.precision],
        )
        return gate

    def sp_admission_cap(self: SpexisScheduler, plan_in: Optional[SpexisPlan]) -> Optional[int]:
        """How many waiting requests may be admitted this iteration (None = SGLang decides).

        Stage 0 asks the look-ahead gate: the KV projection's count (which replaces SGLang's
        reservation, so it may exceed what SGLang would admit), lowered by Algorithm 1 and
        ``G`` when an eviction looms. The later stages take stage 0's answer from the plan
        (their queues and memory mirror stage 0's, so the same requests are admitted)."""
        sp = self.sp
        if not sp.rank0:
            return plan_in.admit_cap if plan_in is not None else None
        gate = sp.admission_gate
        if gate is None or not self.waiting_queue or self.chunked_req is not None:
            return None
        if not sp.running.reqs:
            return None
        st = sp.stats
        queue = self.waiting_queue
        free = self.token_to_kv_pool_allocator.available_size() + self.tree_cache.evictable_size()
        page = self.token_to_kv_pool_allocator.page_size
        if not gate.head_fits(free, queue[0].seqlen, page):
            st.admission_gated_iterations += 1
            sp.admit_reservation = 0  # SGLang's count too (the head's prefill does not fit)
            return 0
        slots = self._sp_running_slots()
        lengths = sp.slots.kv_len(slots).tolist()
        buckets = sp.length_bucket[slots].tolist()
        # tokens each waiting request prefills (a retracted one: its output too)
        waiting = [r.seqlen for r in queue]
        ratio = self.new_token_ratio_tracker
        n_proj, n_sglang = gate.reservation_count(
            free=free,
            held=lengths,
            remaining=[max_new_left(r) for r in sp.running.reqs],
            buckets=buckets,
            ratio=ratio.current,
            waiting_tokens=waiting,
            waiting_max_new=[max_new_left(r) for r in queue],
            page=page,
            growth_ratio=ratio.init,
        )
        n = n_proj
        if n > 0:  # Algorithm 1 and G may lower what the pool allows
            theta = gate.theta(st.accepted, st.rejected, st.drafts_dropped)
            n = min(n, gate.admit_count(lengths, buckets, waiting, theta))
        if n < len(waiting):
            st.admission_gated_iterations += 1
        delayed = sp.admissions_delayed
        for req in queue[n:n_sglang]:
            if req.rid not in delayed:
                delayed.add(req.rid)
                st.admissions_delayed += 1
        sp.admit_reservation = n_sglang
        return n
