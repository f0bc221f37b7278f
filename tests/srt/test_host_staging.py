"""HostStaging / HostReadback: the SP loop's metadata reaches the device, and its drafts the
host, intact, whatever the host does next; the packed drafts unpack exactly."""

import numpy as np
import pytest
import torch

from spexis_sglang.srt.host_staging import HostReadback, HostStaging
from spexis_sglang.srt.protocol import pack_drafts, unpack_drafts


def test_cpu_device_is_the_host_tensor():
    host = torch.arange(10, dtype=torch.int64)
    out = HostStaging("cpu", depth=2).to_device(host)
    assert out.device.type == "cpu" and torch.equal(out, host)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_copies_survive_host_reuse_and_ring_wrap():
    depth = 3
    staging = HostStaging("cuda", depth=depth)
    outs, want = [], []
    # more copies than buffers, growing sizes (a buffer is reallocated), the host tensor
    # rewritten after every call: each device copy must keep its own values
    for i in range(8):
        host = torch.arange(3 * i + 1, dtype=torch.int64) * (i + 1)
        outs.append(staging.to_device(host))
        want.append(host.clone())
        host.fill_(-1)
        if i % depth == depth - 1:
            # the caller's side of the contract (the SP loop: a batch's result is in)
            torch.cuda.current_stream().synchronize()
    torch.cuda.synchronize()
    for out, w in zip(outs, want):
        assert out.device.type == "cuda" and torch.equal(out.cpu(), w)


def test_packed_drafts_unpack_exactly():
    ids = torch.tensor([0, 1, 49151, 128255, 2**40 + 3], dtype=torch.int64)
    conf = torch.tensor([0.0, 1.0, 1e-8, 0.3333333, 0.99999994], dtype=torch.float32)
    buckets = torch.tensor([-1, 0, 1, 2, 4], dtype=torch.int64)
    for b in (buckets, None):
        got_ids, got_conf, got_buckets = unpack_drafts(pack_drafts(ids, conf, b).numpy())
        assert got_ids.dtype == np.int64 and got_ids.tolist() == ids.tolist()
        # the float32 confidence widened, bit for bit, as the scheduler read it before
        assert got_conf.dtype == np.float64
        assert got_conf.tolist() == conf.numpy().astype(np.float64).tolist()
        want = buckets.tolist() if b is not None else [-1] * 5
        assert got_buckets.dtype == np.int64 and got_buckets.tolist() == want


def test_cpu_readback_is_the_source():
    src = pack_drafts(torch.arange(4), torch.ones(4))
    host, event = HostReadback("cpu", depth=2).start(src)
    assert event is None and host is src


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_readback_holds_the_values_of_its_moment():
    readback = HostReadback("cuda", depth=3)
    # more copies than buffers and growing sizes (a buffer is reallocated); the device tensor
    # is overwritten right after each copy is queued, and each copy is read before the ring
    # comes back to its buffer (the SP loop reads a batch's drafts when it builds the next)
    for i in range(8):
        n = 2 * i + 1
        src = pack_drafts(
            torch.arange(n, device="cuda") * (i + 1),
            torch.full((n,), 0.5 ** (i + 1), device="cuda"),
        )
        want = src.cpu()
        host, event = readback.start(src)
        src.fill_(-7)
        event.synchronize()
        assert host.device.type == "cpu" and host.is_pinned()
        assert torch.equal(host, want)


def test_ring_buffers_grow_along_rows_only():
    """Copies whose row count varies reuse the ring's buffers (a buffer is made again only when
    too short: doubling), whereas a varying trailing shape would make one every time (pinning
    host memory costs milliseconds and a block the host allocator keeps: the GPU run that met
    this slowed to a crawl and ran out of host memory). The SP loop's transit tokens go rows
    first for that reason."""
    ring = HostStaging("cpu", depth=2)
    ring._pin = False  # the ring's buffering exercised on the host, nothing pinned
    for n in list(range(1, 200)) + list(range(200, 1, -3)):
        _, buf = ring._take(torch.empty((n, 2), dtype=torch.int64))
        assert buf.shape == (n, 2)
    # each of the two buffers doubled its way to 199 rows: 1, 2, 4, ..., 256
    assert ring.allocations <= 2 * 9
    grown = ring.allocations
    _, buf = ring._take(torch.empty((2, 37), dtype=torch.int64))
    assert ring.allocations == grown + 1  # another trailing shape: a new buffer


def test_transit_outputs_go_rows_first():
    """The true tokens and drafts of a returning batch, one row each, for the ring above."""
    from spexis_sglang.cpu_support import activate

    activate()
    from spexis_sglang.srt.protocol import PROXY_DRAFT_IDS
    from spexis_sglang.srt.sp_records import TransitOutputs as _TransitOutputs

    ring = HostReadback("cpu", depth=2)
    tensors = {
        "next_token_ids": torch.tensor([5, 6, 7], dtype=torch.int32),
        PROXY_DRAFT_IDS: torch.tensor([5, 9, 7, 0], dtype=torch.int64),  # padded
    }
    out = _TransitOutputs(tensors, 3, ring)
    assert out.device.shape == (3, 2)
    ids, drafts = out.read()
    assert ids.tolist() == [5, 6, 7] and drafts.tolist() == [5, 9, 7]
    assert ids.dtype == np.int64 and drafts.dtype == np.int64
