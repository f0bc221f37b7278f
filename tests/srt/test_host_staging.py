"""HostStaging: the SP loop's metadata reaches the device intact, whatever the host does next."""

import pytest
import torch

from spexis_sglang.srt.host_staging import HostStaging


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
