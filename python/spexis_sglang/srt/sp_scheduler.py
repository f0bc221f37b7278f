"""Speculative parallelism inside SGLang 0.5.17's pipeline-parallel event loop.

``SpexisScheduler`` subclasses SGLang's ``Scheduler``. With a draft head configured and
``--pp-size >= 2`` it replaces ``event_loop_pp`` with :meth:`~.sp_loop.SPLoopMixin.event_loop_sp`;
otherwise it is plain SGLang. This module holds what overrides SGLang's methods; the SP loop's
concerns live in mixins, each typed ``self: SpexisScheduler`` as SGLang's own mixins are:

==================  ===============================================================
``sp_setup``        the loop's state record and stage 0's helpers, built once
``sp_loop``         the loop as named steps: schedule, collect, launch, send, verify
``sp_batch``        a decode batch: rows, selection, alternatives, the ScheduleBatch
``sp_memory``       the rows' KV memory: new slots, fitting to memory, retraction
``sp_mixed``        SP rows riding along a prefill chunk (``--enable-mixed-chunk``)
``sp_drafts``       stage 0's drafts on the device and the host
``sp_verify``       returned results: verdicts, committed tokens, releases, KV freed
``sp_admission``    look-ahead admission's count per iteration
``sp_observe``      the statistics line and the Prometheus series
``sp_records``      the records: loop state, launch plan, drafts and outputs in transit
==================  ===============================================================

How an iteration differs from stock PP (docs/design.md §2)
-----------------------------------------------------------
Stock PP splits the running requests into N micro-batches, so a request advances one token
every N iterations. Here every running request may ride every iteration: when a request's
newest row has just been launched, stage 0's draft head has already produced a draft for the
next position, and the request's next row is a *speculative* row on that draft. The row's
true token comes back from the last stage N iterations later, and
:class:`spexis_sglang.core.slot_state.SlotState` (epochs, not flags; arrays indexed by the
request's slot, one numpy pass per batch) decides whether the rows built on the draft stand or
are stale. Iteration b is launched (and its proxy sent) before the results of b - N are
processed on the host: they reach the device meanwhile, and a row whose chain they reject is
run by the device as the normal row the rejection asks for (``SlotState``'s conditional
launches), so the host's work stays off the pipeline's critical path.

Every PP rank runs this scheduler on mirrored state and builds the same batches:

* requests arrive through SGLang's own relay (stage k forwards what stage k-1 received);
* prefill admission is SGLang's own (mirrored allocator and radix cache);
* the decode rows come from ``SlotState.next_rows``: which rows exist depends only on what was
  launched and verified, never on a draft's value, so later stages launch speculative rows
  with a placeholder token (only stage 0 embeds input tokens, from its latest drafts on the
  device), and run a redone row where stage 0's positions (sent with the proxy) say;
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
(``sp_flush_tokens`` before request handling, admission and retraction). Only the last stage
builds sampling state.

KV (docs/design.md §4): a row at position p writes the request's own slot for p; a rejected
row's slot is overwritten when the request re-executes p. Only verified tokens reach
``output_ids`` and the radix cache (``kv_committed_len`` = last valid row's position + 1). A
finished request keeps its slots until its in-flight rows have drained
(``SlotState.pop_drained``).
"""

from __future__ import annotations

import logging
from typing import Optional

import numpy as np
from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
from sglang.srt.managers.scheduler import Scheduler
from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode

from spexis_sglang.srt import sp_grammar
from spexis_sglang.srt.config import ENV_PROFILE_RANGES, SpexisConfig, env_flag, get_config
from spexis_sglang.srt.input_validation import request_input_error
from spexis_sglang.srt.profiling import SP_RANGE_METHODS, ProfilerRanges
from spexis_sglang.srt.protocol import FORCE_ACCEPT_PARAM, FORCED_LABEL, PROXY_RETURNED
from spexis_sglang.srt.request_checks import hidden_states_error
from spexis_sglang.srt.sp_admission import SPAdmissionMixin
from spexis_sglang.srt.sp_batch import SPBatchMixin
from spexis_sglang.srt.sp_drafts import SPDraftsMixin
from spexis_sglang.srt.sp_forced import force_accept_param_error
from spexis_sglang.srt.sp_length_oracle import LENGTH_ORACLE_LABEL
from spexis_sglang.srt.sp_loop import SPLoopMixin
from spexis_sglang.srt.sp_memory import SPMemoryMixin
from spexis_sglang.srt.sp_mixed import SPMixedMixin
from spexis_sglang.srt.sp_observe import SPObserveMixin
from spexis_sglang.srt.sp_records import SPLoopState
from spexis_sglang.srt.sp_setup import SPSetupMixin
from spexis_sglang.srt.sp_verify import SPVerifyMixin
from spexis_sglang.srt.stage_link import link_name
from spexis_sglang.srt.stats import (
    STOCK_PP_RANGE_METHODS,
    StockPPPhaseTimers,
    log_rank_state,
    phase_timers_enabled,
    rank_state_logging_enabled,
    spexis_state,
)

logger = logging.getLogger(__name__)

__all__ = ["FORCE_ACCEPT_PARAM", "FORCED_LABEL", "SpexisScheduler"]


