"""Setting up the SP loop: its state record, and what stage 0 alone holds (the alpha controller,
the draft log, the benchmark-only length oracle), the local request relay, the same-GPU link,
the developer aids (loop profiler, GPU forward timers). Everything here runs once, when the
scheduler's PP event loop starts.
"""

from __future__ import annotations

import functools
import logging
import time
from typing import TYPE_CHECKING, Optional

import numpy as np
import torch
from sglang.srt.runtime_context import get_observability, get_parallel

from spexis_sglang.core.slot_state import SlotState
from spexis_sglang.srt import sp_grammar
from spexis_sglang.srt.config import (
    ENV_ALPHA_LOG,
    ENV_DRAFT_LOG,
    ENV_GPU_TIMERS,
    ENV_PP_TRANSPORT,
    ENV_PROFILE_LOOP,
    env_flag,
    env_value,
    share_gpu_mode,
)
from spexis_sglang.srt.host_staging import HostReadback, HostStaging
from spexis_sglang.srt.prefill_adder import SPRunningBatch
from spexis_sglang.srt.profiling import DraftLog
from spexis_sglang.srt.protocol import FORCED_LABEL
from spexis_sglang.srt.relay import PipeRequestReceiver, open_local_relay
from spexis_sglang.srt.request_poll import nothing_queued_check, receives_multimodal_waiting
from spexis_sglang.srt.sp_alpha import AlphaController
from spexis_sglang.srt.sp_emit import SlotEmit
from spexis_sglang.srt.sp_forced import ForcedAcceptance
from spexis_sglang.srt.sp_length_oracle import make_length_oracle
from spexis_sglang.srt.sp_records import SPLoopState
from spexis_sglang.srt.sp_sampling import SlotSampling
from spexis_sglang.srt.stats import GpuForwardTimer

if TYPE_CHECKING:
    from spexis_sglang.srt.sp_scheduler import SpexisScheduler

logger = logging.getLogger(__name__)


