"""Speculative parallelism inside SGLang 0.5.17's pipeline-parallel event loop.

``SpexisScheduler`` subclasses SGLang's ``Scheduler``. With a draft head configured and
``--pp-size >= 2`` it replaces ``event_loop_pp`` with :meth:`SpexisScheduler.event_loop_sp`;
otherwise it is plain SGLang.

How an iteration differs from stock PP (design.md §2)
------------------------------------------------------
Stock PP splits the running requests into N micro-batches, so a request advances one token
every N iterations. Here every running request may ride every iteration: when a request's
newest row has just been launched, stage 0's draft head has already produced a draft for the
next position, and the request's next row is a *speculative* row on that draft. The row's
true token comes back from the last stage N iterations later, and
:class:`spexis_sglang.core.sp_state.SPState` (epochs, not flags) decides whether the rows built
on the draft stand or are stale.

Every PP rank runs this scheduler on mirrored state and builds the same batches:

* requests arrive through SGLang's own relay (stage k forwards what stage k-1 received);
* prefill admission is SGLang's own (mirrored allocator and radix cache);
* the decode rows come from ``SPState.next_row``: which rows exist depends only on what was
  launched and verified, never on a draft's value, so later stages launch speculative rows
  with a placeholder token (only stage 0 embeds input tokens);
* the draft each row produced travels down the pipe as extra keys of the proxy dict and comes
  back with the true token in the output dict, so every rank verifies identically;
* rank-0-only decisions (the selective-speculation drops, and with look-ahead admission how
  many waiting requests to admit) travel in a :class:`SpexisPlan` appended to the request
  relay, which stage 0 therefore sends after it has scheduled.

KV (design.md §4): a row at position p writes the request's own slot for p; a rejected row's
slot is overwritten when the request re-executes p. Only verified tokens reach ``output_ids``
and the radix cache (``kv_committed_len`` = last valid row's position + 1). A finished request
keeps its slots until its in-flight rows have drained (``SPState.pop_drained``).
"""

from __future__ import annotations

import logging
import os
import time
import zlib
from dataclasses import dataclass, field
from typing import Dict, List, NamedTuple, Optional, Tuple

import torch
from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
from sglang.srt.managers.scheduler import Scheduler
from sglang.srt.mem_cache.common import evict_from_tree_cache, release_kv_cache
from sglang.srt.model_executor.forward_batch_info import ForwardMode, PPProxyTensors
from sglang.srt.runtime_context import get_observability, get_parallel
from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo
from sglang.srt.utils import DynamicGradMode

from spexis_sglang.core.selection import select_drops
from spexis_sglang.core.sp_state import Outcome, RowPlan, SPState
from spexis_sglang.srt import sp_grammar
from spexis_sglang.srt.config import SpexisConfig, get_config
from spexis_sglang.srt.draft_model import PROXY_LENGTH_BUCKET
from spexis_sglang.srt.input_validation import request_input_error
from spexis_sglang.srt.sp_logprobs import DecodeLogprobs, set_decode_logprob_fields
from spexis_sglang.srt.sp_penalties import needs_penalizer, row_output_prefix, set_penalizer_state
from spexis_sglang.srt.stats import (
    SP_PHASES,
    PhaseTimer,
    StockPPPhaseTimers,
    phase_timers_enabled,
)

logger = logging.getLogger(__name__)

DRAFT_IDS_KEY = "spexis_draft_ids"
DRAFT_CONF_KEY = "spexis_draft_conf"
_PLACEHOLDER_TOKEN = 0
# meta_info key carried by every token produced in the benchmark-only forced-acceptance mode
FORCED_LABEL = "spexis_benchmark_forced_acceptance"
# sampling_params.custom_params key: a request's own forced acceptance (benchmark mode only), so
# one server sweeps several values of theta without a restart.
FORCE_ACCEPT_PARAM = "spexis_force_accept"


_MASK64 = (1 << 64) - 1


def _needs_slot(req: Req, row: RowPlan) -> bool:
    """The row writes past the request's allocated KV: it needs a new slot."""
    return row.position >= req.kv.kv_allocated_len


def _slots_needed(plans: List[Tuple[Req, RowPlan]]) -> int:
    return sum(1 for req, row in plans if _needs_slot(req, row))


def _uniform64(base: int, position: int, epoch: int) -> float:
    """A uniform number in [0, 1) from three integers (splitmix64's finaliser)."""
    x = base * 0x9E3779B97F4A7C15 + position * 0xBF58476D1CE4E5B9 + epoch * 0x94D049BB133111EB
    x &= _MASK64
    x ^= x >> 30
    x = (x * 0xBF58476D1CE4E5B9) & _MASK64
    x ^= x >> 27
    x = (x * 0x94D049BB133111EB) & _MASK64
    x ^= x >> 31
    return x / 18446744073709551616.0


@dataclass
class SpexisPlan:
    """Stage 0's decisions for one iteration, relayed to the later stages with the requests."""

    iteration: int
    dropped: List[str] = field(default_factory=list)
    #: look-ahead admission: admit at most this many waiting requests now (None = no limit)
    admit_cap: Optional[int] = None