class SpexisScheduler(
    SPLoopMixin,
    SPBatchMixin,
    SPMemoryMixin,
    SPMixedMixin,
    SPDraftsMixin,
    SPVerifyMixin,
    SPAdmissionMixin,
    SPSetupMixin,
    SPObserveMixin,
    Scheduler,
):
    """SGLang's scheduler with speculative parallelism on PP ranks (see the module docstring)."""

    def __init__(self, *args, **kwargs):
        self.spexis_config: SpexisConfig = get_config()
        self.sp: Optional[SPLoopState] = None
        super().__init__(*args, **kwargs)

    # ------------------------------------------------------------------ set-up
    @property
    def sp_enabled(self) -> bool:
        return self.spexis_config.enabled and self.ps.pp_size > 1

    def init_tp_model_worker(self):
        if not self.spexis_config.enabled:
            return super().init_tp_model_worker()
        # the worker's model runner grows stage 0's KV pool by the head's layers (imported
        # here: draft_runner pulls in SGLang's model runner)
        from spexis_sglang.srt.draft_runner import SpexisTpModelWorker

        self.tp_worker = SpexisTpModelWorker(
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
            if env_flag(ENV_PROFILE_RANGES):
                ProfilerRanges(self, STOCK_PP_RANGE_METHODS)
            self.maybe_loop_profiler()
            return super().event_loop_pp()
        if env_flag(ENV_PROFILE_RANGES):
            ProfilerRanges(self, SP_RANGE_METHODS)
        return self.event_loop_sp()

    def _pp_send_dict_to_next_stage(self, tensor_dict, async_send=True, msg_type="default"):
        link = getattr(self, "sp_link", None)
        if link is None:
            return super()._pp_send_dict_to_next_stage(tensor_dict, async_send, msg_type)
        tensor_dict["__msg_type__"] = msg_type
        return link.send(tensor_dict)

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

    def _pp_prepare_tensor_dict(self, result, batch):
        tensor_dict = super()._pp_prepare_tensor_dict(result, batch)
        # The last rank sends each row's draft back with its true token.
        record = self.sp.record(batch) if self.sp is not None else None
        extras = record.extras if record is not None else {}
        for k in PROXY_RETURNED:
            if k in extras:
                tensor_dict[k] = extras[k]
        return tensor_dict

    # ------------------------------------------------------------------ launch and results
    def run_batch(self, batch: ScheduleBatch, pp_proxy_tensors=None):
        """SGLang's ``run_batch`` (a batch of SP rows first completed on the device: drafts,
        redone rows, a mixed batch's token ids); then, on stage 0, its drafts are made (where
        wanted: ``_sp_make_drafts``) and their copy to the host is queued at once, still inside
        the launch's forward-stream context (entering that context again costs the scheduler
        two stream switches per iteration)."""
        timer = self.sp_gpu_timer
        timed = timer is not None and batch.forward_mode.is_decode()
        if timed:
            timer.poll()
            stream = self.sp_forward_stream()
            start = timer.start(stream)
        record = self.sp.record(batch) if self.sp is not None else None
        has_rows = record is not None and record.has_rows
        if has_rows:
            if record.mixed:
                self.sp_resolve_mixed(batch)
            else:
                self._sp_resolve_rows(batch)
        result = super().run_batch(batch, pp_proxy_tensors)
        if has_rows and record.mixed:
            # the prefill's results are processed on its own batch (SGLang reads these)
            record.prefill.forward_iter = batch.forward_iter
            record.prefill.launch_ts = batch.launch_ts
        if self.sp is not None and self.sp.rank0:
            self._sp_make_drafts(batch, result, record)
            if has_rows:
                self._sp_start_draft_readback(batch, result)
        if timed:
            timer.stop(start, len(batch.reqs), batch.seq_lens_sum, stream)
        return result

    def sp_forward_stream(self):
        """The stream SGLang runs a batch's forward on, where it is not the current one:
        the overlap scheduler's forward stream (PP=1 stock servers); None otherwise."""
        return self.forward_stream if self.enable_overlap else None

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

    def get_internal_state(self, recv_req):
        ret = super().get_internal_state(recv_req)
        if self.sp_enabled and self.sp is not None:
            ret.internal_state["spexis"] = spexis_state(self.sp.stats, self.sp.phases)
            if self.sp.alpha is not None:
                ret.internal_state["spexis_alpha"] = self.sp.alpha.as_dict()
            if self.sp.length_oracle is not None:
                ret.internal_state[LENGTH_ORACLE_LABEL] = self.sp.length_oracle.as_dict()
        elif getattr(self, "stock_pp_timers", None) is not None:
            # a plain PP server under SPEXIS_PHASE_TIMERS=1: stock event_loop_pp by phase
            ret.internal_state["spexis"] = self.stock_pp_timers.as_dict()
        if self.sp_gpu_timer is not None:
            ret.internal_state["spexis_gpu_forward_ms"] = self.sp_gpu_timer.as_dict()
        if self.ps.pp_size > 1:
            ret.internal_state["spexis_pp_link"] = link_name(getattr(self, "sp_link", None))
        state = ret.internal_state
        if "spexis" in state and self.ps.pp_rank > 0 and self.ps.tp_rank == 0:
            if rank_state_logging_enabled():  # this reply is dropped: log it instead
                keys = ("spexis", "spexis_gpu_forward_ms", "spexis_pp_link")
                logged = {k: state[k] for k in keys if k in state}
                log_rank_state(f"pp rank {self.ps.pp_rank}", logged)
        return ret