class SPSetupMixin:
    """Setting up the SP loop when the PP event loop starts. (A mixin of
    :class:`~.sp_scheduler.SpexisScheduler`.)"""

    def init_sp_state(self: SpexisScheduler) -> None:
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
            running=SPRunningBatch(reqs=[], batch_is_full=False),
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
            mixable=np.zeros(capacity, dtype=bool),
            transit_row=np.zeros(capacity, dtype=np.int64),
        )
        if self.sp.rank0:
            self.sp.draft_by_slot = torch.zeros(capacity, dtype=torch.int64, device=device)
            self.sp.model = self.tp_worker.model_runner.model
        # The device redoes a row where the transit batch rejects its chain only if the
        # attention backend reads the batch's lengths on the device (on a CPU the host values
        # are fixed up too): otherwise such rows simply go stale.
        backend = getattr(self.tp_worker.model_runner, "attn_backend", None)
        on_cpu = torch.device(device).type == "cpu"
        self.sp.redo_rows = on_cpu or not getattr(backend, "needs_cpu_seq_lens", True)
        if not self.sp.redo_rows:
            logger.warning(
                "Spexis: the attention backend %s reads sequence lengths on the host; rows "
                "built on a draft the transit batch rejects are not redone on the device "
                "(they go stale: fewer tokens per row, outputs unchanged)",
                type(backend).__name__,
            )
        if self.sp.alpha is not None:
            self.sp.alpha.update_stats(self.sp.stats)
        # --enable-mixed-chunk: SP rows ride along prefill chunks (sp_mixed); SGLang's own
        # mixing, which would merge its running batch, stays off
        self.sp.mixed_chunk = bool(self.is_mixed_chunk)
        self.is_mixed_chunk = False
        # Stock abort handling scans running_mbs and mbs for in-flight requests.
        self.running_mbs = [self.sp.running] * self.pp_loop_size
        self.sp.last_log = time.monotonic()
        if self.sp.rank0 and get_observability().enable_metrics:
            from spexis_sglang.srt.metrics import SpexisMetrics

            self.sp.metrics = SpexisMetrics(
                self.metrics_collector.labels, benchmark_modes=self._sp_benchmark_modes()
            )
        # stage 0: skip SGLang's receive when its sockets hold nothing (request_poll)
        self.sp.nothing_queued = nothing_queued_check(
            self.request_receiver,
            dp_attention=bool(get_parallel().enable_dp_attention),
            mm_waiting=receives_multimodal_waiting(),
        )
        # the relay between stages over a local zmq pipe where it can be (relay.py)
        self.sp.relay = open_local_relay(self)
        if self.sp.relay is not None and self.sp.relay.incoming is not None:
            self.request_receiver = PipeRequestReceiver.wrapping(
                self.request_receiver, self.sp.relay.incoming
            )
        draft_log = env_value(ENV_DRAFT_LOG)
        self.sp.draft_log = (
            DraftLog(draft_log) if draft_log and self.sp.rank0 and self.ps.tp_rank == 0 else None
        )
        # with one TP rank (the LM head's collectives need every rank to agree) and nobody
        # reading every draft, stage 0 skips the drafts nothing would use
        self.sp.skip_unused_drafts = (
            self.sp.rank0
            and self.ps.tp_size == 1
            and not get_parallel().enable_dp_attention
            and self.sp.draft_log is None
            and getattr(self.sp.model, "spexis_deferred_drafts", False)
            and not self.sp.model.spexis_traces_drafts
        )
        # benchmark only (--spexis-benchmark-length-oracle): stage 0's buckets from the truth
        if self.sp.rank0:
            self.sp.length_oracle = make_length_oracle(
                cfg.length_oracle, capacity, self.server_args.random_seed or 0
            )
        if self.sp.length_oracle is not None:
            logger.warning(self.sp.length_oracle.log_line())
        self.sp.admission_gate = self._sp_make_admission_gate()
        # constrained decoding: stage 0 masks the drafts with the rows' grammars (sp_grammar)
        self.sp.grammar_draft_mask = self.sp.rank0 and sp_grammar.draft_masking_enabled(
            self.spexis_config, self.server_args
        )

    def _sp_make_alpha_controller(
        self: SpexisScheduler, capacity: int
    ) -> Optional[AlphaController]:
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
        controller = AlphaController(
            capacity,
            depth=self.pp_loop_size,
            num_stages=self.ps.pp_size,
            alpha=cfg.alpha,
            auto=cfg.alpha_auto,
            interval=cfg.alpha_interval,
            explore=cfg.alpha_explore,
            observe_every=cfg.alpha_observe,
        )
        log_path = env_value(ENV_ALPHA_LOG)
        if log_path and self.ps.tp_rank == 0:
            controller.sample_log = open(log_path, "a", buffering=1)  # line by line
        return controller

    def _sp_open_link(self: SpexisScheduler):
        """The link of the PP tensor messages, stock PP's and SP's alike (``stage_link``).

        ``SPEXIS_PP_TRANSPORT=ipc``: every PP rank on one GPU, through CUDA IPC; ``packed``:
        every PP rank on one host, one buffer a message; ``nccl``: SGLang's transport. Unset,
        an SP server takes ``packed`` where it applies (one host, TP 1) and a plain server
        keeps SGLang's; None means SGLang's."""
        transport = env_value(ENV_PP_TRANSPORT)
        chosen = transport not in (None, "")
        if not chosen:
            transport = "packed" if self.sp_enabled else "nccl"
        if transport not in ("ipc", "packed"):
            if transport != "nccl":
                logger.warning(
                    "%s=%s is none of ipc, packed, nccl: using SGLang's transport",
                    ENV_PP_TRANSPORT,
                    transport,
                )
            return None
        if self.ps.tp_size > 1 or get_parallel().enable_dp_attention:
            if chosen:
                logger.warning(
                    "%s=%s supports TP=1 without DP attention: using SGLang's transport",
                    ENV_PP_TRANSPORT,
                    transport,
                )
            return None
        from spexis_sglang.srt.stage_link import PackedLink, SameGpuLink, proxy_slot_bytes

        if transport == "packed":
            return PackedLink.open(self.pp_group, self.req_to_token_pool.device, chosen)
        if not (share_gpu_mode() and torch.cuda.is_available() and torch.cuda.device_count() == 1):
            logger.warning("%s=ipc needs every PP rank on one GPU: using NCCL", ENV_PP_TRANSPORT)
            return None

        slot = proxy_slot_bytes(
            self.max_running_requests, self.model_config.hidden_size, self.model_config.dtype
        )
        return SameGpuLink.open(self.pp_group, slot)

    @functools.cached_property
    def sp_gpu_timer(self: SpexisScheduler) -> Optional[GpuForwardTimer]:
        """``SPEXIS_GPU_TIMERS=1`` on a GPU: this rank's decode forwards timed on the device
        (stock servers started by the launcher too)."""
        if not env_flag(ENV_GPU_TIMERS) or not torch.cuda.is_available():
            return None
        return GpuForwardTimer(f"pp rank {self.ps.pp_rank}, tp rank {self.ps.tp_rank}")

    def maybe_loop_profiler(self: SpexisScheduler):
        """``SPEXIS_PROFILE_LOOP=PREFIX``: cProfile this rank's loop (developer aid)."""
        prefix = env_value(ENV_PROFILE_LOOP)
        if not prefix:
            return None
        from spexis_sglang.srt.profiling import LoopProfiler, profile_stock_loop

        path = f"{prefix}.pp{self.ps.pp_rank}.tp{self.ps.tp_rank}.prof"
        if not self.sp_enabled:  # stock SGLang's loop
            return profile_stock_loop(self, path)
        return LoopProfiler(path)
