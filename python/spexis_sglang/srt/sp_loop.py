"""The SP event loop, one screen of named steps (see :meth:`SPLoopMixin.event_loop_sp`):
schedule (receive requests, build the batch, relay both), collect (the transit batch's outputs
reach the device), launch, send (the proxy down the pipe, or the outputs back to stage 0),
verify (the transit batch's results on the host); and the relay of requests and plans.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Optional, Tuple

from sglang.srt.managers import io_struct
from sglang.srt.managers.schedule_batch import ScheduleBatch
from sglang.srt.model_executor.forward_batch_info import PPProxyTensors
from sglang.srt.utils import DynamicGradMode

from spexis_sglang.srt.protocol import (
    PROXY_POSITIONS,
    PROXY_PREFIX,
    PROXY_STAGE0_ONLY,
    SpexisPlan,
    relay_payload,
)
from spexis_sglang.srt.sp_records import LaunchPlan, TransitOutputs

if TYPE_CHECKING:
    from spexis_sglang.srt.sp_scheduler import SpexisScheduler

logger = logging.getLogger(__name__)

#: requests SGLang serves only on an idle scheduler: they flush the KV cache (a weight update
#: asserts that its flush succeeded) or move it
NEEDS_IDLE = tuple(
    getattr(io_struct, name)
    for name in (
        "FlushCacheReqInput",
        "UpdateWeightFromDiskReqInput",
        "UpdateWeightsFromDistributedReqInput",
        "UpdateWeightsFromTensorReqInput",
        "UpdateWeightsFromIPCReqInput",
        "ReleaseMemoryOccupationReqInput",
        "ClearHiCacheReqInput",
        "AttachHiCacheStorageReqInput",
        "DetachHiCacheStorageReqInput",
    )
    if hasattr(io_struct, name)
)


def _decode_or_none(batch: Optional[ScheduleBatch]) -> bool:
    return batch is None or batch.forward_mode.is_decode()


class SPLoopMixin:
    """The SP event loop and the request relay between stages. (A mixin of
    :class:`~.sp_scheduler.SpexisScheduler`.)"""

    @DynamicGradMode()
    def event_loop_sp(self: SpexisScheduler):
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
        profiler = self.maybe_loop_profiler()
        while True:
            if profiler is not None:
                profiler.tick()
            server_is_idle = True
            for mb_id in range(self.pp_loop_size):
                if self.sp_iteration(mb_id):
                    server_is_idle = False
            # (SGLang's on_idle sleeps until a request arrives: not while one is held)
            if server_is_idle and not self.sp.held_requests:
                self.on_idle()
            self.sp_maybe_log()

    def sp_iteration(self: SpexisScheduler, mb_id: int) -> bool:
        """One iteration on micro-batch slot ``mb_id``: schedule, collect, launch, send,
        verify. Returns whether it launched a batch (the contract test drives the loop
        through this, with the stages and the device scripted)."""
        sp = self.sp
        timer = sp.phases
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
            timer.commit(decode_only=_decode_or_none(cur_batch) and _decode_or_none(transit))
        else:
            timer.discard()  # idle
        return bool(cur_batch)

    def _sp_schedule(
        self: SpexisScheduler, transit: Optional[ScheduleBatch]
    ) -> Optional[ScheduleBatch]:
        """Receive requests, build this iteration's batch, relay both to the next stage."""
        recv_reqs, plan_in = self._sp_recv_requests()
        if self.sp.rank0:
            recv_reqs = self._sp_hold_for_idle(recv_reqs)
        if recv_reqs:
            # a request handler may read the running requests' output
            self.sp_flush_tokens()
        self.process_input_requests(recv_reqs)
        cur_batch, plan_out = self.sp_get_next_batch(plan_in, transit)
        self.cur_batch_for_debug = cur_batch
        self._sp_relay_requests(recv_reqs, plan_out)
        return cur_batch

    def _sp_hold_for_idle(self: SpexisScheduler, recv_reqs: list) -> list:
        """Stage 0 holds a request that SGLang serves only on an idle scheduler
        (``NEEDS_IDLE``: ``/flush_cache``, the weight updates) while the last batches drain,
        and every request received after it, then passes them on in order; the later stages
        get them relayed in the iteration stage 0 serves them, when they are idle too.

        Why: after a request's last token, the rows it launched on drafts are in flight for
        up to N more iterations, where stock SGLang's loop is idle once the request is
        answered. Without the hold a flush sent right after a request failed ("pending
        requests") and a weight update stopped the server (SGLang asserts that its flush
        succeeded). With requests running or queued the request goes on at once, and SGLang
        answers it as it would without SP.
        """
        held = self.sp.held_requests
        if not held:
            first = next((i for i, r in enumerate(recv_reqs) if isinstance(r, NEEDS_IDLE)), -1)
            if first < 0 or self._sp_busy() or self._sp_idle():
                return recv_reqs
            held.extend(recv_reqs[first:])
            return recv_reqs[:first]
        held.extend(recv_reqs)
        if not self._sp_idle():
            return []
        released = list(held)
        held.clear()
        return released

    def _sp_busy(self: SpexisScheduler) -> bool:
        """Requests are running (not merely answered, awaiting their release), queued or
        being prefilled."""
        if self.waiting_queue or self.chunked_req is not None:
            return True
        return any(not req.finished() for req in self.sp.running.reqs)

    def _sp_idle(self: SpexisScheduler) -> bool:
        """SGLang's idleness, and no released request's rows still draining."""
        return not self.sp.draining and self.is_fully_idle()

    def _sp_collect(
        self: SpexisScheduler, transit: Optional[ScheduleBatch], transit_id: int
    ) -> Optional[TransitOutputs]:
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
            outputs = TransitOutputs(tensors, len(transit.reqs), sp.output_readback)
        record = sp.record(transit)
        if not record.decode or transit.return_logprob:
            # SGLang's own result record (prefill results, logprobs), as stock PP makes it
            # (of a mixed batch: its prefill's)
            batch, tensors = transit, outputs.tensors
            if record.mixed:
                batch = record.prefill
                tensors = self.sp_mixed_prefill_outputs(tensors, record.rows_offset)
            with self.copy_stream_ctx:
                self.copy_stream.wait_stream(self.schedule_stream)
                outputs.batch_result = self._pp_prep_batch_result(
                    batch, self.mb_metadata[transit_id], PPProxyTensors(tensors)
                )
                outputs.result_event = self.device_module.Event()
                outputs.result_event.record(self.device_module.current_stream())
        return outputs

    def _sp_launch(
        self: SpexisScheduler, mb_id: int, batch: ScheduleBatch, outputs: Optional[TransitOutputs]
    ):
        """Launch ``batch`` (later stages first receive the previous stage's proxy)."""
        pp_proxy_tensors = self._pp_recv_proxy_tensors()
        if pp_proxy_tensors is not None:
            # a CUDA-graph replay upstream pads them to its batch bucket
            n = len(batch.reqs)
            self.sp.record(batch).extras = {
                k: v[:n] for k, v in pp_proxy_tensors.tensors.items() if k.startswith(PROXY_PREFIX)
            }
        plan: Optional[LaunchPlan] = self.sp.record(batch).launch
        if plan is not None:
            plan.transit = outputs
        # the previous proxy's send reads a CUDA graph's outputs, which this launch overwrites
        self._pp_commit_comm_work(self.send_proxy_work)
        result, self.launch_event = self._pp_launch_batch(
            mb_id, batch, pp_proxy_tensors, self.mb_metadata, self.last_rank_comm_queue
        )
        self.sp_after_launch(batch, result)
        return result

    def _sp_send(self: SpexisScheduler, batch: ScheduleBatch, result) -> None:
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
            TransitOutputs(tensors.tensors, len(batch.reqs), self.sp.output_readback)
        )

    def _sp_verify(self: SpexisScheduler, transit: ScheduleBatch, outputs: TransitOutputs) -> None:
        """The transit batch's results on the host: verdicts, tokens, finished requests."""
        if outputs.result_event is not None:
            outputs.result_event.synchronize()
        self.sp_process_result(transit, outputs)
        self.sp.batches.pop(id(transit), None)

    def _sp_recv_requests(self: SpexisScheduler) -> Tuple[list, Optional[SpexisPlan]]:
        """This iteration's requests, and stage 0's plan (later stages)."""
        nothing_queued = self.sp.nothing_queued
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

    def _sp_relay_requests(self: SpexisScheduler, recv_reqs: list, plan_out: SpexisPlan) -> None:
        """Stage 0 relays the requests *after* scheduling, with its decisions.

        A plan that decides nothing is left out (the next stage reads a missing plan as an
        empty one), so a steady decode iteration relays ``[]`` as stock SGLang does: one
        size message instead of a pickle and two messages (~0.1 ms of stage 0's CPU). On one
        node the relay goes over a local zmq pipe (``relay.py``), not gloo."""
        if self.pp_group.is_last_rank:
            return
        relay = self.sp.relay
        if relay is not None and relay.sends:
            relay.send(relay_payload(recv_reqs, plan_out))
            return
        self._pp_commit_comm_work(self.send_req_work)
        self.send_req_work = self._pp_send_pyobj_to_next_stage(
            relay_payload(recv_reqs, plan_out), async_send=True
        )

    def _sp_send_proxy(self: SpexisScheduler, batch: ScheduleBatch, result) -> None:
        self.device_module.current_stream().wait_event(self.launch_event)
        tensors = dict(result.pp_hidden_states_proxy_tensors.tensors)
        for key in PROXY_STAGE0_ONLY:
            tensors.pop(key, None)
        record = self.sp.record(batch)
        positions = record.positions
        if positions is not None:  # stage 0 redid some rows: where each row ran
            tensors[PROXY_POSITIONS] = positions
        for k, v in record.extras.items():
            tensors.setdefault(k, v)
        self.send_proxy_work = self._pp_send_dict_to_next_stage(
            tensors, async_send=True, msg_type="proxy"
        )
