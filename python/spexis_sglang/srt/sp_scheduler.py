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
:class:`spexis_sglang.core.slot_state.SlotState` (epochs, not flags; arrays indexed by the
request's slot, one numpy pass per batch) decides whether the rows built on the draft stand or
are stale.

Every PP rank runs this scheduler on mirrored state and builds the same batches:

* requests arrive through SGLang's own relay (stage k forwards what stage k-1 received);
* prefill admission is SGLang's own (mirrored allocator and radix cache);
* the decode rows come from ``SlotState.next_rows``: which rows exist depends only on what was
  launched and verified, never on a draft's value, so later stages launch speculative rows
  with a placeholder token (only stage 0 embeds input tokens);
* the draft each row produced travels down the pipe as extra keys of the proxy dict and comes
  back with the true token in the output dict, so every rank verifies identically;
* rank-0-only decisions (the selective-speculation drops, and with look-ahead admission how
  many waiting requests to admit) travel in a :class:`~.protocol.SpexisPlan` appended to the
  request relay, which stage 0 therefore sends after it has scheduled; a plan that decides
  nothing is left out, so a steady decode iteration relays ``[]`` exactly as stock PP does.

What an iteration costs on the host: the SP state, the sampling parameters
(``sp_sampling``) and forced acceptance (``sp_forced``) live in arrays indexed by request slot,
so building a batch and verifying its results are a few dozen numpy operations. For a batch
that returns only tokens, ``sp_emit`` prefilters with numpy which rows SGLang's finish check
and ``stream_output`` can act on and runs them only there; the other rows' tokens are held
back per slot and appended to their ``Req`` in one go when SGLang code reads it
(``sp_flush_tokens`` before request handling, admission and retraction). Only the last stage builds sampling state. At a fixed alpha
the alpha controller, which only observes there, ranks candidates and credits verdicts on
every 8th iteration (``--spexis-alpha-observe``).

KV (design.md §4): a row at position p writes the request's own slot for p; a rejected row's
slot is overwritten when the request re-executes p. Only verified tokens reach ``output_ids``
and the radix cache (``kv_committed_len`` = last valid row's position + 1). A finished request
keeps its slots until its in-flight rows have drained (``SlotState.pop_drained``).
"""

from __future__ import annotations

import functools
import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Deque, Dict, List, Optional, Tuple

import numpy as np
import torch
from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
from sglang.srt.managers.schedule_policy import CLIP_MAX_NEW_TOKENS
from sglang.srt.managers.scheduler import Scheduler
from sglang.srt.managers.scheduler_components.new_token_ratio_tracker import (
    NewTokenRatioTracker,
)
from sglang.srt.mem_cache.common import evict_from_tree_cache, release_kv_cache
from sglang.srt.model_executor.forward_batch_info import (
    CaptureHiddenMode,
    ForwardMode,
    PPProxyTensors,
)
from sglang.srt.runtime_context import get_observability, get_parallel
from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo
from sglang.srt.utils import DynamicGradMode
from sglang.srt.utils.common import ceil_align

from spexis_sglang.core.slot_state import NO_LIMIT, Rows, SlotState
from spexis_sglang.srt import sp_grammar
from spexis_sglang.srt.config import (
    ENV_DRAFT_LOG,
    ENV_GPU_TIMERS,
    ENV_PP_TRANSPORT,
    ENV_PROFILE_LOOP,
    SpexisConfig,
    env_flag,
    env_value,
    get_config,
    share_gpu_mode,
)
from spexis_sglang.srt.host_staging import HostReadback, HostStaging
from spexis_sglang.srt.input_validation import request_input_error
from spexis_sglang.srt.request_checks import hidden_states_error
from spexis_sglang.srt.prefill_adder import COUNT_ADMISSION
from spexis_sglang.srt.profiling import DraftLog
from spexis_sglang.srt.protocol import (
    FORCE_ACCEPT_PARAM,
    FORCED_LABEL,
    PLACEHOLDER_TOKEN,
    PROXY_DRAFT_CONF,
    PROXY_DRAFT_HOST,
    PROXY_DRAFT_IDS,
    PROXY_LENGTH_BUCKET,
    PROXY_POSITIONS,
    PROXY_PREFIX,
    PROXY_RETURNED,
    PROXY_STAGE0_ONLY,
    SpexisPlan,
    pack_drafts,
    relay_payload,
    unpack_drafts,
)
from spexis_sglang.srt.relay import PipeRequestReceiver, open_local_relay
from spexis_sglang.srt.request_poll import nothing_queued_check, receives_multimodal_waiting
from spexis_sglang.srt.sp_alpha import AlphaController
from spexis_sglang.srt.sp_emit import SlotEmit, emit_batch
from spexis_sglang.srt.sp_forced import (
    ForcedAcceptance,
    force_accept_param_error,
    rejected_token,
)
from spexis_sglang.srt.sp_length_oracle import LENGTH_ORACLE_LABEL, make_length_oracle
from spexis_sglang.srt.sp_logprobs import DecodeLogprobs, set_decode_logprob_fields
from spexis_sglang.srt.sp_penalties import needs_penalizer, row_output_prefix, set_penalizer_state
from spexis_sglang.srt.sp_sampling import SlotSampling
from spexis_sglang.srt.stats import (
    GpuForwardTimer,
    SpexisStats,
    StockPPPhaseTimers,
    phase_timers_enabled,
)

logger = logging.getLogger(__name__)

__all__ = ["FORCE_ACCEPT_PARAM", "FORCED_LABEL", "SpexisScheduler", "SpexisStats"]


class _PendingDrafts:
    """The drafts of one launched decode batch, read when the next batch is built.

    On a GPU they come back to the host in one copy queued behind the forward
    (:class:`HostReadback`); :meth:`read` waits for it, so nobody reads the buffer early.
    Ranks that never see drafts hold placeholders."""

    def __init__(self, rows: Rows, packed=None, event=None, source=None, buckets=False):
        self.rows = rows
        self._packed = packed  # pack_drafts' layout, on the host once the event is done
        self._event = event
        self._source = source  # keeps the copy's device tensor alive until it is read
        self.has_buckets = buckets

    def ready(self) -> bool:
        """The copy has landed (reading does not wait)."""
        return self._event is None or self._event.query()

    def placeholders(self) -> Tuple[np.ndarray, np.ndarray]:
        """What a rank records without reading: placeholder ids, confidence 1."""
        n = len(self.rows)
        return np.full(n, PLACEHOLDER_TOKEN, dtype=np.int64), np.ones(n)

    def read(self) -> Tuple[np.ndarray, np.ndarray, Optional[np.ndarray]]:
        """Draft ids, confidences and (stage 0 with a predictor) length buckets, per row."""
        if self._packed is None:
            return (*self.placeholders(), None)
        if self._event is not None:
            self._event.synchronize()
        ids, conf, buckets = unpack_drafts(self._packed.numpy())
        return ids, conf, buckets if self.has_buckets else None


class _TransitOutputs:
    """What the last stage returned for the batch in transit: the tensors on this rank's
    device (stage 0's redo reads the true tokens and drafts there) and their host copy."""

    def __init__(self, tensors: Dict[str, torch.Tensor], n: int, readback: HostReadback):
        self.tensors = tensors
        ids = tensors["next_token_ids"][:n].to(torch.int64)
        drafts = tensors.get(PROXY_DRAFT_IDS)  # a prefill's drafts are never verified
        drafts = torch.zeros_like(ids) if drafts is None else drafts[:n]
        # true token and the draft it verifies, a row each, in one device-to-host copy (rows
        # first: the readback ring grows its pinned buffers along the rows only)
        self.device = torch.stack((ids, drafts), dim=1)
        self._host, self._event = readback.start(self.device)
        #: SGLang's result record, for batches that need more than the tokens (logprobs)
        self.batch_result = None
        self.result_event = None

    def read(self) -> Tuple[np.ndarray, np.ndarray]:
        """True tokens and the drafts they verify, on the host (waits for the copy)."""
        if self._event is not None:
            self._event.synchronize()
        host = self._host.numpy()
        return host[:, 0].copy(), host[:, 1].copy()


@dataclass
class _LaunchPlan:
    """How the device completes a decode batch when it launches (``run_batch``)."""

    #: some rows take their input from stage 0's latest draft on the device
    has_spec: bool
    #: rows with an alternative: the transit batch's verdict decides where they run
    alternatives: Optional[torch.Tensor] = None
    #: per row, its request's row in the transit batch (meaningful where it has an alternative)
    transit_rows: Optional[torch.Tensor] = None
    #: the transit batch's outputs (set between scheduling and launch, stage 0)
    transit: Optional[_TransitOutputs] = None


@dataclass
class SPLoopState:
    """Everything the SP loop keeps between iterations (one per scheduler)."""

    slots: SlotState
    #: the Req decoding under SP in each slot (None: free or draining)
    req_at: np.ndarray
    #: the running requests in batch order (SGLang's stock code scans this batch's reqs)
    running: ScheduleBatch
    #: the last stage's per-slot sampling parameters (None on the ranks that do not sample)
    sampling: Optional[SlotSampling]
    #: benchmark-only forced acceptance (None unless --spexis-benchmark-force-accept)
    forced: Optional[ForcedAcceptance]
    #: latest remaining-length bucket per slot (stage 0, with a length predictor; -1: none)
    length_bucket: np.ndarray
    #: the request returns nothing but tokens (no logprobs, hidden states or grammar): a
    #: batch of such requests is built without scanning them (_sp_decode_batch)
    plain: np.ndarray
    #: per-slot finish and stream prefilters of result processing (sp_emit)
    emit: SlotEmit
    rank0: bool
    #: stage 0's drop ratio, fixed or chosen online (None on the other ranks)
    alpha: Optional[AlphaController] = None
    stats: SpexisStats = field(default_factory=SpexisStats)
    iteration: int = 0
    #: released requests whose KV is freed once their rows have drained: slot -> (req, retracted)
    draining: Dict[int, Tuple[Req, bool]] = field(default_factory=dict)
    #: drafts of launched decode batches not yet read (see sp_after_launch)
    pending_drafts: List[_PendingDrafts] = field(default_factory=list)
    #: look-ahead admission's cap for this iteration (read by get_num_allocatable_reqs)
    admit_cap: Optional[int] = None
    #: stage 0: how many of the queue SGLang's own reservation would admit this iteration
    admit_reservation: Optional[int] = None
    #: a request was released since ``running`` was last filtered
    released_since_filter: bool = False
    #: (running.reqs, their slots): rebuilt when the list changes
    running_slots: Optional[Tuple[list, np.ndarray]] = None
    #: the batch metadata's host-to-device copy, through pinned buffers (a no-op on CPU)
    staging: Optional[HostStaging] = None
    #: the drafts' device-to-host copy, into pinned buffers (a no-op on CPU)
    readback: Optional[HostReadback] = None
    #: the transit batches' true tokens, device to host (a no-op on CPU)
    output_readback: Optional[HostReadback] = None
    #: the rows of a request the device may redo when the transit batch rejects their chain
    #: (tokens only, no penalizer, and an attention backend that reads lengths on the device)
    patchable: Optional[np.ndarray] = None
    #: stage 0: each slot's latest draft on the device (the input of its next speculative row)
    draft_by_slot: Optional[torch.Tensor] = None
    #: each slot's row in the transit batch (scratch of _sp_transit_rows)
    transit_row: Optional[np.ndarray] = None
    #: the last stage: its own outputs of the batches in flight, oldest first
    own_outputs: Deque[_TransitOutputs] = field(default_factory=deque)
    #: stage 0: launched batches whose length buckets have not reached the host yet
    late_buckets: List[_PendingDrafts] = field(default_factory=list)


def _max_new_left(req: Req) -> int:
    """Tokens ``req`` may still generate, clipped as SGLang's admission clips them."""
    left = req.sampling_params.max_new_tokens - len(req.output_ids)
    return max(0, min(left, CLIP_MAX_NEW_TOKENS))


class SpexisScheduler(Scheduler):
    """SGLang's scheduler with speculative parallelism on PP ranks (see the module docstring)."""

    def __init__(self, *args, **kwargs):
        self.spexis_config: SpexisConfig = get_config()
        self.sp: Optional[SPLoopState] = None
        self.sp_length_oracle = None  # set by init_sp_state on stage 0 (benchmark only)
        super().__init__(*args, **kwargs)

    # ------------------------------------------------------------------ set-up
    @property
    def sp_enabled(self) -> bool:
        return self.spexis_config.enabled and self.ps.pp_size > 1

    @property
    def sp_stats(self) -> SpexisStats:
        return self.sp.stats

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
        if self.sp is not None and self.sp.admit_cap is not None:
            res = min(res, self.sp.admit_cap)
        return min(res, self.req_to_token_pool.available_size())

    def event_loop_pp(self):
        self.sp_link = self._sp_open_link()
        if not self.sp_enabled:
            if phase_timers_enabled():
                self.stock_pp_timers = StockPPPhaseTimers(self)
            return super().event_loop_pp()
        return self.event_loop_sp()

    def _sp_open_link(self):
        """``SPEXIS_PP_TRANSPORT=ipc`` with every PP rank on one GPU: the PP tensor messages
        go through CUDA IPC (``stage_link``), stock PP's and SP's alike; else None (NCCL)."""
        if env_value(ENV_PP_TRANSPORT) != "ipc":
            return None
        if not (share_gpu_mode() and torch.cuda.is_available() and torch.cuda.device_count() == 1):
            logger.warning("%s=ipc needs every PP rank on one GPU: using NCCL", ENV_PP_TRANSPORT)
            return None
        if self.ps.tp_size > 1 or get_parallel().enable_dp_attention:
            logger.warning(
                "%s=ipc supports TP=1 without DP attention: using NCCL", ENV_PP_TRANSPORT
            )
            return None
        from spexis_sglang.srt.stage_link import SameGpuLink, proxy_slot_bytes

        slot = proxy_slot_bytes(
            self.max_running_requests, self.model_config.hidden_size, self.model_config.dtype
        )
        return SameGpuLink.open(self.pp_group, slot)

    def _pp_send_dict_to_next_stage(self, tensor_dict, async_send=True, msg_type="default"):
        link = getattr(self, "sp_link", None)
        if link is None:
            return super()._pp_send_dict_to_next_stage(tensor_dict, async_send, msg_type)
        tensor_dict["__msg_type__"] = msg_type
        link.send(tensor_dict)
        return []

    def _pp_recv_typed_dict(self, expected_kind="default", all_gather_group=None):
        link = getattr(self, "sp_link", None)
        if link is None:
            return super()._pp_recv_typed_dict(expected_kind, all_gather_group)
        stashed = self._pp_tensor_dict_inbox[expected_kind]
        if stashed:
            return stashed.popleft()
        while True:  # as stock: a message of another kind waits in the inbox
            tensor_dict = link.recv()
            kind = tensor_dict.get("__msg_type__", "default")
            if kind == expected_kind:
                return tensor_dict
            self._pp_tensor_dict_inbox[kind].append(tensor_dict)

    def init_sp_state(self) -> None:
        self.init_pp_loop_state()
        if get_parallel().pp_async_batch_depth != 0:
            raise ValueError("Spexis needs --pp-async-batch-depth 0")
        # One batch more in flight than stock PP: iteration b launches before the results of
        # b - N are processed (they travel to the device meanwhile; see event_loop_sp).
        self.pp_loop_size = self.ps.pp_size + 1
        self.mbs = [None] * self.pp_loop_size
        self.last_mbs = [None] * self.pp_loop_size
        self.mb_metadata = [None] * self.pp_loop_size
        capacity = self.req_to_token_pool.req_to_token.shape[0]
        vocab = self.model_config.vocab_size
        cfg = self.spexis_config
        forced = None
        if cfg.force_accept is not None:
            forced = ForcedAcceptance(
                capacity, self.server_args.random_seed or 0, cfg.force_accept, vocab
            )
            logger.warning(
                "Spexis BENCHMARK MODE: verification accepts drafts with probability %.3f "
                "regardless of the model; outputs are not the model's and are labelled "
                "'%s' in their meta_info",
                cfg.force_accept,
                FORCED_LABEL,
            )
        device = self.req_to_token_pool.device
        self.sp = SPLoopState(
            # a request has at most one row per launched batch, and a batch returns
            # pp_loop_size launches later
            slots=SlotState(capacity, depth=self.pp_loop_size, pipelined=True),
            req_at=np.full(capacity, None, dtype=object),
            running=ScheduleBatch(reqs=[], batch_is_full=False),
            sampling=SlotSampling(capacity, vocab) if self.pp_group.is_last_rank else None,
            forced=forced,
            length_bucket=np.full(capacity, -1, dtype=np.int64),
            plain=np.zeros(capacity, dtype=bool),
            emit=SlotEmit(capacity, vocab),
            rank0=self.pp_group.is_first_rank,
            alpha=self._sp_make_alpha_controller(capacity),
            # a decode batch's copy is done once its result is in, pp_loop_size launches later
            staging=HostStaging(device, depth=2 * self.pp_loop_size + 2),
            # a batch's drafts are read when the next decode batch is built
            readback=HostReadback(device, depth=2 * self.pp_loop_size + 2),
            # a transit batch's tokens are read in the iteration they arrive
            output_readback=HostReadback(device, depth=2 * self.pp_loop_size + 2),
            patchable=np.zeros(capacity, dtype=bool),
            transit_row=np.zeros(capacity, dtype=np.int64),
        )
        if self.sp.rank0:
            self.sp.draft_by_slot = torch.zeros(capacity, dtype=torch.int64, device=device)
        # The device redoes a row where the transit batch rejects its chain only if the
        # attention backend reads the batch's lengths on the device (on a CPU the host values
        # are fixed up too): otherwise such rows simply go stale.
        backend = getattr(self.tp_worker.model_runner, "attn_backend", None)
        on_cpu = torch.device(device).type == "cpu"
        self.sp_redo_rows = on_cpu or not getattr(backend, "needs_cpu_seq_lens", True)
        if not self.sp_redo_rows:
            logger.warning(
                "Spexis: the attention backend %s reads sequence lengths on the host; rows "
                "built on a draft the transit batch rejects are not redone on the device "
                "(they go stale: fewer tokens per row, outputs unchanged)",
                type(backend).__name__,
            )
        if self.sp.alpha is not None:
            self.sp.alpha.update_stats(self.sp.stats)
        # Stock abort handling scans running_mbs and mbs for in-flight requests.
        self.running_mbs = [self.sp.running] * self.pp_loop_size
        self.sp_last_log = time.monotonic()
        self.sp_last_logged_iterations = 0
        self.sp_metrics = None
        if self.sp.rank0 and get_observability().enable_metrics:
            from spexis_sglang.srt.metrics import SpexisMetrics

            self.sp_metrics = SpexisMetrics(
                self.metrics_collector.labels, benchmark_modes=self._sp_benchmark_modes()
            )
        # stage 0: skip SGLang's receive when its sockets hold nothing (request_poll)
        self.sp_nothing_queued = nothing_queued_check(
            self.request_receiver,
            dp_attention=bool(get_parallel().enable_dp_attention),
            mm_waiting=receives_multimodal_waiting(),
        )
        # the relay between stages over a local zmq pipe where it can be (relay.py)
        self.sp_relay = open_local_relay(self)
        if self.sp_relay is not None and self.sp_relay.incoming is not None:
            self.request_receiver = PipeRequestReceiver.wrapping(
                self.request_receiver, self.sp_relay.incoming
            )
        draft_log = env_value(ENV_DRAFT_LOG)
        self.sp_draft_log = (
            DraftLog(draft_log) if draft_log and self.sp.rank0 and self.ps.tp_rank == 0 else None
        )
        # benchmark only (--spexis-benchmark-length-oracle): stage 0's buckets from the truth
        self.sp_length_oracle = None
        if self.sp.rank0:
            self.sp_length_oracle = make_length_oracle(
                cfg.length_oracle, capacity, self.server_args.random_seed or 0
            )
        if self.sp_length_oracle is not None:
            logger.warning(self.sp_length_oracle.log_line())
        self.sp_admission_gate = self._sp_make_admission_gate()
        # constrained decoding: stage 0 masks the drafts with the rows' grammars (sp_grammar)
        self.sp_grammar_draft_mask = self.sp.rank0 and sp_grammar.draft_masking_enabled(
            self.spexis_config, self.server_args
        )

    def _sp_make_alpha_controller(self, capacity: int) -> Optional[AlphaController]:
        """Stage 0's drop ratio: ``--spexis-alpha`` fixed, or ``auto`` (chosen online)."""
        if not self.pp_group.is_first_rank:
            return None
        cfg = self.spexis_config
        if cfg.alpha_auto:
            logger.info(
                "Spexis alpha auto: re-chosen every %d iterations, every %d-th iteration "
                "explores at alpha 0",
                cfg.alpha_interval,
                cfg.alpha_explore,
            )
        return AlphaController(
            capacity,
            depth=self.pp_loop_size,
            num_stages=self.ps.pp_size,
            alpha=cfg.alpha,
            auto=cfg.alpha_auto,
            interval=cfg.alpha_interval,
            explore=cfg.alpha_explore,
            observe_every=cfg.alpha_observe,
        )

    def _sp_make_admission_gate(self):
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

    # ------------------------------------------------------------------ event loop
    @DynamicGradMode()
    def event_loop_sp(self):
        """SP's pipeline loop: every iteration builds a batch of all running requests,
        launches it and sends it on at once, then verifies the batch launched N iterations
        ago, whose true tokens reached the device meanwhile.

        What sits between two forward passes of a stage is only device work and the
        transfers: stage 0 builds iteration b while the later stages still run the earlier
        ones, its rows assuming that the batch in transit (b - N) accepts their chains; the
        device redoes a row where it rejects (``_sp_resolve_rows``), and the host records that
        when it processes b - N after the launch (``SlotState.conditional_alternatives``).
        Stock PP instead sends a stage's proxy only after processing an older result, so the
        host's work for every iteration adds to the pipeline's critical path.
        """
        self.init_sp_state()
        sp = self.sp
        timer = sp.stats.phases
        profiler = self._sp_maybe_profiler()
        while True:
            if profiler is not None:
                profiler.tick()
            server_is_idle = True
            for mb_id in range(self.pp_loop_size):
                timer.start()
                self.running_batch = sp.running
                # launched N iterations ago: its outputs arrive in this one
                transit_id = (mb_id + 1) % self.pp_loop_size
                transit = self.mbs[transit_id]

                cur_batch = self._sp_schedule(transit)
                self.mbs[mb_id] = cur_batch
                timer.mark("schedule")
                outputs = self._sp_collect(transit, transit_id)
                timer.mark("wait_output")
                result = None
                if cur_batch:
                    server_is_idle = False
                    result = self._sp_launch(mb_id, cur_batch, outputs)
                timer.mark("launch")
                if cur_batch:
                    self._sp_send(cur_batch, result)
                timer.mark("send")
                if transit is not None:
                    self._sp_verify(transit, outputs)
                    self.last_mbs[transit_id] = transit
                    timer.mark("process")
                self.sp_release_drained()
                sp.iteration += 1
                if cur_batch is not None or transit is not None:
                    timer.commit()
                else:
                    timer.discard()  # idle

            if server_is_idle:
                self.on_idle()
            self.sp_maybe_log()

    def _sp_schedule(self, transit: Optional[ScheduleBatch]) -> Optional[ScheduleBatch]:
        """Receive requests, build this iteration's batch, relay both to the next stage."""
        recv_reqs, plan_in = self._sp_recv_requests()
        if recv_reqs:
            # a request handler may read the running requests' output
            self.sp_flush_tokens()
        self.process_input_requests(recv_reqs)
        cur_batch, plan_out = self.sp_get_next_batch(plan_in, transit)
        self.cur_batch_for_debug = cur_batch
        self._sp_relay_requests(recv_reqs, plan_out)
        return cur_batch

    def _sp_collect(
        self, transit: Optional[ScheduleBatch], transit_id: int
    ) -> Optional[_TransitOutputs]:
        """The transit batch's outputs on this rank's device (received from the previous
        stage, which on stage 0 is the last one; the last stage has its own), with their
        copy to the host started. Stage 0 forwards them to a middle stage."""
        if transit is None:
            return None
        sp = self.sp
        if self.pp_group.is_last_rank:
            outputs = sp.own_outputs.popleft()
        else:
            tensors = self._pp_recv_dict_from_prev_stage()
            if self.ps.pp_rank < self.ps.pp_size - 2:  # the next stage is not the last
                self._pp_commit_comm_work(self.send_output_work)
                self.send_output_work = self._pp_send_dict_to_next_stage(
                    dict(tensors), async_send=True, msg_type="output"
                )
            outputs = _TransitOutputs(tensors, len(transit.reqs), sp.output_readback)
        if getattr(transit, "spexis_kind", None) != "decode" or transit.return_logprob:
            # SGLang's own result record (prefill results, logprobs), as stock PP makes it
            with self.copy_stream_ctx:
                self.copy_stream.wait_stream(self.schedule_stream)
                outputs.batch_result = self._pp_prep_batch_result(
                    transit, self.mb_metadata[transit_id], PPProxyTensors(outputs.tensors)
                )
                outputs.result_event = self.device_module.Event()
                outputs.result_event.record(self.device_module.current_stream())
        return outputs

    def _sp_launch(self, mb_id: int, batch: ScheduleBatch, outputs: Optional[_TransitOutputs]):
        """Launch ``batch`` (later stages first receive the previous stage's proxy)."""
        pp_proxy_tensors = self._pp_recv_proxy_tensors()
        if pp_proxy_tensors is not None:
            # a CUDA-graph replay upstream pads them to its batch bucket
            n = len(batch.reqs)
            batch.spexis_extras = {
                k: v[:n] for k, v in pp_proxy_tensors.tensors.items() if k.startswith(PROXY_PREFIX)
            }
        plan: Optional[_LaunchPlan] = getattr(batch, "spexis_launch", None)
        if plan is not None:
            plan.transit = outputs
        # the previous proxy's send reads a CUDA graph's outputs, which this launch overwrites
        self._pp_commit_comm_work(self.send_proxy_work)
        result, self.launch_event = self._pp_launch_batch(
            mb_id, batch, pp_proxy_tensors, self.mb_metadata, self.last_rank_comm_queue
        )
        self.sp_after_launch(batch, result)
        return result

    def _sp_send(self, batch: ScheduleBatch, result) -> None:
        """Send what the next stage waits for as soon as it is queued: the proxy down the
        pipe, or (the last stage) the outputs back to stage 0."""
        if not self.pp_group.is_last_rank:
            self._sp_send_proxy(batch, result)
            return
        event, tensors = self.last_rank_comm_queue.popleft()
        self._pp_commit_comm_work(self.send_output_work)
        self.device_module.current_stream().wait_event(event)
        self.send_output_work = self._pp_send_dict_to_next_stage(
            tensors.tensors, async_send=True, msg_type="output"
        )
        # this stage verifies from its own outputs, N iterations later
        self.sp.own_outputs.append(
            _TransitOutputs(tensors.tensors, len(batch.reqs), self.sp.output_readback)
        )

    def _sp_verify(self, transit: ScheduleBatch, outputs: _TransitOutputs) -> None:
        """The transit batch's results on the host: verdicts, tokens, finished requests."""
        if outputs.result_event is not None:
            outputs.result_event.synchronize()
        self.sp_process_result(transit, outputs)

    def _sp_recv_requests(self) -> Tuple[list, Optional[SpexisPlan]]:
        """This iteration's requests, and stage 0's plan (later stages)."""
        nothing_queued = self.sp_nothing_queued
        if nothing_queued is not None and nothing_queued():
            return [], None  # what recv_requests returns then, without its ~0.1 ms
        recv_reqs = self.request_receiver.recv_requests()
        plan_in = None
        if recv_reqs:
            plans = [r for r in recv_reqs if isinstance(r, SpexisPlan)]
            if plans:
                plan_in = plans[-1]
                recv_reqs = [r for r in recv_reqs if not isinstance(r, SpexisPlan)]
        return recv_reqs, plan_in

    def _sp_relay_requests(self, recv_reqs: list, plan_out: SpexisPlan) -> None:
        """Stage 0 relays the requests *after* scheduling, with its decisions.

        A plan that decides nothing is left out (the next stage reads a missing plan as an
        empty one), so a steady decode iteration relays ``[]`` as stock SGLang does: one
        size message instead of a pickle and two messages (~0.1 ms of stage 0's CPU). On one
        node the relay goes over a local zmq pipe (``relay.py``), not gloo."""
        if self.pp_group.is_last_rank:
            return
        relay = self.sp_relay
        if relay is not None and relay.sends:
            relay.send(relay_payload(recv_reqs, plan_out))
            return
        self._pp_commit_comm_work(self.send_req_work)
        self.send_req_work = self._pp_send_pyobj_to_next_stage(
            relay_payload(recv_reqs, plan_out), async_send=True
        )

    def _sp_send_proxy(self, batch: ScheduleBatch, result) -> None:
        self.device_module.current_stream().wait_event(self.launch_event)
        tensors = dict(result.pp_hidden_states_proxy_tensors.tensors)
        for key in PROXY_STAGE0_ONLY:
            tensors.pop(key, None)
        positions = getattr(batch, "spexis_positions", None)
        if positions is not None:  # stage 0 redid some rows: where each row ran
            tensors[PROXY_POSITIONS] = positions
        for k, v in getattr(batch, "spexis_extras", {}).items():
            tensors.setdefault(k, v)
        self.send_proxy_work = self._pp_send_dict_to_next_stage(
            tensors, async_send=True, msg_type="proxy"
        )

    def _sp_maybe_profiler(self):
        """``SPEXIS_PROFILE_LOOP=PREFIX``: cProfile this rank's loop (developer aid)."""
        prefix = env_value(ENV_PROFILE_LOOP)
        if not prefix:
            return None
        from spexis_sglang.srt.profiling import LoopProfiler

        return LoopProfiler(f"{prefix}.pp{self.ps.pp_rank}.tp{self.ps.tp_rank}.prof")

    def _pp_prepare_tensor_dict(self, result, batch):
        tensor_dict = super()._pp_prepare_tensor_dict(result, batch)
        # The last rank sends each row's draft back with its true token.
        extras = getattr(batch, "spexis_extras", {})
        for k in PROXY_RETURNED:
            if k in extras:
                tensor_dict[k] = extras[k]
        return tensor_dict

    # ------------------------------------------------------------------ scheduling
    def sp_get_next_batch(
        self, plan_in: Optional[SpexisPlan], transit: Optional[ScheduleBatch] = None
    ) -> Tuple[Optional[ScheduleBatch], SpexisPlan]:
        """This iteration's batch: a prefill (SGLang's admission), else every running
        request's next row. ``transit``: the batch whose results reach the device before this
        one runs (a decode batch's verdicts then decide where some rows run)."""
        sp = self.sp
        plan_out = SpexisPlan(iteration=sp.iteration)
        self.process_pending_chunked_abort()
        self._abort_on_waiting_timeout()
        if self.chunked_req is not None:
            if self.chunked_req.extend_range.end > len(self.chunked_req.prefix_indices):
                self.stash_chunked_request(self.chunked_req)

        if self.waiting_queue or self.chunked_req is not None:
            self.sp_flush_tokens()  # admission reads the running requests' output
        if sp.released_since_filter:
            req_at = sp.req_at
            sp.running.reqs = [r for r in sp.running.reqs if req_at[r.req_pool_idx] is r]
            sp.released_since_filter = False
        sp.admit_cap = plan_out.admit_cap = self.sp_admission_cap(plan_in)
        if sp.admit_cap is not None:
            # the limit is decided afresh every iteration: a "full" batch it caused must not
            # outlive it (stock SGLang clears batch_is_full only when memory frees up)
            sp.running.batch_is_full = False
        # a cap is the gate's count: it replaces SGLang's token reservation (prefill_adder)
        setattr(sp.running, COUNT_ADMISSION, sp.admit_cap is not None)
        try:
            prefill = self.get_new_batch_prefill(sp.running).batch_to_run
        finally:
            sp.admit_cap = None
            setattr(sp.running, COUNT_ADMISSION, False)
        if prefill is not None and sp.admit_reservation is not None:
            # admitted while SGLang's reservation would still have held them back
            sp.stats.admissions_early += max(0, len(prefill.reqs) - sp.admit_reservation)
        sp.admit_reservation = None
        if prefill is not None:
            prefill.spexis_kind = "prefill"
            return prefill, plan_out
        pipelined = transit is not None and getattr(transit, "spexis_kind", None) == "decode"
        batch = self.sp_build_decode_batch(plan_in, plan_out, transit if pipelined else None)
        return batch, plan_out

    def _sp_running_slots(self) -> np.ndarray:
        """The running requests' slots in batch order (rebuilt only when the list changed)."""
        sp = self.sp
        reqs = sp.running.reqs
        cached = sp.running_slots
        if cached is None or cached[0] is not reqs or cached[1].shape[0] != len(reqs):
            slots = np.fromiter((r.req_pool_idx for r in reqs), dtype=np.int64, count=len(reqs))
            sp.running_slots = cached = (reqs, slots)
        return cached[1]

    def sp_admission_cap(self, plan_in: Optional[SpexisPlan]) -> Optional[int]:
        """How many waiting requests may be admitted this iteration (None = SGLang decides).

        Stage 0 asks the look-ahead gate: the KV projection's count (which replaces SGLang's
        reservation, so it may exceed what SGLang would admit), lowered by Algorithm 1 and
        ``G`` when an eviction looms. The later stages take stage 0's answer from the plan
        (their queues and memory mirror stage 0's, so the same requests are admitted)."""
        sp = self.sp
        if not sp.rank0:
            return plan_in.admit_cap if plan_in is not None else None
        gate = self.sp_admission_gate
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
            remaining=[_max_new_left(r) for r in sp.running.reqs],
            buckets=buckets,
            ratio=ratio.current,
            waiting_tokens=waiting,
            waiting_max_new=[_max_new_left(r) for r in queue],
            page=page,
            growth_ratio=ratio.init,
        )
        n = n_proj
        if n > 0:  # Algorithm 1 and G may lower what the pool allows
            theta = gate.theta(st.accepted, st.rejected, st.drafts_dropped)
            n = min(n, gate.admit_count(lengths, buckets, waiting, theta))
        if n < len(waiting):
            st.admission_gated_iterations += 1
        for req in queue[n:n_sglang]:
            if not getattr(req, "spexis_admission_delayed", False):
                req.spexis_admission_delayed = True
                st.admissions_delayed += 1
        sp.admit_reservation = n_sglang
        return n

    def sp_build_decode_batch(
        self,
        plan_in: Optional[SpexisPlan],
        plan_out: SpexisPlan,
        transit: Optional[ScheduleBatch] = None,
    ) -> Optional[ScheduleBatch]:
        """Every running request's next row (normal or on its draft), fitted to memory.

        ``transit``: the decode batch whose true tokens reach the device before this batch
        runs. A row built on a draft of its request's row there gets an alternative: where
        that row rejects, the device runs it as the normal row the rejection asks for."""
        sp = self.sp
        self.sp_apply_drafts()
        if not sp.running.reqs:
            return None
        patchable = sp.patchable if transit is not None else None
        rows = sp.slots.next_rows(self._sp_running_slots(), patchable)
        rows = self.sp_apply_selection(rows, plan_in, plan_out)
        retractions = sp.stats.retractions
        rows = self.sp_fit_memory(rows)
        ratio = self.new_token_ratio_tracker
        if sp.stats.retractions == retractions:
            # SGLang decays its admission's future-token reservation every decode step that
            # retracts nothing (update_running_batch); SP's decode iteration is that step
            ratio.decay_step()
        sp.stats.new_token_ratio = ratio.current
        if len(rows) == 0:
            return None
        alternatives = transit_rows = None
        if transit is not None:
            alternatives = sp.slots.conditional_alternatives(rows, patchable[rows.slot])
            if sp.forced is not None:
                # benchmark only: the verdict is a function of the transit row, known now;
                # the device redoes exactly the rows whose chain it rejects
                cond = np.flatnonzero(alternatives >= 0)
                s = rows.slot[cond]
                accepts = sp.forced.accepts(s, alternatives[cond] - 1, rows.epoch[cond])
                alternatives[cond[accepts]] = -1
            if (alternatives >= 0).any():
                transit_rows = self._sp_transit_rows(transit, rows)
            else:
                alternatives = None
        meta = self._sp_alloc_kv(rows, alternatives, transit_rows)
        launched_spec = sp.slots.stats.launched_spec
        sp.slots.on_launch(rows, alternatives=alternatives)
        if sp.alpha is not None:
            sp.alpha.on_launch(rows, sp.iteration)
        st = sp.stats
        n_spec = sp.slots.stats.launched_spec - launched_spec  # SlotState counts them
        st.rows_spec += n_spec
        st.rows_normal += len(rows) - n_spec
        st.decode_iterations += 1
        return self._sp_decode_batch(rows, *meta, has_alternatives=alternatives is not None)

    def _sp_transit_rows(self, transit: ScheduleBatch, rows: Rows) -> np.ndarray:
        """Per row, the index of its request's row in the transit batch (0 if none)."""
        index = self.sp.transit_row
        t = transit.spexis_rows.slot
        index[rows.slot] = 0
        index[t] = np.arange(t.shape[0], dtype=np.int64)
        return index[rows.slot]

    def _sp_alloc_kv(
        self,
        rows: Rows,
        alternatives: Optional[np.ndarray] = None,
        transit_rows: Optional[np.ndarray] = None,
    ) -> Tuple[Tuple[torch.Tensor, torch.Tensor], Tuple[torch.Tensor, ...]]:
        """A new KV slot for every row that writes past its request's KV (one alloc, one
        index write). While a request decodes under SP, its KV length is the SlotState's
        (``allocated_len``), not ``req.kv.kv_allocated_len``.

        Returns the slots and sequence lengths on the host (SGLang's ``*_cpu`` fields), and
        the batch's metadata on the device, one copy, as views (one ``split``): tokens, slots,
        positions, sequence lengths (``n`` each), the lengths again as int32 (two to an int64:
        ``orig_seq_lens`` without a cast kernel), the rows' alternatives and transit rows
        (``n`` each, or empty; see ``sp_build_decode_batch``), then the slots and positions of
        the rows that take a new KV slot (``k`` each). On stage 0 a speculative row's token
        is -1: the device takes its request's latest draft (``_sp_resolve_rows``)."""
        need = self.sp.slots.needs_slot(rows)
        n, k = len(rows), int(np.count_nonzero(need))
        h = (n + 1) // 2
        a = n if alternatives is not None else 0
        host = np.empty(4 * n + h + 2 * a + 2 * k, dtype=np.int64)
        tokens = host[:n]
        tokens[:] = rows.token
        if self.sp.rank0:
            tokens[rows.is_spec] = -1
        host[n : 2 * n] = rows.slot
        host[2 * n : 3 * n] = rows.position
        lens = host[3 * n : 4 * n]
        np.add(rows.position, 1, out=lens)
        host[4 * n : 4 * n + h].view(np.int32)[:n] = lens
        at = 4 * n + h
        if a:
            host[at : at + n] = alternatives
            host[at + n : at + 2 * n] = transit_rows
        at += 2 * a
        if k:
            host[at : at + k] = rows.slot[need]
            host[at + k :] = rows.position[need]
        meta_cpu = torch.from_numpy(host)
        meta = self.sp.staging.to_device(meta_cpu)
        parts = meta.split((n, n, n, n, h, a, a, k, k))  # one call for every view
        if meta is meta_cpu:
            parts_cpu = parts[1], parts[3]
        else:
            parts_cpu = meta_cpu[n : 2 * n], meta_cpu[3 * n : 4 * n]
        if k == 0:
            return parts_cpu, parts
        new_slot_of, new_position = parts[7], parts[8]
        if self.token_to_kv_pool_allocator.page_size == 1:
            new_slots = self.token_to_kv_pool_allocator.alloc(k)
        else:
            new_slots = self._sp_alloc_paged(new_slot_of, new_position, host[at + k :])
        if new_slots is None:
            raise RuntimeError("Spexis: KV allocation failed after the memory check")
        req_to_token = self.req_to_token_pool.req_to_token
        req_to_token[new_slot_of, new_position] = new_slots.to(req_to_token.dtype)
        # req.kv.kv_allocated_len is brought up to the slot's high-water mark on release
        return parts_cpu, parts

    def _sp_alloc_paged(
        self, slot_of: torch.Tensor, position: torch.Tensor, positions: np.ndarray
    ) -> Optional[torch.Tensor]:
        """KV slots for new positions with ``--page-size > 1`` (SGLang's ``alloc_decode``
        rule): a position that opens a page takes a fresh page's first slot, any other
        continues its predecessor's page. A new position is always the request's next one
        (``needs_slot``: KV covers every position below it), so the predecessor's slot is
        set, by the prefill or by an earlier SP row. ``slot_of`` and ``position`` are on the
        device, ``positions`` the same positions on the host."""
        allocator = self.token_to_kv_pool_allocator
        page = allocator.page_size
        opens = torch.from_numpy(positions % page == 0).to(position.device)
        req_to_token = self.req_to_token_pool.req_to_token
        new_slots = req_to_token[slot_of, (position - 1).clamp_min(0)].to(torch.int64) + 1
        n_pages = int(opens.sum())
        if n_pages:
            pages = allocator.alloc(n_pages * page)
            if pages is None:
                return None
            new_slots[opens] = pages[::page]
        return new_slots

    def _sp_decode_batch(
        self,
        rows: Rows,
        meta_cpu: Tuple[torch.Tensor, torch.Tensor],
        meta: Tuple[torch.Tensor, ...],
        has_alternatives: bool = False,
    ) -> ScheduleBatch:
        """The ScheduleBatch of ``rows`` on ``_sp_alloc_kv``'s metadata (one host-to-device
        copy of ids, slots, positions and lengths; the tensors are views of it)."""
        reqs = self.sp.req_at[rows.slot].tolist()
        plain = bool(self.sp.plain[rows.slot].all())
        if plain:
            # what init_new would find scanning every request: nothing to return but tokens
            batch = ScheduleBatch(
                reqs=reqs,
                req_to_token_pool=self.req_to_token_pool,
                token_to_kv_pool_allocator=self.token_to_kv_pool_allocator,
                tree_cache=self.tree_cache,
                model_config=self.model_config,
                enable_overlap=False,
                return_logprob=False,
                has_grammar=False,
                device=self.req_to_token_pool.device,
                spec_algorithm=self.spec_algorithm,
                return_hidden_states=False,
                return_hidden_states_mode=CaptureHiddenMode.NULL,
                is_prefill_only=False,
            )
            batch.top_logprobs_nums = batch.token_ids_logprobs = None
        else:
            batch = ScheduleBatch.init_new(
                reqs,
                self.req_to_token_pool,
                self.token_to_kv_pool_allocator,
                self.tree_cache,
                self.model_config,
                False,
                self.spec_algorithm,
            )
            set_decode_logprob_fields(batch, reqs)
        batch.forward_mode = ForwardMode.DECODE
        n = len(rows)
        req_to_token = self.req_to_token_pool.req_to_token
        ids, slots, positions, lens, lens32 = meta[:5]
        batch.input_ids = ids
        batch.req_pool_indices_cpu, batch.seq_lens_cpu = meta_cpu
        batch.req_pool_indices = slots
        batch.seq_lens = lens
        batch.orig_seq_lens = lens32.view(torch.int32)[:n]
        batch.seq_lens_sum = int(rows.position.sum()) + n
        batch.out_cache_loc = req_to_token[slots, positions].to(torch.int64)
        if self.sp.sampling is not None:
            batch.sampling_info = self.sp.sampling.build(batch, rows.slot)
        batch.spexis_kind = "decode"
        batch.spexis_rows = rows
        batch.spexis_plain = plain
        batch.spexis_launch = _LaunchPlan(
            has_spec=self.sp.rank0 and bool(rows.is_spec.any()),
            alternatives=meta[5] if has_alternatives else None,
            transit_rows=meta[6] if has_alternatives else None,
        )
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
        if batch.sampling_info is None:  # stage 0: the draft head reads the mask from it
            batch.sampling_info = SamplingBatchInfo.from_schedule_batch(
                batch, self.model_config.vocab_size
            )
        rows: Rows = batch.spexis_rows
        slots = rows.slot.tolist()
        sp_grammar.set_decode_masks(
            batch,
            rows.position.tolist(),
            lambda i: self.sp.slots.draft_tokens(slots[i]),
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
        info = batch.sampling_info
        orchestrator = info.penalizer_orchestrator if info is not None else None
        if orchestrator is None or not orchestrator.is_required:
            return
        batch.spexis_needs_drafts = True
        slots = self.sp.slots
        prefixes = [
            (
                row_output_prefix(
                    req.output_ids,
                    slots.draft_tokens(slot),
                    len(req.origin_input_ids),
                    position,
                )
                if needs_penalizer(req.sampling_params)
                else None
            )
            for req, slot, position in zip(
                batch.reqs, batch.spexis_rows.slot.tolist(), batch.spexis_rows.position.tolist()
            )
        ]
        set_penalizer_state(orchestrator, prefixes)

    def sp_apply_selection(
        self, rows: Rows, plan_in: Optional[SpexisPlan], plan_out: SpexisPlan
    ) -> Rows:
        """Selective speculation: stage 0 drops the ⌊αB⌋ least confident drafts (§5.1); the
        later stages drop the same ones."""
        sp = self.sp
        if sp.rank0:
            running = self._sp_running_slots().shape[0]
            rows, dropped = sp.alpha.select(sp.slots, rows, running)
            sp.alpha.update_stats(sp.stats)
        else:
            dropped = np.asarray(plan_in.dropped if plan_in is not None else [], dtype=np.int64)
            if dropped.size:
                sp.slots.drop(dropped)
                rows = rows.without(dropped)
        if dropped.size:
            plan_out.dropped = dropped.tolist()
            sp.stats.drafts_dropped += int(dropped.size)
        return rows

    def sp_fit_memory(self, rows: Rows) -> Rows:
        """Make room for the rows that need new KV memory; speculation gives way first."""
        slots = self.sp.slots
        page = self.token_to_kv_pool_allocator.page_size
        need = self._sp_needs_memory(rows)
        n_need = int(np.count_nonzero(need)) * page
        if n_need == 0:
            return rows
        evict_from_tree_cache(self.tree_cache, n_need)
        avail = self.token_to_kv_pool_allocator.available_size()
        if avail >= n_need:
            return rows
        spec_need = rows.is_spec & need
        if spec_need.any():
            slots.drop(rows.slot[spec_need])
            rows = rows.take(~spec_need)
            need = self._sp_needs_memory(rows)
            n_need = int(np.count_nonzero(need)) * page
            if avail >= n_need:
                return rows
        # Not even the verified rows fit: retract requests (latest first) until they do.
        rows = self.sp_retract(rows, n_need - avail)
        need = self._sp_needs_memory(rows)
        if int(np.count_nonzero(need)) * page <= avail:
            return rows
        # A retracted request's KV returns only once its rows have drained, so this iteration
        # runs the rows that fit; the others simply wait (next_rows is pure: nothing to undo).
        return rows.take(~need | (np.cumsum(need) * page <= avail))

    def _sp_needs_memory(self, rows: Rows) -> np.ndarray:
        """Rows that take KV memory: a new slot, and with ``--page-size > 1`` only a new
        position that opens a page (the others continue their request's last page)."""
        need = self.sp.slots.needs_slot(rows)
        page = self.token_to_kv_pool_allocator.page_size
        return need if page == 1 else need & (rows.position % page == 0)

    def sp_retract(self, rows: Rows, shortfall: int) -> Rows:
        self.sp_flush_tokens()
        reqs = self.sp.req_at[rows.slot].tolist()
        order = sorted(
            range(len(reqs)),
            key=lambda i: (len(reqs[i].output_ids), -len(reqs[i].origin_input_ids)),
        )
        retracted = []
        while shortfall > 0 and len(order) > 1:
            req = reqs[order.pop()]
            retracted.append(req.req_pool_idx)
            allocated = int(self.sp.slots.allocated_len(req.req_pool_idx)[0])
            shortfall -= 1 + max(0, allocated - req.kv_committed_len)
            shortfall -= req.kv_committed_len  # freed once its rows have drained
            self._sp_release(req, retracted=True)
            logger.info("Spexis: KV cache pool is full, retracting request %s", req.rid)
        if retracted:
            # as SGLang's retract_decode: reserve what the remaining requests have shown
            req_at = self.sp.req_at
            kept = [r for r in self.sp.running.reqs if req_at[r.req_pool_idx] is r]
            self.new_token_ratio_tracker.current = (
                NewTokenRatioTracker.estimate_new_token_ratio_after_retract(kept)
            )
            self.sp.stats.retractions += len(retracted)
        return rows.without(np.asarray(retracted, dtype=np.int64))

    # ------------------------------------------------------------------ launch and results
    def run_batch(self, batch: ScheduleBatch, pp_proxy_tensors=None):
        """SGLang's ``run_batch``; then, on stage 0, the copy of the decode batch's drafts to
        the host is queued at once, still inside the launch's forward-stream context (entering
        that context again costs the scheduler two stream switches per iteration)."""
        timer = self.sp_gpu_timer
        timed = timer is not None and batch.forward_mode.is_decode()
        if timed:
            timer.poll()
            start = timer.start()
        decode = getattr(batch, "spexis_kind", None) == "decode"
        if decode:
            self._sp_resolve_rows(batch)
        result = super().run_batch(batch, pp_proxy_tensors)
        if decode and self.sp.rank0:
            self._sp_start_draft_readback(batch, result)
        if timed:
            timer.stop(start, len(batch.reqs), batch.seq_lens_sum)
        return result

    @functools.cached_property
    def sp_gpu_timer(self) -> Optional[GpuForwardTimer]:
        """``SPEXIS_GPU_TIMERS=1`` on a GPU: this rank's decode forwards timed on the device
        (stock servers started by the launcher too)."""
        if not env_flag(ENV_GPU_TIMERS) or not torch.cuda.is_available():
            return None
        return GpuForwardTimer(f"pp rank {self.ps.pp_rank}, tp rank {self.ps.tp_rank}")

    def _sp_resolve_rows(self, batch: ScheduleBatch) -> None:
        """Complete a decode batch on the device, in stream order before its forward: stage
        0's speculative rows take their request's latest draft, and rows with an alternative
        run there where the transit batch rejected their chain (stage 0 decides from the true
        tokens that just arrived, the later stages take the positions stage 0 sent)."""
        plan: _LaunchPlan = batch.spexis_launch
        sp = self.sp
        slots = batch.req_pool_indices
        if plan.has_spec:
            batch.input_ids = torch.where(
                batch.input_ids < 0, sp.draft_by_slot[slots], batch.input_ids
            )
        if plan.alternatives is None:
            return
        alt = plan.alternatives
        if sp.rank0:
            true_ids, drafts = plan.transit.device[plan.transit_rows].unbind(1)
            rejected = alt >= 0
            if sp.forced is None:
                rejected &= true_ids != drafts
                token = true_ids
            else:  # benchmark only: the host chose the rows (sp_build_decode_batch)
                token = rejected_token(true_ids, drafts, self.model_config.vocab_size)
            batch.input_ids = torch.where(rejected, token, batch.input_ids)
            positions = torch.where(rejected, alt, batch.seq_lens - 1)
            batch.spexis_positions = positions
        else:
            positions = batch.spexis_extras[PROXY_POSITIONS]
        batch.seq_lens.copy_(positions + 1)
        batch.orig_seq_lens.copy_(batch.seq_lens)
        req_to_token = self.req_to_token_pool.req_to_token
        batch.out_cache_loc = req_to_token[slots, positions].to(torch.int64)
        if batch.seq_lens.device.type == "cpu":  # exact host lengths (the GPU's are bounds)
            batch.seq_lens_sum = int(batch.seq_lens.sum())

    def _sp_start_draft_readback(self, batch: ScheduleBatch, result) -> None:
        """Stage 0: record the batch's drafts per slot on the device (the inputs of the next
        speculative rows) and queue their copy to the host behind the forward that made them
        (one copy, one reusable event; on CPU the forward's own tensor)."""
        n = len(batch.spexis_rows)  # a CUDA-graph replay returns its outputs padded
        tensors = result.pp_hidden_states_proxy_tensors.tensors
        self.sp.draft_by_slot[batch.req_pool_indices] = tensors[PROXY_DRAFT_IDS][:n]
        packed = tensors[PROXY_DRAFT_HOST][:n]
        host, event = self.sp.readback.start(packed)
        batch.spexis_drafts = _PendingDrafts(
            batch.spexis_rows, host, event, packed, PROXY_LENGTH_BUCKET in tensors
        )

    def sp_after_launch(self, batch: ScheduleBatch, result) -> None:
        """Take the drafts stage 0 just made (placeholders on the other stages).

        They are recorded when the next decode batch is built (:meth:`sp_apply_drafts`),
        after the transit batch's results have converted this batch's redone rows; on a GPU
        stage 0 copies them to the host behind the forward (:meth:`run_batch`) and reads them
        only where the host needs their values. Every rank applies its drafts at the same
        point of the loop, which keeps the mirrored states identical.
        """
        stats = self.sp.stats
        stats.iterations += 1
        if getattr(batch, "spexis_kind", None) != "decode":
            return
        if getattr(result, "can_run_cuda_graph", False):
            stats.decode_graph_replays += 1
        else:
            stats.decode_eager_forwards += 1
        rows: Rows = batch.spexis_rows
        if self.sp.rank0:
            pending = batch.spexis_drafts
        elif getattr(batch, "spexis_needs_drafts", False):
            # The last stage penalises rows by the drafts they are built on (sp_penalties):
            # it takes the drafts' values from the proxy they came down the pipe with.
            n = len(rows)
            extras = batch.spexis_extras
            packed = pack_drafts(extras[PROXY_DRAFT_IDS][:n], extras[PROXY_DRAFT_CONF][:n])
            with self.forward_stream_ctx:
                host, event = self.sp.readback.start(packed)
            pending = _PendingDrafts(rows, host, event, packed)
        else:
            pending = _PendingDrafts(rows)  # placeholders
        self.sp.pending_drafts.append(pending)

    def sp_apply_drafts(self) -> None:
        """Record the drafts of the decode batches launched so far, oldest first.

        Their values are read (waiting for the copy behind the forward) only where the host
        needs them: to choose which drafts to drop (alpha), for a grammar's draft mask or the
        last stage's penalties, or the draft log. Otherwise a speculative row's input comes
        from the device (``_sp_resolve_rows``) and verification compares the draft that
        comes back with the true token, so placeholders are recorded and stage 0 does not
        wait for its own forward; a predictor's length buckets are taken once they have
        landed."""
        sp = self.sp
        self._sp_apply_late_buckets()
        if not sp.pending_drafts:
            return
        with sp.stats.phases.phase("draft_sync"):
            pending, sp.pending_drafts = sp.pending_drafts, []
            read = self._sp_needs_draft_values()
            if not read and sp.alpha is not None and sp.alpha.wants_confidences():
                read = all(p.ready() for p in pending)  # observe only if it costs no wait
            if sp.alpha is not None:
                sp.alpha.confidences_real = read
            for p in pending:
                rows = p.rows
                if read:
                    ids, conf, buckets = p.read()
                else:
                    (ids, conf), buckets = p.placeholders(), None
                    if p.has_buckets:
                        sp.late_buckets.append(p)
                if self.sp_draft_log is not None:
                    self._sp_log_drafts(rows, ids, conf, buckets)
                sp.slots.on_draft(rows.slot, rows.position, rows.epoch, ids, conf)
                self._sp_record_buckets(rows, buckets)
            if self.sp_length_oracle is not None:  # benchmark only: replaces a predictor
                for p in pending:
                    self._sp_record_buckets(p.rows, self.sp_length_oracle.buckets(p.rows))

    def _sp_needs_draft_values(self) -> bool:
        sp = self.sp
        if not sp.rank0:
            return True  # placeholders, or the last stage's penalty drafts: no wait for these
        if self.sp_draft_log is not None:
            return True
        if sp.alpha is not None and sp.alpha.needs_confidences():
            return True
        # a grammar's draft mask reads the drafts (sp_grammar): not a tokens-only batch
        slots = self._sp_running_slots()
        return not bool(sp.plain[slots].all())

    def _sp_apply_late_buckets(self) -> None:
        """Length buckets of earlier batches whose copy has landed since."""
        sp = self.sp
        if not sp.late_buckets:
            return
        waiting = []
        for p in sp.late_buckets:
            if p.ready():
                self._sp_record_buckets(p.rows, p.read()[2])
            else:
                waiting.append(p)
        sp.late_buckets = waiting

    def _sp_record_buckets(self, rows: Rows, buckets: Optional[np.ndarray]) -> None:
        if buckets is None:
            return
        sp = self.sp
        sp.stats.rows_predicted_ending += int(np.count_nonzero(buckets >= 0))
        live = sp.req_at[rows.slot] != None  # noqa: E711 (elementwise)
        sp.length_bucket[rows.slot[live]] = buckets[live]

    def _sp_log_drafts(self, rows: Rows, ids, conf, buckets) -> None:
        reqs = self.sp.req_at[rows.slot]
        rids = [None if r is None else r.rid for r in reqs]
        self.sp_draft_log.write(rids, rows.position, rows.token, ids, conf, buckets)

    def _add_request_to_queue(self, req: Req, is_retracted: bool = False):
        if not is_retracted and not req.finished():
            error = (
                request_input_error(req, self.model_config.vocab_size)
                or hidden_states_error(bool(req.return_hidden_states), self.ps.pp_size)
                or self._force_accept_param_error(req)
                or self._sp_unsupported_error(req)
            )
            if error:
                logger.warning("Spexis: aborting request %s: %s", req.rid, error)
                req.set_finish_with_abort(error)
                # the aborted request's one-token prefill must not ask for hidden states
                # either (under PP that is what kills every rank)
                req.return_hidden_states = False
                req.return_hidden_states_mode = CaptureHiddenMode.NULL
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
        mode_on = self.sp_enabled and self.spexis_config.force_accept is not None
        return force_accept_param_error(req, mode_on)

    def sp_process_result(self, batch: ScheduleBatch, outputs: _TransitOutputs):
        """A returned batch's results: a prefill's as SGLang processes them (its requests then
        start decoding under SP); a decode batch's verdicts, committed tokens and finishes."""
        if getattr(batch, "spexis_kind", None) != "decode":
            self.process_batch_result(batch, outputs.batch_result)
            self.sp_admit_prefilled(batch)
            return
        sp = self.sp
        rows: Rows = batch.spexis_rows
        true_ids, drafts = outputs.read()
        result = outputs.batch_result
        forced = sp.forced
        if forced is not None:
            # Benchmark-only: pretend the target agreed with the draft w.p. theta (timed
            # apart: a serving loop does not do this)
            with sp.stats.phases.phase("forced"):
                built_on_draft = sp.slots.verifies_draft(rows)
                true_ids = forced.true_tokens(rows, true_ids, drafts, built_on_draft)
        counts = sp.slots.stats  # SlotState counts the verdicts it gives
        accepted, rejected, stale = counts.accepted, counts.rejected, counts.stale
        redone = counts.converted
        res = sp.slots.on_result(true_ids, launched_drafts=drafts)
        if sp.alpha is not None:
            sp.alpha.on_result(rows, res.verdict)
        st = sp.stats
        st.accepted += counts.accepted - accepted
        st.rejected += counts.rejected - rejected
        # launched as speculative rows, run as the normal rows the rejections asked for
        st.rows_redone += counts.converted - redone
        n_stale = counts.stale - stale
        n_committed = len(rows) - n_stale
        st.rows_stale += n_stale
        st.tokens_committed += n_committed
        if n_committed == 0:
            return
        if batch.spexis_plain:
            # tokens only: SGLang's per-request finish check and streaming only where they
            # can act (sp_emit); the steady state commits every row, so no subsets then
            if n_stale:
                committed = np.flatnonzero(res.committed)
                slots, tokens = rows.slot[committed], true_ids[committed]
                positions = rows.position[committed]
            else:
                committed, slots, tokens, positions = None, rows.slot, true_ids, rows.position
            finished, to_stream = emit_batch(
                sp.emit,
                batch.reqs,
                slots,
                tokens,
                positions,
                time.perf_counter(),
                forced.top_up if forced is not None else None,
                index=committed,
            )
            for req in finished:
                self._sp_release(req, retracted=False)
            self.output_streamer.stream_output(to_stream, False)
            self.metrics_reporter.num_generated_tokens += n_committed
            return
        committed = np.flatnonzero(res.committed)
        # per committed token, what SGLang does per emitted token
        logprobs = DecodeLogprobs.from_result(batch, result)
        reqs = batch.reqs
        # tokens held back while the request rode plain batches come first
        sp.emit.flush([reqs[i] for i in committed.tolist()], rows.slot[committed])
        touched: List[Req] = []
        finished: List[Req] = []
        for i, token, position in zip(
            committed.tolist(), true_ids[committed].tolist(), rows.position[committed].tolist()
        ):
            req = reqs[i]
            req.kv_committed_len = position + 1
            req.output_ids.append(token)
            if self._sp_counts_reasoning(req):  # stock order: before the finish check
                req.update_reasoning_tokens(token, self.model_config.think_end_ids)
            if logprobs is not None:  # a committed row: its prefix is verified
                logprobs.record(req, i, token)
            if forced is not None:
                forced.label_one(req)
            req.time_stats.set_last_decode_finish_time()
            req.update_finish_state(1)
            if req.grammar is not None:  # stock order: after the finish check
                sp_grammar.accept_committed(req, token)
            if req.finished():
                finished.append(req)
            touched.append(req)
        for req in finished:
            self._sp_release(req, retracted=False)
        self.output_streamer.stream_output(touched, logprobs is not None)
        self.metrics_reporter.num_generated_tokens += len(touched)

    def sp_admit_prefilled(self, batch: ScheduleBatch) -> None:
        """Requests whose prefill result is in start decoding under SP."""
        sp = self.sp
        if batch.chunked_req is not None:
            # As stock SGLang does when it filters a chunked request out of a finished
            # prefill batch: the admission limit hit while that request was in flight no
            # longer holds. (Without this, SP's single running batch stayed "full" until a
            # request finished, leaving the last of 512 requests queued for a whole wave.)
            sp.running.batch_is_full = False
        context = self.req_to_token_pool.req_to_token.shape[1]
        for req in batch.reqs:
            if req.finished() or req.is_retracted or req.inflight_middle_chunks > 0:
                continue
            # batch.chunked_req: this batch carried a non-final chunk of req. (A retracted
            # request keeps its output_ids, so "has output" does not mean "prefilled".)
            if req is batch.chunked_req or req is self.chunked_req:
                continue
            slot = req.req_pool_idx
            if slot is None or sp.req_at[slot] is req or not req.output_ids:
                continue
            if slot in sp.draining:
                continue
            prompt_len = len(req.origin_input_ids)
            max_new = req.sampling_params.max_new_tokens
            limit = min(context, NO_LIMIT if max_new is None else prompt_len + max_new)
            verified = prompt_len + len(req.output_ids)
            if req.kv.kv_allocated_len != verified - 1:
                # SlotState assumes the prefill left KV for exactly the verified tokens but
                # the last (needs_slot); anything else would leak or overwrite KV slots
                raise RuntimeError(
                    f"Spexis: request {req.rid} starts decoding with KV for "
                    f"{req.kv.kv_allocated_len} positions, expected {verified - 1}"
                )
            sp.slots.admit(slot, verified, req.output_ids[-1], limit)
            sp.req_at[slot] = req
            sp.length_bucket[slot] = -1
            sp.plain[slot] = not (
                req.return_logprob
                or req.grammar is not None
                or req.return_hidden_states_mode != CaptureHiddenMode.NULL
                or self._sp_counts_reasoning(req)
            )
            # the device may redo the request's rows only if nothing the host prepares for a
            # row depends on its position or input (tokens only, no penalizer or logit
            # processor reading the output so far)
            sp.patchable[slot] = (
                self.sp_redo_rows
                and sp.plain[slot]
                and not needs_penalizer(req.sampling_params)
                and getattr(req, "custom_logit_processor", None) is None
                and not getattr(req, "return_sampling_mask", False)
            )
            sp.emit.admit(slot, req, verified)
            if sp.sampling is not None:
                sp.sampling.admit(slot, req)
            if sp.forced is not None:
                sp.forced.admit(slot, req, int(sp.slots.epoch(slot)[0]))
                sp.forced.label(req)
            if self.sp_length_oracle is not None:
                self.sp_length_oracle.admit(slot, req, verified, limit)
            sp.running.reqs.append(req)

    def sp_flush_tokens(self) -> None:
        """Append every held-back committed token to its request (``sp_emit``): before
        SGLang code that reads the running requests' ``output_ids`` or ``kv_committed_len``."""
        sp = self.sp
        slots = sp.emit.pending_slots()
        if slots.size:
            sp.emit.flush(sp.req_at[slots].tolist(), slots)

    def abort_request(self, recv_req):
        super().abort_request(recv_req)
        sp = self.sp
        if sp is None:
            return
        # stock marks running requests with to_finish; their next token must take the
        # finish check (sp_emit holds back the tokens of rows it would not check)
        for slot in np.flatnonzero(sp.req_at != None).tolist():  # noqa: E711 (elementwise)
            if sp.req_at[slot].to_finish is not None:
                sp.emit.flag(slot)

    def _sp_counts_reasoning(self, req: Req) -> bool:
        """The request counts its reasoning tokens (``require_reasoning`` with a reasoning
        parser): SGLang's result processing advances the count per emitted token."""
        return bool(req.require_reasoning and self.model_config.think_end_ids)

    def _sp_release(self, req: Req, retracted: bool) -> None:
        """Stop a request's rows; its KV is freed once the rows in flight have drained."""
        sp = self.sp
        slot = req.req_pool_idx
        sp.emit.flush([req], np.array([slot], dtype=np.int64))
        if sp.forced is not None:
            sp.forced.top_up(req)  # the fast emit path tags tokens when they stream
        allocated = int(sp.slots.allocated_len(slot)[0])
        req.kv.kv_allocated_len = max(req.kv.kv_allocated_len, allocated)
        sp.slots.release(slot)
        sp.req_at[slot] = None
        sp.draining[slot] = (req, retracted)
        sp.released_since_filter = True
        sp.running.batch_is_full = False

    def sp_release_drained(self) -> None:
        """Free the KV of finished / retracted requests whose in-flight rows have all returned."""
        sp = self.sp
        drained = sp.slots.pop_drained()
        if drained.size == 0:
            return
        for slot in drained.tolist():
            sp.length_bucket[slot] = -1
            entry = sp.draining.pop(slot, None)
            if entry is None:
                continue
            req, retracted = entry
            self._sp_free_unverified_slots(req)
            if retracted:
                release_kv_cache(req, self.tree_cache, is_insert=False)
                req.reset_for_retract()
                self._add_request_to_queue(req, is_retracted=True)
            else:
                release_kv_cache(req, self.tree_cache)
                req.time_stats.set_completion_time()
        sp.running.batch_is_full = False

    def _sp_free_unverified_slots(self, req: Req) -> None:
        """Free the KV past the verified tokens, so that SGLang's release sees none.

        With ``--page-size > 1`` the page that holds the last verified token is left to
        ``release_kv_cache`` (it frees that partial page with the request's other pages);
        only the pages after it are freed here."""
        if req.kv is None or req.req_pool_idx is None:
            return
        start, end = req.kv_committed_len, req.kv.kv_allocated_len
        if end > start:
            first = ceil_align(start, self.token_to_kv_pool_allocator.page_size)
            if end > first:
                slots = self.req_to_token_pool.req_to_token[req.req_pool_idx, first:end]
                self.token_to_kv_pool_allocator.free(slots.to(torch.int64))
            req.kv.kv_allocated_len = start

    # ------------------------------------------------------------------ observability
    def sp_maybe_log(self) -> None:
        stats = self.sp.stats
        if self.sp_metrics is not None and stats.decode_iterations:
            self.sp_metrics.update(stats.as_dict())
        interval = self.spexis_config.log_interval
        if interval <= 0 or not self.sp.rank0:
            return
        now = time.monotonic()
        if now - self.sp_last_log < interval:
            return
        if stats.decode_iterations == self.sp_last_logged_iterations:
            return  # nothing new to say (idle)
        self.sp_last_log = now
        self.sp_last_logged_iterations = stats.decode_iterations
        s = stats.as_dict()
        logger.info(
            "".join(f"[BENCHMARK {m.replace('_', ' ')}] " for m in self._sp_benchmark_modes())
            + "Spexis: acceptance %.3f, tokens/row %.3f, rows/iter %.1f, tokens/iter %.2f, "
            "normal %d, spec %d, stale %d, dropped %d, alpha %.2f, delayed admissions %d",
            s["acceptance_rate"],
            s["effective_batch_ratio"],
            s["avg_rows_per_decode_iteration"],
            s["avg_tokens_per_decode_iteration"],
            s["rows_normal"],
            s["rows_spec"],
            s["rows_stale"],
            s["drafts_dropped"],
            s["alpha"],
            s["admissions_delayed"],
        )

    def _sp_benchmark_modes(self) -> List[str]:
        """The benchmark-only modes this server runs in (labels for logs and metrics)."""
        cfg = self.spexis_config
        modes = []
        if cfg.force_accept is not None:
            modes.append("forced_acceptance")
        if cfg.length_oracle is not None:
            modes.append("length_oracle")
        return modes

    def get_internal_state(self, recv_req):
        ret = super().get_internal_state(recv_req)
        if self.sp_enabled and self.sp is not None:
            ret.internal_state["spexis"] = self.sp.stats.as_dict()
            if self.sp.alpha is not None:
                ret.internal_state["spexis_alpha"] = self.sp.alpha.as_dict()
            if self.sp_length_oracle is not None:
                ret.internal_state[LENGTH_ORACLE_LABEL] = self.sp_length_oracle.as_dict()
        elif getattr(self, "stock_pp_timers", None) is not None:
            # a plain PP server under SPEXIS_PHASE_TIMERS=1: stock event_loop_pp by phase
            ret.internal_state["spexis"] = self.stock_pp_timers.as_dict()
        if self.sp_gpu_timer is not None:
            ret.internal_state["spexis_gpu_forward_ms"] = self.sp_gpu_timer.as_dict()
        return ret
