"""The same-GPU PP link (``SPEXIS_PP_TRANSPORT=ipc``): a sender reuses an inbox slot only once
the receiver has taken the slot's previous message, so a receiver that falls behind by more
messages than there are slots gets every message intact."""

import os
import sys
import threading
import time

import pytest
import torch
import zmq

from spexis_sglang.srt.stage_link import SameGpuLink

HERE = os.path.dirname(os.path.abspath(__file__))


def _sender_side(slots: int):
    """A link's sender half without a GPU: its acknowledgement pipe, and where to push to it."""
    link = SameGpuLink.__new__(SameGpuLink)
    link.slots, link._acked, link.send_waits = slots, 0, 0
    context = zmq.Context.instance()
    link._acks_in = context.socket(zmq.PULL)
    link._acks_in.setsockopt(zmq.LINGER, 0)
    address = f"inproc://stage-link-test-{id(link)}"
    link._acks_in.bind(address)
    acks = context.socket(zmq.PUSH)
    acks.setsockopt(zmq.LINGER, 0)
    acks.connect(address)
    return link, acks


def test_a_slot_is_reused_only_after_the_receiver_took_its_previous_message():
    link, acks = _sender_side(slots=2)
    try:
        link._wait_for_slot(0)
        link._wait_for_slot(1)  # both slots unused so far: no wait
        assert link.send_waits == 0

        # message 2 goes to slot 0: it waits until message 0 has been taken
        def take_one_later():
            time.sleep(0.3)
            acks.send(b"1")

        thread = threading.Thread(target=take_one_later)
        t = time.monotonic()
        thread.start()
        link._wait_for_slot(2)
        waited = time.monotonic() - t
        thread.join()
        assert link.send_waits == 1 and link._acked == 1 and waited >= 0.25

        # acknowledgements already in the pipe are read without waiting, the latest wins
        acks.send(b"2")
        acks.send(b"3")
        time.sleep(0.05)
        link._wait_for_slot(4)
        assert link._acked == 3 and link.send_waits == 1
    finally:
        acks.close()
        link._acks_in.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_receiver_many_messages_behind_gets_each_one_intact():
    """Two processes on one GPU (the emulated box's ranks): round trips by size, then three
    times the link's slots sent while the receiver sleeps (``transport_probe.py``'s checks)."""
    sys.path.insert(0, os.path.join(HERE, "..", "..", "benchmark", "gpu"))
    import transport_probe

    out = transport_probe.run_mode("ipc", gpus=1, repeats=3)
    assert out["lagging_receiver_messages"] == 24
    assert out["send_waits"] >= 1  # the sender did wait for the receiver


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_whole_pp_messages_come_back_equal_over_nccl_both_ways():
    """SGLang's way and the packed link's, 16 to 256 rows over NCCL (``transport_probe.py``
    raises where a message came back different)."""
    sys.path.insert(0, os.path.join(HERE, "..", "..", "benchmark", "gpu"))
    import transport_probe

    gpus = min(torch.cuda.device_count(), 2)
    for mode in ("dict_sglang", "dict_packed"):
        out = transport_probe.run_mode(mode, gpus=gpus, repeats=3)
        assert set(out) == {str(rows) for rows in transport_probe.DICT_ROWS}


# ---------------------------------------------------------------------- the packed link
def _messages():
    """Messages as the PP loops send them: tensors of several dtypes and shapes (empty,
    0-d, non-contiguous, one byte), plain values, one without any tensor."""
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(5, 7, generator=g).to(torch.bfloat16)
    return [
        {
            "hidden_states": hidden,
            "residual": torch.randn(7, 5, generator=g).t(),  # non-contiguous
            "next_token_ids": torch.arange(5, dtype=torch.int64),
            "spexis_draft_conf": torch.rand(3, generator=g),
            "accepts": torch.tensor([True, False, True]),
            "empty": torch.empty(0, 4096, dtype=torch.bfloat16),
            "scalar": torch.tensor(7, dtype=torch.int32),
            "__msg_type__": "proxy",
            "meta": {"rows": 5},
        },
        {"__msg_type__": "output", "nothing": None},
        {"x": torch.arange(1000, dtype=torch.int16).reshape(10, 100), "__msg_type__": "output"},
    ]


def _two_ranks(worker, results: int) -> list:
    """Run ``worker(rank, port, queue)`` as ranks 0 and 1 of a gloo world (spawned
    processes); both must exit cleanly; returns the ``results`` items they queued."""
    import multiprocessing as mp

    from spexis_sglang.testing import free_port

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=worker, args=(r, port, queue)) for r in (0, 1)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    assert [p.exitcode for p in procs] == [0, 0]
    return [queue.get(timeout=5) for _ in range(results)]


