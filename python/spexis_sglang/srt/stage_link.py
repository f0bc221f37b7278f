"""The PP tensor messages (proxies, outputs) between stages on one host, two links:
:class:`SameGpuLink` for stages that share one GPU (CUDA IPC instead of sockets), and
:class:`PackedLink` for stages on any devices (one send a message, its layout over a local
pipe). Both serve stock PP's loop and SP's alike.

With every PP rank on one GPU (``SPEXIS_SHARE_GPU``), NCCL takes the ranks for different hosts
and sends over loopback sockets: each message is staged through host memory, which costs far
more than the NVLink a real multi-GPU box would use. On the emulated box (``mps``) that cost
would sit in every measurement, so ``SPEXIS_PP_TRANSPORT=ipc`` sends the PP tensor messages
(proxies, outputs) the way a same-GPU transport can:

* every rank owns an *inbox*: ``slots`` device buffers for the messages of the stage before it
  in the ring, opened by that stage through CUDA IPC at start-up, with two interprocess events
  per slot (``ready``: the sender's copy is in; ``free``: the receiver has copied it out);
* a send waits (on the device) for the slot's ``free`` event, copies the message's tensors
  into the slot, records ``ready`` and sends the message's layout over a local zmq pipe (SGLang
  sends every tensor dict's metadata over gloo, which cost ~0.8 ms a message on the GPU
  machine, against ~50 µs for NCCL's smallest message); a receive reads the layout, makes its
  stream wait for ``ready``, copies the tensors out into fresh tensors and records ``free``.
  Both sides stay in stream order: the host never waits for the device;
* a device wait on ``free`` orders the sender's copy after the receiver's only once the
  receiver has *recorded* it: a receiver ``slots`` messages behind would leave the sender
  waiting on the slot's previous record and overwriting a message not yet read. So the
  receiver acknowledges every message it has taken (a count over a second zmq pipe, once its
  ``free`` is recorded) and the sender reuses a slot only after that count says so, waiting
  on the host if the receiver is that far behind (``send_waits`` counts it; the PP loops keep
  fewer messages in flight than there are slots);
* a message too large for a slot (a long prefill chunk's proxy) goes over NCCL as before; the
  layout says which, and both kinds keep their order.

A message then costs two device copies and an event handshake on the device, and the layout's
small message on the host: measured one way on an H200 box, 127-139 us for 1-4 MB (NCCL over
loopback sockets: 0.3-1.2 ms), but 130-260 us for small messages, where NCCL takes 30-75 us
(the layout's pickling takes ~2 us and the zmq pipe tens of us; the rest of that floor is
not profiled yet). Stock PP and Spexis use the same link on the same box, so their comparison
stays fair.

:class:`PackedLink` keeps SGLang's device group for the bytes and drops the rest of its
per-message cost: measured on the H100 box, stage 0's send and output receive 0.33-0.55 ms
shorter an iteration over NCCL. An SP server uses it wherever it applies (every PP rank on one
host, TP 1) unless ``SPEXIS_PP_TRANSPORT`` says otherwise; a plain PP server uses it only when
``SPEXIS_PP_TRANSPORT=packed``.
"""

from __future__ import annotations

import logging
import math
import os
import pickle
import uuid
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import zmq
from sglang.srt.distributed.parallel_state import P2PWork

logger = logging.getLogger(__name__)

#: bytes between tensors in a slot (alignment for any dtype and vectorised copies)
_ALIGN = 256


