"""The SP loop's cheaper request path: the stage-to-stage relay over a local zmq pipe
(``srt/relay.py``) and stage 0's "nothing queued" check before SGLang's receive
(``srt/request_poll.py``). End to end, ``tests/e2e/test_sp_lossless.py`` (PP=2, PP=4, PP×TP)
serves through the pipe and ``tests/e2e/test_sp_multinode.py`` through SGLang's gloo relay."""

from __future__ import annotations

import uuid
from dataclasses import fields
from types import SimpleNamespace

import pytest
import zmq
from sglang.srt.managers.scheduler_components.request_receiver import (
    SchedulerRequestReceiver,
)

from spexis_sglang.srt.protocol import SpexisPlan, relay_payload
from spexis_sglang.srt.relay import LocalRelay, PipeRequestReceiver, local_relay_supported
from spexis_sglang.srt.request_poll import nothing_queued_check


def _ps(**kw) -> SimpleNamespace:
    base = dict(
        pp_rank=0, pp_size=2, tp_size=1, attn_tp_rank=0, attn_cp_rank=0, attn_tp_size=1,
        attn_cp_size=1, attn_dp_rank=0,
    )  # fmt: skip
    base.update(kw)
    return SimpleNamespace(**base)


def _receiver(ps, tokenizer=None, rpc=None, **hooks) -> SchedulerRequestReceiver:
    kwargs = {f.name: None for f in fields(SchedulerRequestReceiver)}
    kwargs.update(
        ps=ps,
        recv_from_tokenizer=tokenizer,
        recv_from_rpc=rpc,
        model_config=SimpleNamespace(is_multimodal=False),
        max_recv_per_poll=-1,
    )
    kwargs.update(hooks)
    return SchedulerRequestReceiver(**kwargs)


@pytest.fixture
def no_dp_attention(monkeypatch):
    """SGLang's receive reads the runtime context a server publishes (DP attention, and the
    multimodal transport when it unwraps shared-memory features): one without either."""
    import sglang.srt.managers.scheduler_components.request_receiver as receiver_module

    context = SimpleNamespace(enable_dp_attention=False)
    monkeypatch.setattr(receiver_module, "get_parallel", lambda: context)
    monkeypatch.setattr(receiver_module, "unwrap_shm_features", lambda req: req)


@pytest.fixture
def pipe():
    """A bound PULL socket and a PUSH socket connected to it (abstract ipc, as the server's)."""
    context = zmq.Context.instance()
    pull, push = context.socket(zmq.PULL), context.socket(zmq.PUSH)
    address = f"ipc://@spexis-test-{uuid.uuid4().hex}"
    pull.bind(address)
    push.connect(address)
    for s in (pull, push):
        s.setsockopt(zmq.LINGER, 0)
    yield pull, push
    pull.close()
    push.close()


def test_a_later_stage_receives_every_relay_in_order_through_sglangs_receive(
    pipe, no_dp_attention
) -> None:
    pull, push = pipe
    sender = LocalRelay(push, None)
    base = _receiver(_ps(pp_rank=1))
    receiver = PipeRequestReceiver.wrapping(base, pull)
    plan = SpexisPlan(iteration=5, dropped=[3, 8], admit_cap=1)
    relays = [
        relay_payload([], SpexisPlan(iteration=4)),
        relay_payload(["req-a", "req-b"], plan),
        relay_payload(None, SpexisPlan(iteration=6)),
    ]
    assert sender.sends
    for payload in relays:
        sender.send(payload)
    # SGLang's recv_requests (its hooks, TP broadcast and unwrapping) around the pipe's pull
    got = [receiver.recv_requests() for _ in relays]
    assert got == [[], ["req-a", "req-b", plan], []]
    assert got[1][-1].dropped == [3, 8] and got[1][-1].admit_cap == 1
    # the wrapped receiver keeps every field of SGLang's
    for f in fields(SchedulerRequestReceiver):
        assert getattr(receiver, f.name) is getattr(base, f.name), f.name


def test_the_pipe_receive_blocks_until_the_relay_is_there(pipe, no_dp_attention) -> None:
    pull, push = pipe
    pull.setsockopt(zmq.RCVTIMEO, 50)
    receiver = PipeRequestReceiver.wrapping(_receiver(_ps(pp_rank=1)), pull)
    with pytest.raises(zmq.Again):  # nothing sent: it waits (here until the test's timeout)
        receiver.recv_requests()
    LocalRelay(push, None).send([])
    assert receiver.recv_requests() == []


@pytest.mark.parametrize(
    "nnodes, pp_size, dp_attention, supported",
    [(1, 2, False, True), (1, 4, False, True), (2, 2, False, False), (1, 2, True, False),
     (1, 1, False, False)],
)  # fmt: skip
def test_the_pipe_is_used_on_one_node_without_dp_attention(
    nnodes, pp_size, dp_attention, supported
) -> None:
    assert local_relay_supported(nnodes, pp_size, dp_attention) is supported


def test_nothing_queued_reads_the_sockets_without_taking_anything(pipe) -> None:
    pull, push = pipe
    check = nothing_queued_check(_receiver(_ps(), pull), dp_attention=False, mm_waiting=False)
    assert check is not None and check()
    push.send_pyobj("req")
    zmq.select([pull], [], [], 10.0)  # delivery through the ipc socket is asynchronous
    assert not check()
    assert not check()  # reading the events took nothing
    assert pull.recv_pyobj() == "req"
    assert check()


def test_nothing_queued_watches_the_rpc_socket_too(pipe) -> None:
    pull, push = pipe
    other = zmq.Context.instance().socket(zmq.PULL)
    try:
        check = nothing_queued_check(_receiver(_ps(), other, pull), False, False)
        assert check()
        push.send_pyobj("rpc")
        zmq.select([pull], [], [], 10.0)
        assert not check()
    finally:
        other.close(linger=0)


@pytest.mark.parametrize(
    "ps_kw, hooks, flags",
    [
        ({"pp_rank": 1}, {}, {}),  # later stages block on their relay
        ({"tp_size": 2}, {}, {}),  # the other TP ranks wait in the broadcast
        ({"attn_tp_size": 2}, {}, {}),
        ({"attn_cp_size": 2}, {}, {}),
        ({}, {"recv_skipper": object()}, {}),
        ({}, {"input_blocker": object()}, {}),
        ({}, {"scripted_scheduler_hook": object()}, {}),
        ({}, {}, {"dp_attention": True}),
        ({}, {}, {"mm_waiting": True}),
    ],
)
def test_nothing_queued_is_not_offered_where_the_receive_does_more(pipe, ps_kw, hooks, flags):
    pull, _ = pipe
    args = {"dp_attention": False, "mm_waiting": False, **flags}
    assert nothing_queued_check(_receiver(_ps(**ps_kw), pull, **hooks), **args) is None


def test_nothing_queued_is_not_offered_for_other_request_sources() -> None:
    # the Rust server's ring or a scripted test proxy: not a zmq socket
    assert nothing_queued_check(_receiver(_ps(), object()), False, False) is None