def _packed_worker(rank: int, port: int, queue) -> None:
    import torch.distributed as dist

    from spexis_sglang.srt.stage_link import PackedLink

    sys.path.insert(0, os.path.join(HERE, "..", "..", "benchmark", "gpu"))
    from transport_probe import _Group  # the bits of SGLang's GroupCoordinator a link uses

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        # a CPU server's PP: the CPU group is the device group
        link = PackedLink.open(_Group(rank, dist, dist.group.WORLD, dist.group.WORLD), "cpu")
        if rank == 1:  # echo every message back to rank 0
            for _ in range(len(_messages())):
                for w in link.send(link.recv()):
                    w.work.wait()
            return
        result = {"equal": [], "one_buffer": None}
        for sent in _messages():
            works = link.send(dict(sent))
            got = link.recv()
            for w in works:
                w.work.wait()
            same = list(got) == list(sent)
            for k, v in sent.items():
                if isinstance(v, torch.Tensor):
                    g = got[k]
                    same &= g.dtype == v.dtype and g.shape == v.shape and torch.equal(g, v)
                else:
                    same &= got[k] == v
            result["equal"].append(bool(same))
            tensors = [t for t in got.values() if isinstance(t, torch.Tensor) and t.numel()]
            if len(tensors) > 1 and result["one_buffer"] is None:
                ptrs = {t.untyped_storage().data_ptr() for t in tensors}
                result["one_buffer"] = len(ptrs) == 1
        result["sent"], result["received"] = link.sent, link.received
        queue.put(result)
    finally:
        dist.barrier()
        dist.destroy_process_group()


def test_the_packed_link_delivers_every_message_intact_in_one_buffer():
    """``SPEXIS_PP_TRANSPORT=packed`` between two processes over gloo (a CPU server's PP):
    each message comes back equal, key for key and in order, and its tensors are views of
    the one buffer it was sent as (no copy out on the receiver)."""
    (result,) = _two_ranks(_packed_worker, results=1)
    assert result["equal"] == [True, True, True]
    assert result["one_buffer"] is True
    assert result["sent"] == result["received"] == 3


def _unreachable_worker(rank: int, port: int, queue) -> None:
    """Rank 0's pipe to rank 1 leads nowhere (as between containers that share a host name
    but not a host): no rank may open the link."""
    import torch.distributed as dist

    from spexis_sglang.srt import stage_link

    sys.path.insert(0, os.path.join(HERE, "..", "..", "benchmark", "gpu"))
    from transport_probe import _Group

    stage_link.HELLO_TIMEOUT_MS = 1000
    if rank == 0:
        connect = stage_link._connected_push
        stage_link._connected_push = lambda address: connect(address + "-elsewhere")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        group = _Group(rank, dist, dist.group.WORLD, dist.group.WORLD)
        queue.put((rank, stage_link.PackedLink.open(group, "cpu") is None))
    finally:
        dist.barrier()
        dist.destroy_process_group()


def test_the_packed_link_opens_nowhere_if_a_pipe_does_not_reach():
    """One host name is no proof the local pipes reach; a rank that does not hear its
    neighbour's hello makes every rank keep SGLang's transport (no rank left waiting)."""
    assert sorted(_two_ranks(_unreachable_worker, results=2)) == [(0, True), (1, True)]


def test_the_packed_link_names_its_gpu_by_index(monkeypatch):
    """The tensors to pack are told by their device: a link opened on "cuda" must compare
    equal to its tensors' "cuda:N" (else every tensor would go pickled in the layout)."""
    from spexis_sglang.srt.stage_link import PackedLink

    class Group:
        rank_in_group, world_size = 0, 2
        cpu_group = device_group = None

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    links = [PackedLink(Group(), name) for name in ("cuda", "cuda:1", "cpu")]
    try:
        assert [link.device for link in links] == [
            torch.device("cuda:3"),
            torch.device("cuda:1"),
            torch.device("cpu"),
        ]
    finally:
        for link in links:
            link._layouts_in.close()


@pytest.mark.parametrize("copy", [True, False])
def test_a_message_unpacks_from_its_buffer_as_laid_out(copy):
    """What both links do with a message's bytes: every tensor back at its offset, equal,
    a copy (the IPC link's reused slot) or a view of the buffer (the packed link's)."""
    from spexis_sglang.srt.stage_link import _message_layout, _unpack

    message = _messages()[0]
    layout, tensors, nbytes = _message_layout(message, lambda t: True)
    buf = torch.zeros(nbytes, dtype=torch.uint8)
    for off, t in tensors:
        n = t.numel() * t.element_size()
        buf[off : off + n] = t.reshape(-1).view(torch.uint8)
    got = _unpack(layout, buf, copy=copy)
    assert list(got) == list(message)
    for key, value in message.items():
        if not isinstance(value, torch.Tensor):
            assert got[key] == value
            continue
        assert got[key].dtype == value.dtype and torch.equal(got[key], value)
        if value.numel():
            shares = got[key].untyped_storage().data_ptr() == buf.untyped_storage().data_ptr()
            assert shares != copy