def _aligned(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def _message_layout(
    tensor_dict: Dict[str, Any], packed: Callable[[torch.Tensor], bool]
) -> Tuple[List[Tuple[str, Any]], List[Tuple[int, torch.Tensor]], int]:
    """Where a message's tensors go in one buffer: its layout (per key, a ``packed`` tensor's
    offset, dtype and shape, or any other value as is), those tensors by offset, and the
    buffer's size. Offsets are aligned, so the receiver may view any dtype at them."""
    layout: List[Tuple[str, Any]] = []
    tensors: List[Tuple[int, torch.Tensor]] = []
    offset = 0
    for key, value in tensor_dict.items():
        if isinstance(value, torch.Tensor) and packed(value):
            t = value.contiguous()
            layout.append((key, ("t", offset, t.dtype, tuple(t.shape))))
            tensors.append((offset, t))
            offset = _aligned(offset + t.numel() * t.element_size())
        else:
            layout.append((key, ("v", value)))
    return layout, tensors, offset


def _unpack(layout: List[Tuple[str, Any]], buf: torch.Tensor, copy: bool) -> Dict[str, Any]:
    """The message of ``layout`` (see :func:`_message_layout`) from ``buf``: each tensor viewed
    at its offset, or a copy of it where the buffer is reused; every other value as is."""
    out: Dict[str, Any] = {}
    for key, spec in layout:
        if spec[0] == "v":
            out[key] = spec[1]
            continue
        _, off, dtype, shape = spec
        n = math.prod(shape) * dtype.itemsize
        if n == 0:
            out[key] = torch.empty(shape, dtype=dtype, device=buf.device)
            continue
        view = buf[off : off + n].view(dtype).view(shape)
        out[key] = view.clone() if copy else view
    return out


def _bound_pull(name: str) -> Tuple[zmq.Socket, str]:
    """A PULL socket bound to a fresh abstract ipc address (``name``, this pid, a uuid)."""
    sock = zmq.Context.instance().socket(zmq.PULL)
    sock.setsockopt(zmq.LINGER, 0)
    address = f"ipc://@{name}-{os.getpid()}-{uuid.uuid4().hex}"
    sock.bind(address)
    return sock, address


def _connected_push(address: str) -> zmq.Socket:
    sock = zmq.Context.instance().socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    return sock


class SameGpuLink:
    """The IPC link of one PP rank: its inbox, and the next rank's inbox opened for sending.

    Build it with :meth:`open` on every rank at the same point (it exchanges handles with the
    neighbours over ``group``: SGLang's pipeline ``GroupCoordinator``, or anything with its
    ``send_object``, ``recv_object``, ``world_size``, ``rank_in_group``, ``ranks`` and
    ``device_group``).
    """

    #: what ``/server_info`` calls this link (:func:`link_name`)
    name = "ipc"

    def __init__(self, group, slot_bytes: int, slots: int) -> None:
        self.group = group  # SGLang's GroupCoordinator of the pipeline
        self.slot_bytes = _aligned(int(slot_bytes))  # (every slot starts aligned)
        self.slots = int(slots)
        world = group.world_size
        self.next_rank = (group.rank_in_group + 1) % world
        self.prev_rank = (group.rank_in_group - 1) % world
        self.inbox = torch.empty((self.slots, self.slot_bytes), dtype=torch.uint8, device="cuda")
        # (``current_stream(index)``: without an index torch resolves the device in Python)
        self.device_index = self.inbox.device.index
        self.ready = [torch.cuda.Event(interprocess=True) for _ in range(self.slots)]
        self.free = [torch.cuda.Event(interprocess=True) for _ in range(self.slots)]
        self.outbox: Optional[torch.Tensor] = None
        self.out_ready: List[Any] = []
        self.out_free: List[Any] = []
        self._send_seq = 0
        self._recv_seq = 0
        self._layouts_in, self.address = _bound_pull("spexis-stage-link")
        self._layouts_out: Optional[zmq.Socket] = None
        # the receiver's count of messages taken from the outbox (ipc ones), pushed back here
        self._acks_in, self.ack_address = _bound_pull("spexis-stage-link-acks")
        self._acks_out: Optional[zmq.Socket] = None
        self._acked = 0
        self.sent_ipc = self.sent_nccl = 0
        self.send_waits = 0  # sends that waited for the receiver to free a slot

    # ------------------------------------------------------------------ set-up
    @classmethod
    def open(cls, group, slot_bytes: int, slots: int = 8) -> "SameGpuLink":
        """Allocate this rank's inbox, send its handles to the previous rank, open the next
        rank's inbox (async sends first: no rank waits for another's send to finish)."""
        from torch.multiprocessing.reductions import reduce_tensor

        link = cls(group, slot_bytes, slots)
        mine = {
            "inbox": reduce_tensor(link.inbox),
            "ready": [e.ipc_handle() for e in link.ready],
            "free": [e.ipc_handle() for e in link.free],
            "slot_bytes": link.slot_bytes,
            "address": link.address,
        }
        works = group.send_object(mine, dst=link.prev_rank, async_send=True)
        theirs = group.recv_object(src=link.next_rank)
        for w in works:
            w.work.wait()
        # the other way round: where this rank's acknowledgements go (the previous rank's pipe)
        works = group.send_object(link.ack_address, dst=link.next_rank, async_send=True)
        prev_ack_address = group.recv_object(src=link.prev_rank)
        for w in works:
            w.work.wait()
        link._acks_out = _connected_push(prev_ack_address)
        rebuild, args = theirs["inbox"]
        link.outbox = rebuild(*args)
        device = torch.cuda.current_device()
        link.out_ready = [torch.cuda.Event.from_ipc_handle(device, h) for h in theirs["ready"]]
        link.out_free = [torch.cuda.Event.from_ipc_handle(device, h) for h in theirs["free"]]
        link.out_slot_bytes = int(theirs["slot_bytes"])
        link._layouts_out = _connected_push(theirs["address"])
        logger.info(
            "Spexis same-GPU PP link: %d slots of %.1f MiB per rank (CUDA IPC)",
            link.slots,
            link.slot_bytes / 2**20,
        )
        return link

    # ------------------------------------------------------------------ messages
    def send(self, tensor_dict: Dict[str, Any]) -> List[Any]:
        """Send ``tensor_dict`` to the next rank, in the current stream's order (nothing for
        the PP loop to wait on: the receiver frees the slot)."""
        layout, tensors, offset = _message_layout(tensor_dict, lambda t: t.is_cuda)
        if offset > self.out_slot_bytes:
            self._send_nccl(tensor_dict)
            return []
        stream = torch.cuda.current_stream(self.device_index)
        self._wait_for_slot(self._send_seq)
        slot = self._send_seq % self.slots
        self._send_seq += 1
        stream.wait_event(self.out_free[slot])
        buf = self.outbox[slot]
        for off, t in tensors:
            n = t.numel() * t.element_size()
            buf[off : off + n].copy_(t.view(-1).view(torch.uint8))
        self.out_ready[slot].record(stream)
        self._send_layout(("ipc", slot, layout))
        self.sent_ipc += 1
        return []

    def _wait_for_slot(self, seq: int) -> None:
        """Return once message ``seq - slots`` (the slot's previous one) has been taken: its
        ``free`` is recorded, so the device wait on it orders this copy after that one."""
        need = seq - self.slots + 1  # messages the receiver must have taken
        waited = False
        while self._acked < need:
            try:
                ack = self._acks_in.recv(zmq.NOBLOCK)
            except zmq.Again:
                waited = True
                ack = self._acks_in.recv()
            self._acked = max(self._acked, int(ack))
        self.send_waits += waited

    def _send_layout(self, message) -> None:
        self._layouts_out.send(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))

    def _recv_layout(self):
        return pickle.loads(self._layouts_in.recv())

    def recv(self) -> Dict[str, Any]:
        """The next message from the previous rank (tensors on this rank's device)."""
        kind, slot, layout = self._recv_layout()
        if kind == "nccl":
            return self._recv_nccl(layout)
        stream = torch.cuda.current_stream(self.device_index)
        stream.wait_event(self.ready[slot])
        # copies: the slot takes the next message once freed
        out = _unpack(layout, self.inbox[slot], copy=True)
        self.free[slot].record(stream)
        self._recv_seq += 1
        self._acks_out.send(str(self._recv_seq).encode())
        return out

    # ------------------------------------------------------------------ too large: NCCL
    def _send_nccl(self, tensor_dict: Dict[str, Any]) -> None:
        layout = []
        tensors = []
        for key, value in tensor_dict.items():
            if isinstance(value, torch.Tensor):
                layout.append((key, ("t", 0, value.dtype, tuple(value.shape))))
                tensors.append(value.contiguous())
            else:
                layout.append((key, ("v", value)))
        self._send_layout(("nccl", -1, layout))
        dst = self.group.ranks[self.next_rank]
        for t in tensors:
            if t.numel():
                torch.distributed.send(t, dst, group=self.group.device_group)
        self.sent_nccl += 1

    def _recv_nccl(self, layout) -> Dict[str, Any]:
        src = self.group.ranks[self.prev_rank]
        out: Dict[str, Any] = {}
        for key, spec in layout:
            if spec[0] == "v":
                out[key] = spec[1]
                continue
            t = torch.empty(spec[3], dtype=spec[2], device="cuda")
            if t.numel():
                torch.distributed.recv(t, src, group=self.group.device_group)
            out[key] = t
        return out