class _PendingDrafts(NamedTuple):
    """Drafts of one launched decode batch, read when the next batch is built."""

    rows: List["SpexisRow"]
    ids: Optional[torch.Tensor]  # host tensor (None on later stages: placeholders)
    conf: Optional[torch.Tensor]
    event: Optional[object] = None  # the device-to-host copy's completion
    device_tensors: tuple = ()  # keeps the copy's sources alive until it is read
    length_buckets: Optional[torch.Tensor] = None  # stage 0, with a length predictor


@dataclass
class SpexisRow:
    req: Req
    position: int
    epoch: int
    is_spec: bool


@dataclass
class SpexisStats:
    """Counters behind the metrics (acceptance, effective batch, row kinds)."""

    iterations: int = 0
    decode_iterations: int = 0
    rows_normal: int = 0
    rows_spec: int = 0
    rows_stale: int = 0
    tokens_committed: int = 0
    accepted: int = 0
    rejected: int = 0
    drafts_dropped: int = 0
    # look-ahead admission: requests delayed at least once, iterations that held some back
    admissions_delayed: int = 0
    admission_gated_iterations: int = 0
    # decode rows the length predictor said end within 64 tokens (bucket >= 0)
    rows_predicted_ending: int = 0
    # this rank's decode forwards: replayed from a captured CUDA graph, or run eagerly (every
    # CPU forward; on a GPU a batch above --cuda-graph-max-bs): shows a benchmark used graphs
    decode_graph_replays: int = 0
    decode_eager_forwards: int = 0
    # This rank's event loop by phase (seconds, cumulative), wall (time_*_s: where an iteration
    # goes, waits included) and thread CPU (cpu_*_s: what the loop itself costs); exported flat
    phases: PhaseTimer = field(default_factory=lambda: PhaseTimer(SP_PHASES), repr=False)

    @property
    def acceptance_rate(self) -> float:
        n = self.accepted + self.rejected
        return self.accepted / n if n else 0.0

    @property
    def rows(self) -> int:
        return self.rows_normal + self.rows_spec

    @property
    def effective_batch_ratio(self) -> float:
        """Committed tokens per launched decode row (1.0 = no row wasted)."""
        return self.tokens_committed / self.rows if self.rows else 0.0

    def as_dict(self) -> Dict[str, float]:
        d = {k: getattr(self, k) for k in self.__dataclass_fields__ if k != "phases"}
        d.update(self.phases.as_dict())
        d["acceptance_rate"] = self.acceptance_rate
        d["effective_batch_ratio"] = self.effective_batch_ratio
        d["avg_rows_per_decode_iteration"] = (
            self.rows / self.decode_iterations if self.decode_iterations else 0.0
        )
        d["avg_tokens_per_decode_iteration"] = (
            self.tokens_committed / self.decode_iterations if self.decode_iterations else 0.0
        )
        return d


