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