#: logged by every rank that opened a :class:`PackedLink`
PACKED_LINK_LOG_LINE = "Spexis packed PP link: one buffer a message over the device group"
#: the first message down each packed link's pipe, and how long a rank waits for its own
_HELLO = b"spexis-packed-link-hello"
HELLO_TIMEOUT_MS = 10_000


class PackedLink:
    """The PP link of one rank for stages on one host, on any devices (an SP server's default
    there; ``SPEXIS_PP_TRANSPORT=packed`` for a plain one): a message's layout over a local zmq
    pipe, its tensors as one buffer in one send over the pipeline's device group.

    SGLang sends a tensor dict as its pickled metadata over gloo (two socket messages, ~0.2 ms
    one way on a GPU host, against ~40 us for a zmq pipe) and then one NCCL send per tensor;
    the receiver posts its receives only once the metadata is in. On every PP message (stage
    0's proxy out, the outputs back) that latency lies on the chain between the stages. Here
    the sender copies the tensors into one buffer (one fused copy), sends the layout and then
    the buffer; the receiver reads the layout, receives the buffer and returns views of it at
    their aligned offsets (no copy out). Stream order as SGLang's: the send reads the buffer
    after the copy on the sender's stream, and the receiver's stream waits for the receive.

    Build it with :meth:`open` on every rank of the pipeline at the same point; it returns None
    on every rank unless all of them are on one host (the pipes are local).
    """

    #: what ``/server_info`` calls this link (:func:`link_name`)
    name = "packed"

    def __init__(self, group, device) -> None:
        self.group = group  # SGLang's GroupCoordinator of the pipeline
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            # ("cuda" != "cuda:0": the tensors to pack are told by their device)
            self.device = torch.device("cuda", torch.cuda.current_device())
        world = group.world_size
        self.next_rank = (group.rank_in_group + 1) % world
        self.prev_rank = (group.rank_in_group - 1) % world
        # (SGLang's own choice: CPU tensors go over the CPU group)
        self.comm_group = group.cpu_group if self.device.type == "cpu" else group.device_group
        self._layouts_in, self.address = _bound_pull("spexis-packed-link")
        self._layouts_out: Optional[zmq.Socket] = None
        self.sent = self.received = 0

    @classmethod
    def open(cls, group, device, asked: bool = True) -> Optional["PackedLink"]:
        """This rank's link, or None on every rank where the pipeline spans several hosts or
        its local pipes do not reach every rank (a warning where the user ``asked`` for this
        link, else a note)."""
        import socket

        hosts: List[Any] = [None] * group.world_size
        torch.distributed.all_gather_object(hosts, socket.gethostname(), group=group.cpu_group)
        if len(set(hosts)) > 1:
            (logger.warning if asked else logger.info)(
                "The packed PP link needs every PP rank on one host (%s): using SGLang's "
                "transport",
                ", ".join(sorted(set(hosts))),
            )
            return None
        link = cls(group, device)
        works = group.send_object(link.address, dst=link.prev_rank, async_send=True)
        next_address = group.recv_object(src=link.next_rank)
        for w in works:
            w.work.wait()
        link._layouts_out = _connected_push(next_address)
        # One host name is not proof that the pipes reach (containers may share a name across
        # hosts or network namespaces, where a layout sent would wait for ever): each rank
        # says hello down its pipe, and the link opens only if every rank heard its own.
        try:
            link._layouts_out.send(_HELLO, zmq.NOBLOCK)
        except zmq.Again:  # (no peer to queue it for: the next rank will not hear it)
            pass
        heard = bool(link._layouts_in.poll(HELLO_TIMEOUT_MS)) and link._layouts_in.recv() == _HELLO
        every: List[Any] = [None] * group.world_size
        torch.distributed.all_gather_object(every, heard, group=group.cpu_group)
        if not all(every):
            (logger.warning if asked else logger.info)(
                "The packed PP link's local pipes do not reach every PP rank (ranks on one "
                "host name but not one host?): using SGLang's transport"
            )
            link.close()
            return None
        logger.info(PACKED_LINK_LOG_LINE)
        return link

    def close(self) -> None:
        """Close the pipes (a link not opened on every rank)."""
        for sock in (self._layouts_in, self._layouts_out):
            if sock is not None:
                sock.close()

    def send(self, tensor_dict: Dict[str, Any]) -> List[P2PWork]:
        """Send ``tensor_dict`` to the next rank; returns the send (with the buffer it reads)
        for the PP loop to wait on before its next send (``_pp_commit_comm_work``)."""
        device = self.device
        layout, tensors, nbytes = _message_layout(tensor_dict, lambda t: t.device == device)
        buf = None
        if nbytes:
            buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
            torch._foreach_copy_(
                [buf[off : off + t.numel() * t.element_size()] for off, t in tensors],
                [t.view(-1).view(torch.uint8) for _, t in tensors],
            )
        self._layouts_out.send(pickle.dumps((nbytes, layout), protocol=pickle.HIGHEST_PROTOCOL))
        self.sent += 1
        if buf is None:
            return []
        dst = self.group.ranks[self.next_rank]
        return [P2PWork(torch.distributed.isend(buf, dst, group=self.comm_group), buf)]

    def recv(self) -> Dict[str, Any]:
        """The next message from the previous rank (its tensors are views of one buffer)."""
        nbytes, layout = pickle.loads(self._layouts_in.recv())
        buf = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        if nbytes:  # (the sender sends no empty buffer)
            src = self.group.ranks[self.prev_rank]
            torch.distributed.irecv(buf, src, group=self.comm_group).wait()
        self.received += 1
        return _unpack(layout, buf, copy=False)


def link_name(link: Optional[Any]) -> str:
    """What carries a rank's PP tensor messages: ``ipc`` (:class:`SameGpuLink`), ``packed``
    (:class:`PackedLink`) or ``sglang`` (SGLang's own transport: no link of ours)."""
    return "sglang" if link is None else link.name


def proxy_slot_bytes(max_running_requests: int, hidden: int, dtype: torch.dtype) -> int:
    """A slot for any decode batch: its hidden states and residual at the largest batch a
    CUDA graph pads to (at most 32 rows past the server's limit), and room for the per-row
    extras (tokens, drafts, confidences, positions, logprobs). Larger messages go by NCCL."""
    rows = int(max_running_requests) + 32
    itemsize = torch.empty(0, dtype=dtype).element_size()
    return _aligned(2 * rows * hidden * itemsize) + _aligned(rows * 64) + (1 << 20)