class SpexisScheduler(Scheduler):
    """SGLang's scheduler with speculative parallelism on PP ranks (see the module docstring)."""

    def __init__(self, *args, **kwargs):
        self.spexis_config: SpexisConfig = get_config()
        super().__init__(*args, **kwargs)

    # ------------------------------------------------------------------ set-up
    @property
    def sp_enabled(self) -> bool:
        return self.spexis_config.enabled and self.ps.pp_size > 1

    def init_tp_model_worker(self):
        if not self.spexis_config.enabled:
            return super().init_tp_model_worker()
        from spexis_sglang.srt.draft_model import spexis_tp_worker_class

        self.tp_worker = spexis_tp_worker_class()(
            server_args=self.server_args,
            gpu_id=self.ps.gpu_id,
            ps=self.ps,
            nccl_port=self.nccl_port,
        )

    def get_num_allocatable_reqs(self, running_bs):
        if not self.sp_enabled:
            return super().get_num_allocatable_reqs(running_bs)
        # Under SP every running request is in every iteration: the cap is the server's,
        # not the per-micro-batch share stock PP uses.
        res = self.max_running_requests - running_bs
        cap = getattr(self, "sp_admit_cap", None)  # look-ahead admission's, this iteration
        if cap is not None:
            res = min(res, cap)
        return min(res, self.req_to_token_pool.available_size())

    def event_loop_pp(self):
        if not self.sp_enabled:
            if phase_timers_enabled():
                self.stock_pp_timers = StockPPPhaseTimers(self)
            return super().event_loop_pp()
        return self.event_loop_sp()

    def init_sp_state(self) -> None:
        self.init_pp_loop_state()
        if get_parallel().pp_async_batch_depth != 0:
            raise ValueError("Spexis needs --pp-async-batch-depth 0")
        self.sp = SPState()
        self.sp_stats = SpexisStats()
        self.sp_running_batch = ScheduleBatch(reqs=[], batch_is_full=False)
        # Stock abort handling scans running_mbs and mbs for in-flight requests.
        self.running_mbs = [self.sp_running_batch] * self.pp_loop_size
        self.sp_rank0 = self.pp_group.is_first_rank
        self.sp_iteration = 0
        self.sp_rng_seed = self.server_args.random_seed or 0
        self.sp_last_log = time.monotonic()
        self.sp_last_logged_iterations = 0
        # Removed requests whose KV is freed once their in-flight rows have drained.
        self.sp_finished_waiting_drain: Dict[str, Req] = {}
        self.sp_metrics = None
        if self.sp_rank0 and get_observability().enable_metrics:
            from spexis_sglang.srt.metrics import SpexisMetrics

            self.sp_metrics = SpexisMetrics(self.metrics_collector.labels)
        if self.spexis_config.force_accept is not None:
            logger.warning(
                "Spexis BENCHMARK MODE: verification accepts drafts with probability %.3f "
                "regardless of the model; outputs are not the model's and are labelled "
                "'%s' in their meta_info",
                self.spexis_config.force_accept,
                FORCED_LABEL,
            )
        self.sp_retracted_waiting_drain: Dict[str, Req] = {}
        # Drafts of launched decode batches not yet read (see sp_after_launch).
        self.sp_pending_drafts: List[_PendingDrafts] = []
        self.sp_sync_draft_read = os.environ.get("SPEXIS_SYNC_DRAFT_READ", "0") == "1"
        # Latest remaining-length bucket per running request (stage 0, with a predictor).
        self.sp_length_bucket: Dict[str, int] = {}
        self.sp_admit_cap: Optional[int] = None
        self.sp_admission_gate = self._sp_make_admission_gate()
        # constrained decoding: stage 0 masks the drafts with the rows' grammars (sp_grammar)
        self.sp_grammar_draft_mask = self.sp_rank0 and sp_grammar.draft_masking_enabled(
            self.spexis_config, self.server_args
        )

    def _sp_make_admission_gate(self):
        """Stage 0's look-ahead admission (``--spexis-lookahead-admission``), else None."""
        cfg = self.spexis_config
        if not (cfg.lookahead_admission and self.sp_rank0):
            return None
        from spexis_sglang.core.lookahead import DEFAULT_THRESHOLDS
        from spexis_sglang.models.artifact import read_artifact_config
        from spexis_sglang.srt.admission_gate import AdmissionGate

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

    # ------------------------------------------------------------------ event loop
    @DynamicGradMode()
    def event_loop_sp(self):
        """Stock ``event_loop_pp`` (same communication choreography), SP batches."""
        self.init_sp_state()
        timer = self.sp_stats.phases
        profiler = self._sp_maybe_profiler()
        while True:
            if profiler is not None:
                profiler.tick()
            server_is_idle = True
            for mb_id in range(self.pp_loop_size):
                timer.start()
                self.running_batch = self.sp_running_batch
                next_first_rank_mb_id = (mb_id + self.ps.pp_size) % self.pp_loop_size
                next_mb_id = (mb_id + 1) % self.pp_loop_size

                recv_reqs = self.request_receiver.recv_requests()
                plan_in = None
                if recv_reqs:
                    plans = [r for r in recv_reqs if isinstance(r, SpexisPlan)]
                    if plans:
                        plan_in = plans[-1]
                        recv_reqs = [r for r in recv_reqs if not isinstance(r, SpexisPlan)]
                self.process_input_requests(recv_reqs)

                cur_batch, plan_out = self.sp_get_next_batch(plan_in)
                self.mbs[mb_id] = cur_batch
                self.cur_batch_for_debug = cur_batch

                # Stage 0 relays the requests *after* scheduling, with its decisions.
                if not self.pp_group.is_last_rank:
                    self._pp_commit_comm_work(self.send_req_work)
                    self.send_req_work = self._pp_send_pyobj_to_next_stage(
                        list(recv_reqs or []) + [plan_out], async_send=True
                    )
                timer.mark("schedule")

                if cur_batch:
                    server_is_idle = False
                    pp_proxy_tensors = self._pp_recv_proxy_tensors()
                    if pp_proxy_tensors is not None:
                        cur_batch.spexis_extras = {
                            k: v
                            for k, v in pp_proxy_tensors.tensors.items()
                            if k.startswith("spexis_")
                        }
                self._pp_commit_comm_work(self.send_proxy_work)
                result = None
                if cur_batch:
                    result, self.launch_event = self._pp_launch_batch(
                        mb_id,
                        cur_batch,
                        pp_proxy_tensors,
                        self.mb_metadata,
                        self.last_rank_comm_queue,
                    )
                    self.sp_after_launch(cur_batch, result)
                # the proxy receive (later stages wait for the previous stage) + launch
                timer.mark("launch")

                next_pp_outputs, next_batch_result, d2h_event = (
                    self._pp_commit_send_output_work_and_preprocess_output_tensors(
                        next_first_rank_mb_id, next_mb_id
                    )
                )
                timer.mark("wait_output")
                if self.mbs[next_mb_id] is not None:
                    d2h_event.synchronize()
                    timer.mark("wait_output")
                    self.sp_process_result(self.mbs[next_mb_id], next_batch_result, next_pp_outputs)
                    self.last_mbs[next_mb_id] = self.mbs[next_mb_id]
                    timer.mark("process")

                if not self.pp_group.is_last_rank and cur_batch:
                    self.device_module.current_stream().wait_event(self.launch_event)
                    tensors = dict(result.pp_hidden_states_proxy_tensors.tensors)
                    tensors.pop(PROXY_LENGTH_BUCKET, None)  # stage 0's own
                    for k, v in getattr(cur_batch, "spexis_extras", {}).items():
                        tensors.setdefault(k, v)
                    self.send_proxy_work = self._pp_send_dict_to_next_stage(
                        tensors, async_send=True, msg_type="proxy"
                    )
                self.pp_outputs = next_pp_outputs
                self.sp_release_drained()
                self.sp_iteration += 1
                if cur_batch is not None or self.mbs[next_mb_id] is not None:
                    timer.mark("send")
                    timer.commit()
                else:
                    timer.discard()  # idle (drafts of finished requests only)

            if server_is_idle:
                self.on_idle()
            self.sp_maybe_log()

    def _sp_maybe_profiler(self):
        """``SPEXIS_PROFILE_LOOP=PREFIX``: cProfile this rank's loop (developer aid)."""
        prefix = os.environ.get("SPEXIS_PROFILE_LOOP")
        if not prefix:
            return None
        from spexis_sglang.srt.profiling import LoopProfiler

        return LoopProfiler(f"{prefix}.pp{self.ps.pp_rank}.tp{self.ps.tp_rank}.prof")

    def _pp_prepare_tensor_dict(self, result, batch):
        tensor_dict = super()._pp_prepare_tensor_dict(result, batch)
        # The last rank sends each row's draft back with its true token.
        for k, v in getattr(batch, "spexis_extras", {}).items():
            tensor_dict[k] = v
        return tensor_dict

    # ------------------------------------------------------------------ scheduling
    def sp_get_next_batch(
        self, plan_in: Optional[SpexisPlan]
    ) -> Tuple[Optional[ScheduleBatch], SpexisPlan]:
        plan_out = SpexisPlan(iteration=self.sp_iteration)
        self.process_pending_chunked_abort()
        self._abort_on_waiting_timeout()
        if self.chunked_req is not None:
            if self.chunked_req.extend_range.end > len(self.chunked_req.prefix_indices):
                self.stash_chunked_request(self.chunked_req)

        self.sp_running_batch.reqs = [r for r in self.sp_running_batch.reqs if r.rid in self.sp]
        self.sp_admit_cap = plan_out.admit_cap = self.sp_admission_cap(plan_in)
        if self.sp_admit_cap is not None:
            # the limit is decided afresh every iteration: a "full" batch it caused must not
            # outlive it (stock SGLang clears batch_is_full only when memory frees up)
            self.sp_running_batch.batch_is_full = False
        try:
            prefill = self.get_new_batch_prefill(self.sp_running_batch).batch_to_run
        finally:
            self.sp_admit_cap = None
        if prefill is not None:
            prefill.spexis_kind = "prefill"
            return prefill, plan_out
        batch = self.sp_build_decode_batch(plan_in, plan_out)
        return batch, plan_out

    def sp_admission_cap(self, plan_in: Optional[SpexisPlan]) -> Optional[int]:
        """How many waiting requests may be admitted this iteration (None = no limit).

        Stage 0 asks the look-ahead gate; the later stages take stage 0's answer from the
        plan (their queues mirror stage 0's, so the same requests are admitted)."""
        if not self.sp_rank0:
            return plan_in.admit_cap if plan_in is not None else None
        gate = self.sp_admission_gate
        if gate is None or not self.waiting_queue or self.chunked_req is not None:
            return None
        running = self.sp_running_batch.reqs
        if not running:
            return None
        lengths = [
            self.sp.kv_len(r.rid) if r.rid in self.sp else r.kv.kv_allocated_len for r in running
        ]
        buckets = [self.sp_length_bucket.get(r.rid, -1) for r in running]
        waiting = [len(r.origin_input_ids) + len(r.output_ids) for r in self.waiting_queue]
        st = self.sp_stats
        theta = gate.theta(st.accepted, st.rejected, st.drafts_dropped)
        n = gate.admit_count(lengths, buckets, waiting, theta)
        if n >= len(waiting):
            return None
        st.admission_gated_iterations += 1
        for req in self.waiting_queue[n:]:
            if not getattr(req, "spexis_admission_delayed", False):
                req.spexis_admission_delayed = True
                st.admissions_delayed += 1
        return n

    def _useful_position(self, req: Req, position: int) -> bool:
        """A row at ``position`` can still produce a token the request may emit."""
        produced = position + 1 - len(req.origin_input_ids)
        if produced >= req.sampling_params.max_new_tokens:
            return False
        return position + 1 < self.req_to_token_pool.req_to_token.shape[1]

    def sp_build_decode_batch(
        self, plan_in: Optional[SpexisPlan], plan_out: SpexisPlan
    ) -> Optional[ScheduleBatch]:
        self.sp_apply_drafts()
        reqs = self.sp_running_batch.reqs
        if not reqs:
            return None
        plans: List[Tuple[Req, RowPlan]] = []
        for req in reqs:
            if req.finished():
                continue
            row = self.sp.next_row(req.rid)
            if row is None:
                continue
            if row.is_spec and not self._useful_position(req, row.position):
                self.sp.drop_draft(req.rid)
                continue
            plans.append((req, row))

        plans = self.sp_apply_selection(plans, plan_in, plan_out)
        plans = self.sp_fit_memory(plans)
        if not plans:
            return None

        # One pass over the rows, then a handful of tensor ops: per-row tensor indexing would
        # launch one device kernel per row (milliseconds per iteration at B = 256 on a GPU).
        sp, stats = self.sp, self.sp_stats
        rows: List[SpexisRow] = []
        tokens, positions, pool_idx = [], [], []
        new_pool_idx, new_positions = [], []
        for req, row in plans:
            if _needs_slot(req, row):
                new_pool_idx.append(req.req_pool_idx)
                new_positions.append(row.position)
                req.kv.kv_allocated_len = row.position + 1
            epoch = sp.on_launch(req.rid, row.position, row.token, row.is_spec, row.confidence)
            rows.append(SpexisRow(req, row.position, epoch, row.is_spec))
            tokens.append(row.token)
            positions.append(row.position)
            pool_idx.append(req.req_pool_idx)
        n_spec = sum(1 for r in rows if r.is_spec)
        stats.rows_spec += n_spec
        stats.rows_normal += len(rows) - n_spec
        stats.decode_iterations += 1

        device = self.req_to_token_pool.device
        req_to_token = self.req_to_token_pool.req_to_token
        if new_pool_idx:
            new_slots = self.token_to_kv_pool_allocator.alloc(len(new_pool_idx))
            if new_slots is None:
                raise RuntimeError("Spexis: KV allocation failed after the memory check")
            where = torch.tensor([new_pool_idx, new_positions], dtype=torch.int64).to(device)
            req_to_token[where[0], where[1]] = new_slots.to(req_to_token.dtype)

        batch = ScheduleBatch.init_new(
            [r.req for r in rows],
            self.req_to_token_pool,
            self.token_to_kv_pool_allocator,
            self.tree_cache,
            self.model_config,
            False,
            self.spec_algorithm,
        )
        batch.forward_mode = ForwardMode.DECODE
        set_decode_logprob_fields(batch, batch.reqs)
        meta_cpu = torch.tensor([tokens, pool_idx, positions], dtype=torch.int64)
        meta = meta_cpu.to(device)
        batch.input_ids = meta[0]
        batch.req_pool_indices_cpu = meta_cpu[1]
        batch.req_pool_indices = meta[1]
        batch.seq_lens_cpu = meta_cpu[2] + 1
        batch.seq_lens = meta[2] + 1
        batch.orig_seq_lens = batch.seq_lens.to(torch.int32)
        batch.seq_lens_sum = int(batch.seq_lens_cpu.sum())
        batch.out_cache_loc = req_to_token[meta[1], meta[2]].to(torch.int64)
        batch.sampling_info = SamplingBatchInfo.from_schedule_batch(
            batch, self.model_config.vocab_size
        )
        batch.spexis_kind = "decode"
        batch.spexis_rows = rows
        self.sp_set_penalties(batch)
        self.sp_set_grammar_masks(batch)
        return batch

    def sp_set_grammar_masks(self, batch: ScheduleBatch) -> None:
        """Constrained decoding: each row's grammar mask after its own drafts (``sp_grammar``),
        for the sampler on the last stage and for the draft head on stage 0."""
        if not batch.has_grammar:
            return
        last = self.pp_group.is_last_rank
        if not (last or self.sp_grammar_draft_mask):
            return
        sp_grammar.set_decode_masks(
            batch,
            batch.spexis_rows,
            self.sp.draft_tokens,
            vocab_size=self.model_config.vocab_size,
            sampling_rank=last,
            draft_rank=self.sp_grammar_draft_mask,
        )

    def sp_set_penalties(self, batch: ScheduleBatch) -> None:
        """The sampling rank's penalizers see each row's output prefix (``sp_penalties``).

        The batch's penalizers are freshly prepared; on the last stage they are set from the
        committed output plus the drafts each row was built on. Such a batch also marks that
        the last stage needs the real values of the drafts its rows make
        (``sp_after_launch``): the other ranks record placeholders.
        """
        orchestrator = batch.sampling_info.penalizer_orchestrator
        if not (self.pp_group.is_last_rank and orchestrator is not None):
            return
        if not orchestrator.is_required:
            return
        batch.spexis_needs_drafts = True
        sp = self.sp
        prefixes = [
            (
                row_output_prefix(
                    row.req.output_ids,
                    sp.draft_tokens(row.req.rid),
                    len(row.req.origin_input_ids),
                    row.position,
                )
                if needs_penalizer(row.req.sampling_params)
                else None
            )
            for row in batch.spexis_rows
        ]
        set_penalizer_state(orchestrator, prefixes)

    def sp_apply_selection(
        self,
        plans: List[Tuple[Req, RowPlan]],
        plan_in: Optional[SpexisPlan],
        plan_out: SpexisPlan,
    ) -> List[Tuple[Req, RowPlan]]:
        """Selective speculation: stage 0 drops the ⌊αB⌋ least confident drafts (§5.1)."""
        if self.sp_rank0:
            alpha = self.spexis_config.alpha
            spec = [i for i, (_, row) in enumerate(plans) if row.is_spec]
            if alpha <= 0 or not spec:
                return plans
            conf = [self.sp.candidate_confidence(plans[i][0].rid) for i in spec]
            drop_idx = select_drops(conf, alpha)
            dropped = {plans[spec[i]][0].rid for i in drop_idx}
        else:
            dropped = set(plan_in.dropped) if plan_in is not None else set()
        if not dropped:
            return plans
        plan_out.dropped = sorted(dropped)
        kept = []
        for req, row in plans:
            if req.rid in dropped:
                self.sp.drop_draft(req.rid)
                self.sp_stats.drafts_dropped += 1
            else:
                kept.append((req, row))
        return kept

    def sp_fit_memory(self, plans: List[Tuple[Req, RowPlan]]) -> List[Tuple[Req, RowPlan]]:
        """Make room for the rows that need a new KV slot; speculation gives way first."""
        need = _slots_needed(plans)
        if need == 0:
            return plans
        evict_from_tree_cache(self.tree_cache, need)
        avail = self.token_to_kv_pool_allocator.available_size()
        if avail >= need:
            return plans
        kept = []
        for req, row in plans:
            if row.is_spec and _needs_slot(req, row):
                self.sp.drop_draft(req.rid)
                continue
            kept.append((req, row))
        need = _slots_needed(kept)
        if avail >= need:
            return kept
        # Not even the verified rows fit: retract requests (latest first) until they do.
        kept = self.sp_retract(kept, need - avail)
        need = _slots_needed(kept)
        if need <= avail:
            return kept
        # A retracted request's KV returns only once its rows have drained, so this iteration
        # runs the rows that fit; the others simply wait (next_row is pure: nothing to undo).
        fitted, budget = [], avail
        for req, row in kept:
            if _needs_slot(req, row):
                if budget == 0:
                    continue
                budget -= 1
            fitted.append((req, row))
        return fitted

    def sp_retract(
        self, plans: List[Tuple[Req, RowPlan]], shortfall: int
    ) -> List[Tuple[Req, RowPlan]]:
        order = sorted(
            range(len(plans)),
            key=lambda i: (len(plans[i][0].output_ids), -len(plans[i][0].origin_input_ids)),
        )
        retracted = set()
        while shortfall > 0 and len(order) > 1:
            i = order.pop()
            req = plans[i][0]
            retracted.add(req.rid)
            shortfall -= 1 + max(0, req.kv.kv_allocated_len - req.kv_committed_len)
            shortfall -= req.kv_committed_len  # freed once its rows have drained
            self.sp.remove(req.rid)
            self.sp_retracted_waiting_drain[req.rid] = req
            logger.info("Spexis: KV cache pool is full, retracting request %s", req.rid)
        return [(r, row) for r, row in plans if r.rid not in retracted]

    # ------------------------------------------------------------------ launch and results
    def sp_after_launch(self, batch: ScheduleBatch, result) -> None:
        """Take the drafts stage 0 just made (placeholders on the other stages).

        They are needed only when the next decode batch is built, so on a GPU stage 0 copies
        them to the host on the copy stream and reads them then (:meth:`sp_apply_drafts`):
        receiving and processing the previous results overlaps this forward pass instead of
        waiting for it. Every rank applies its drafts at the same point of the loop, which
        keeps the mirrored states identical. ``SPEXIS_SYNC_DRAFT_READ=1`` reads them at once
        (the previous behaviour; kept for the benchmark's before/after).
        """
        self.sp_stats.iterations += 1
        if getattr(batch, "spexis_kind", None) != "decode":
            return
        if getattr(result, "can_run_cuda_graph", False):
            self.sp_stats.decode_graph_replays += 1
        else:
            self.sp_stats.decode_eager_forwards += 1
        rows: List[SpexisRow] = batch.spexis_rows
        if self.sp_rank0:
            tensors = result.pp_hidden_states_proxy_tensors.tensors
        elif getattr(batch, "spexis_needs_drafts", False):
            # The last stage penalises rows by the drafts they are built on (sp_penalties):
            # it takes the drafts' values from the proxy they came down the pipe with.
            tensors = batch.spexis_extras
        else:
            self.sp_pending_drafts.append(_PendingDrafts(rows, None, None))
            if self.sp_sync_draft_read:
                self.sp_apply_drafts()
            return
        ids, conf = tensors[DRAFT_IDS_KEY], tensors[DRAFT_CONF_KEY]
        buckets = tensors.get(PROXY_LENGTH_BUCKET)
        sources = (ids, conf, buckets)
        event = None
        if ids.device.type != "cpu" and not self.sp_sync_draft_read:
            with self.copy_stream_ctx:
                self.copy_stream.wait_event(self.launch_event)
                ids, conf = ids.to("cpu", non_blocking=True), conf.to("cpu", non_blocking=True)
                if buckets is not None:
                    buckets = buckets.to("cpu", non_blocking=True)
                event = self.device_module.Event()
                event.record(self.device_module.current_stream())
        self.sp_pending_drafts.append(_PendingDrafts(rows, ids, conf, event, sources, buckets))
        if self.sp_sync_draft_read:
            self.sp_apply_drafts()

    def sp_apply_drafts(self) -> None:
        """Record the drafts of the decode batches launched so far, oldest first."""
        if not self.sp_pending_drafts:
            return
        with self.sp_stats.phases.phase("draft_sync"):
            self._sp_apply_pending_drafts()

    def _sp_apply_pending_drafts(self) -> None:
        pending, self.sp_pending_drafts = self.sp_pending_drafts, []
        for p in pending:
            if p.ids is None:
                draft_ids = [_PLACEHOLDER_TOKEN] * len(p.rows)
                draft_conf = [1.0] * len(p.rows)
            else:
                if p.event is not None:
                    p.event.synchronize()
                draft_ids = p.ids.tolist()
                draft_conf = p.conf.tolist()
            for row, tok, c in zip(p.rows, draft_ids, draft_conf):
                self.sp.on_draft(row.req.rid, row.position, row.epoch, int(tok), float(c))
            if p.length_buckets is not None:
                buckets = p.length_buckets.tolist()
                self.sp_stats.rows_predicted_ending += sum(1 for b in buckets if b >= 0)
                for row, b in zip(p.rows, buckets):
                    if row.req.rid in self.sp:
                        self.sp_length_bucket[row.req.rid] = int(b)

    def _forced_theta(self, req: Req) -> float:
        """The request's forced acceptance: its ``custom_params`` value, else the server's."""
        theta = getattr(req, "spexis_forced_theta", None)
        if theta is not None:
            return theta
        # a request's own value was validated on arrival (_force_accept_param_error)
        custom = req.sampling_params.custom_params or {}
        theta = float(custom.get(FORCE_ACCEPT_PARAM, self.spexis_config.force_accept))
        req.spexis_forced_theta = theta
        return theta

    def _add_request_to_queue(self, req: Req, is_retracted: bool = False):
        if not is_retracted and not req.finished():
            error = (
                request_input_error(req, self.model_config.vocab_size)
                or self._force_accept_param_error(req)
                or self._sp_unsupported_error(req)
            )
            if error:
                logger.warning("Spexis: aborting request %s: %s", req.rid, error)
                req.set_finish_with_abort(error)
        return super()._add_request_to_queue(req, is_retracted=is_retracted)

    def _sp_unsupported_error(self, req: Req) -> Optional[str]:
        """Sampling features SP would get wrong, refused instead of silently changed.

        Penalties and ``min_new_tokens`` are served (``sp_penalties``), and so are grammars of
        SGLang's xgrammar backend (``sp_grammar``, which names what it refuses).
        """
        if not self.sp_enabled:
            return None
        return sp_grammar.grammar_request_error(
            req.sampling_params,
            req.grammar,
            forced=self.spexis_config.force_accept is not None,
        )

    def _force_accept_param_error(self, req: Req) -> Optional[str]:
        """A request's ``custom_params.spexis_force_accept`` is only for the benchmark mode."""
        custom = req.sampling_params.custom_params or {}
        if FORCE_ACCEPT_PARAM not in custom:
            return None
        if not self.sp_enabled or self.spexis_config.force_accept is None:
            return (
                f"custom_params.{FORCE_ACCEPT_PARAM} needs a Spexis SP server started with "
                "--spexis-benchmark-force-accept"
            )
        value = custom[FORCE_ACCEPT_PARAM]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
            return f"custom_params.{FORCE_ACCEPT_PARAM} must be a number in [0, 1], got {value!r}"
        return None

    def _label_forced(self, req: Req) -> None:
        """Tag every output token so the client sees it came from forced acceptance."""
        if req.customized_info is None:
            req.customized_info = {}
        values = req.customized_info.setdefault(FORCED_LABEL, [])
        values.extend([self._forced_theta(req)] * (len(req.output_ids) - len(values)))

    def _forced_accept(self, req: Req, position: int, epoch: int) -> bool:
        """Bernoulli(theta) from a hash of (seed, request, position, epoch): every rank draws
        the same verdict without sharing a random stream."""
        base = getattr(req, "spexis_forced_hash", None)
        if base is None:
            base = zlib.crc32(f"{self.sp_rng_seed}:{req.rid}".encode())
            req.spexis_forced_hash = base
        return _uniform64(base, position, epoch) < self._forced_theta(req)

    def sp_process_result(self, batch: ScheduleBatch, result, pp_outputs: PPProxyTensors):
        if getattr(batch, "spexis_kind", None) != "decode":
            self.process_batch_result(batch, result)
            self.sp_admit_prefilled(batch)
            return
        rows: List[SpexisRow] = batch.spexis_rows
        true_ids = pp_outputs["next_token_ids"].tolist()
        draft_ids = pp_outputs[DRAFT_IDS_KEY].tolist()
        logprobs = DecodeLogprobs.from_result(batch, result)
        touched: List[Req] = []
        force = self.spexis_config.force_accept is not None
        for i, (row, y, d) in enumerate(zip(rows, true_ids, draft_ids)):
            req = row.req
            if force and req.rid in self.sp and self.sp.num_unverified(req.rid) > 0:
                # Benchmark-only: pretend the target agreed with the draft w.p. theta.
                if self._forced_accept(req, row.position, row.epoch):
                    y = d
                elif y == d:
                    y = (d + 1) % self.model_config.vocab_size
            outcome = self.sp.on_result(req.rid, row.position, row.epoch, y, launched_draft=d)
            if outcome is Outcome.STALE:
                self.sp_stats.rows_stale += 1
                continue
            if outcome is Outcome.ACCEPTED:
                self.sp_stats.accepted += 1
            elif outcome is Outcome.REJECTED:
                self.sp_stats.rejected += 1
            self.sp_stats.tokens_committed += 1
            req.kv_committed_len = row.position + 1
            req.output_ids.append(int(y))
            if logprobs is not None:  # a committed row: its prefix is verified
                logprobs.record(req, i, y)
            if force:
                self._label_forced(req)
            req.time_stats.set_last_decode_finish_time()
            req.update_finish_state(1)
            sp_grammar.accept_committed(req, int(y))  # stock order: after the finish check
            if req.finished():
                self.sp.remove(req.rid)
                self.sp_finished_waiting_drain[req.rid] = req
                self.sp_running_batch.batch_is_full = False
            touched.append(req)
        if touched:
            self.output_streamer.stream_output(touched, logprobs is not None)
        self.metrics_reporter.num_generated_tokens += len(touched)

    def sp_admit_prefilled(self, batch: ScheduleBatch) -> None:
        """Requests whose prefill result is in start decoding under SP."""
        if batch.chunked_req is not None:
            # As stock SGLang does when it filters a chunked request out of a finished
            # prefill batch: the admission limit hit while that request was in flight no
            # longer holds. (Without this, SP's single running batch stayed "full" until a
            # request finished, leaving the last of 512 requests queued for a whole wave.)
            self.sp_running_batch.batch_is_full = False
        for req in batch.reqs:
            if req.finished() or req.is_retracted or req.inflight_middle_chunks > 0:
                continue
            # batch.chunked_req: this batch carried a non-final chunk of req. (A retracted
            # request keeps its output_ids, so "has output" does not mean "prefilled".)
            if req is batch.chunked_req or req is self.chunked_req:
                continue
            if req.rid in self.sp or not req.output_ids:
                continue
            if self.sp.is_draining(req.rid):
                continue
            verified = len(req.origin_input_ids) + len(req.output_ids)
            self.sp.add(req.rid, verified, int(req.output_ids[-1]))
            if self.spexis_config.force_accept is not None:
                self._label_forced(req)
            self.sp_running_batch.reqs.append(req)

    def sp_release_drained(self) -> None:
        """Free the KV of finished / retracted requests whose in-flight rows have all returned."""
        for rid in self.sp.pop_drained():
            self.sp_length_bucket.pop(rid, None)
            req = self.sp_finished_waiting_drain.pop(rid, None)
            if req is not None:
                self._sp_free_unverified_slots(req)
                release_kv_cache(req, self.tree_cache)
                req.time_stats.set_completion_time()
            else:
                req = self.sp_retracted_waiting_drain.pop(rid, None)
                if req is None:
                    continue
                self._sp_free_unverified_slots(req)
                release_kv_cache(req, self.tree_cache, is_insert=False)
                req.reset_for_retract()
                self._add_request_to_queue(req, is_retracted=True)
            self.sp_running_batch.batch_is_full = False

    def _sp_free_unverified_slots(self, req: Req) -> None:
        if req.kv is None or req.req_pool_idx is None:
            return
        start, end = req.kv_committed_len, req.kv.kv_allocated_len
        if end > start:
            slots = self.req_to_token_pool.req_to_token[req.req_pool_idx, start:end]
            self.token_to_kv_pool_allocator.free(slots.to(torch.int64))
            req.kv.kv_allocated_len = start

    # ------------------------------------------------------------------ observability
    def sp_maybe_log(self) -> None:
        if self.sp_metrics is not None and self.sp_stats.decode_iterations:
            self.sp_metrics.update(self.sp_stats.as_dict())
        interval = self.spexis_config.log_interval
        if interval <= 0 or not self.sp_rank0:
            return
        now = time.monotonic()
        if now - self.sp_last_log < interval:
            return
        if self.sp_stats.decode_iterations == self.sp_last_logged_iterations:
            return  # nothing new to say (idle)
        self.sp_last_log = now
        self.sp_last_logged_iterations = self.sp_stats.decode_iterations
        s = self.sp_stats.as_dict()
        logger.info(
            ("[BENCHMARK forced acceptance] " if self.spexis_config.force_accept else "")
            + "Spexis: acceptance %.3f, tokens/row %.3f, rows/iter %.1f, tokens/iter %.2f, "
            "normal %d, spec %d, stale %d, dropped %d, delayed admissions %d",
            s["acceptance_rate"],
            s["effective_batch_ratio"],
            s["avg_rows_per_decode_iteration"],
            s["avg_tokens_per_decode_iteration"],
            s["rows_normal"],
            s["rows_spec"],
            s["rows_stale"],
            s["drafts_dropped"],
            s["admissions_delayed"],
        )

    def get_internal_state(self, recv_req):
        ret = super().get_internal_state(recv_req)
        if self.sp_enabled and hasattr(self, "sp_stats"):
            try:
                ret.internal_state["spexis"] = self.sp_stats.as_dict()
            except AttributeError:
                pass
        elif getattr(self, "stock_pp_timers", None) is not None:
            # a plain PP server under SPEXIS_PHASE_TIMERS=1: stock event_loop_pp by phase
            ret.internal_state["spexis"] = self.stock_pp_timers.as_dict()
        return ret
