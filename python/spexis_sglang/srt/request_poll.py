"""Stage 0's "did anything arrive?" check, before SGLang's full receive.

SGLang's ``SchedulerRequestReceiver.recv_requests`` runs every loop iteration. On stage 0 of a
single-rank stage it reads the tokenizer and RPC sockets until each raises ``zmq.Again`` and
then walks the (empty) list through its unwrap, multimodal and shared-memory steps: ~0.1 ms of
CPU per iteration in the server, for nothing in almost every decode iteration. Reading the
sockets' ``ZMQ_EVENTS`` first (level-triggered: a queued message shows as ``POLLIN``) skips all
of it when nothing is queued.

The check is offered only where ``recv_requests`` does nothing else with an empty socket: stage 0
(``pp_rank == 0``) with a single attention-TP/CP rank and TP size 1 (no broadcast that other ranks
wait in), no DP attention, zmq sockets (not the Rust server or a scripted test proxy), and none of
SGLang's receive-side hooks (``--scheduler-recv-interval``'s skipper, the colocated-batch input
blocker, the scripted scheduler hook, the EPD multimodal receiver, which may release waiting
requests with no new input).
"""

from __future__ import annotations

from typing import Callable, Optional

import zmq
from sglang.srt.runtime_context import get_disagg

__all__ = ["nothing_queued_check", "receives_multimodal_waiting"]


def receives_multimodal_waiting() -> bool:
    """SGLang's EPD multimodal receiver is on: ``recv_requests`` may release requests that
    waited for their encoder outputs even when nothing new arrived."""
    disagg = get_disagg()
    return bool(disagg.language_only) and disagg.encoder_transfer_backend in (
        "zmq_to_scheduler",
        "mooncake",
    )


def nothing_queued_check(
    receiver, dp_attention: bool, mm_waiting: bool
) -> Optional[Callable[[], bool]]:
    """A function that says True when ``receiver.recv_requests()`` would return ``[]`` without
    side effects (nothing queued on its sockets), or None where that cannot be told cheaply.

    ``dp_attention``: DP attention is on (requests are split and broadcast); ``mm_waiting``:
    :func:`receives_multimodal_waiting`."""
    ps = receiver.ps
    if ps.pp_rank != 0 or ps.tp_size != 1 or ps.attn_tp_size != 1 or ps.attn_cp_size != 1:
        return None
    if dp_attention or mm_waiting:
        return None
    if (
        receiver.recv_skipper is not None
        or receiver.input_blocker is not None
        or receiver.scripted_scheduler_hook is not None
    ):
        return None
    sockets = [receiver.recv_from_tokenizer, receiver.recv_from_rpc]
    sockets = [s for s in sockets if s is not None]
    if not sockets or not all(isinstance(s, zmq.Socket) for s in sockets):
        return None
    # plain ints: ``int & zmq.POLLIN`` (an IntFlag) runs enum's Python ``__rand__``
    pollin = int(zmq.POLLIN)
    events = int(zmq.EVENTS)

    def nothing_queued() -> bool:
        for s in sockets:
            if s.getsockopt(events) & pollin:
                return False
        return True

    return nothing_queued
