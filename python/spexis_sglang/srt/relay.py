"""The stage-to-stage relay of requests and stage 0's plan over a local zmq pipe.

Every loop iteration, stage ``k`` relays what it received (and, from stage 0, the iteration's
:class:`~spexis_sglang.srt.protocol.SpexisPlan`) to stage ``k + 1``, which blocks until it has
it. SGLang does this with ``point_to_point_pyobj`` over the gloo world group: even an empty relay
is a size tensor, a gloo ``isend`` and a ``wait``, ~0.1 ms of stage 0's CPU per iteration in the
server (~21 µs warm on the CPU box, against <1 µs for a zmq send). On one node the SP
loop relays through a zmq PUSH/PULL pair on an abstract ipc address instead: the same messages
in the same order, one pickle each, and the receiving stage still blocks until its message is
there.

Where SGLang's relay does more than one rank pair talking (several nodes, DP attention), the SP
loop keeps SGLang's relay. The ranks that relay (attention TP/CP rank 0 of each stage) set the
pipe up together when the loop starts: each later stage binds an address and sends it to the
stage before it over gloo, once.
"""

from __future__ import annotations

import logging
import os
import pickle
import uuid
from dataclasses import dataclass, fields
from typing import Optional

import zmq
from sglang.srt.managers.scheduler_components.request_receiver import (
    SchedulerRequestReceiver,
)
from sglang.srt.runtime_context import get_parallel
from sglang.srt.utils import point_to_point_pyobj

logger = logging.getLogger(__name__)

__all__ = [
    "RELAY_LOG_LINE",
    "LocalRelay",
    "PipeRequestReceiver",
    "local_relay_supported",
    "open_local_relay",
]

#: logged once by every rank that relays over the pipe (its PP rank follows)
RELAY_LOG_LINE = "Spexis: relaying requests over a local zmq pipe, PP rank"


@dataclass(kw_only=True, slots=True, frozen=True)
class PipeRequestReceiver(SchedulerRequestReceiver):
    """SGLang's receiver on a later stage, pulling the relay from the local pipe (blocking)
    instead of gloo; the rest of ``recv_requests`` (TP broadcast, hooks) is SGLang's."""

    relay_socket: zmq.Socket

    def _pull_raw_reqs(self):
        return pickle.loads(self.relay_socket.recv())

    @classmethod
    def wrapping(cls, receiver: SchedulerRequestReceiver, socket: zmq.Socket):
        kwargs = {f.name: getattr(receiver, f.name) for f in fields(receiver)}
        return cls(**kwargs, relay_socket=socket)


class LocalRelay:
    """One stage's ends of the pipe: ``send`` to the next stage, ``incoming`` from the one
    before (either may be None: the last stage sends nothing, stage 0 receives from the
    tokenizer)."""

    def __init__(self, send_socket: Optional[zmq.Socket], incoming: Optional[zmq.Socket]):
        self._send_socket = send_socket
        self.incoming = incoming

    @property
    def sends(self) -> bool:
        return self._send_socket is not None

    def send(self, payload: list) -> None:
        self._send_socket.send(pickle.dumps(payload, protocol=pickle.HIGHEST_PROTOCOL))


def local_relay_supported(nnodes: int, pp_size: int, dp_attention: bool) -> bool:
    """One node, several stages, no DP attention: the relay is one rank pair per stage
    boundary, on this machine."""
    return nnodes == 1 and pp_size > 1 and not dp_attention


def open_local_relay(scheduler) -> Optional[LocalRelay]:
    """Set up this rank's ends of the pipe (every relaying PP rank calls it at the same point of
    its loop's start); None where SGLang's relay stays (see :func:`local_relay_supported`) or on
    ranks that do not relay (attention TP/CP rank > 0)."""
    ps = scheduler.ps
    dp_attention = bool(get_parallel().enable_dp_attention)
    if not local_relay_supported(scheduler.server_args.nnodes, ps.pp_size, dp_attention):
        return None
    if ps.attn_tp_rank != 0 or ps.attn_cp_rank != 0:
        return None
    group = scheduler.world_group.cpu_group
    me = ps.pp_rank * ps.tp_size
    context = zmq.Context.instance()
    incoming = None
    if ps.pp_rank > 0:
        incoming = context.socket(zmq.PULL)
        incoming.setsockopt(zmq.LINGER, 0)
        address = f"ipc://@spexis-relay-{os.getpid()}-{uuid.uuid4().hex}"
        incoming.bind(address)
        # tell the stage before where to send (blocks until it has read it)
        point_to_point_pyobj([address], me, group, src=me, dst=(ps.pp_rank - 1) * ps.tp_size)
    send_socket = None
    if ps.pp_rank < ps.pp_size - 1:
        (address,) = point_to_point_pyobj([], me, group, src=(ps.pp_rank + 1) * ps.tp_size, dst=me)
        send_socket = context.socket(zmq.PUSH)
        send_socket.setsockopt(zmq.LINGER, 0)
        send_socket.connect(address)
    logger.info("%s %d", RELAY_LOG_LINE, ps.pp_rank)
    return LocalRelay(send_socket, incoming)
