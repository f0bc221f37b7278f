"""The developer aids that GPU tests rely on: stage 0's draft log and one-GPU sharing."""

from __future__ import annotations

import os

import numpy as np
import pytest

from spexis_sglang.srt.hooks import share_one_gpu
from spexis_sglang.srt.profiling import DraftLog
from tests.e2e.test_sp_graphs import read_draft_log


def test_draft_log_round_trip_keys_rows_by_request_position_and_token(tmp_path):
    path = str(tmp_path / "drafts.jsonl")
    log = DraftLog(path)
    log.write(
        ["a-0", "b-1", None],
        np.array([5, 9, 3]),
        np.array([11, 12, 13]),
        np.array([21, 22, 23]),
        np.array([0.5, 0.25, 1.0]),
        np.array([-1, 2, 0]),
    )
    log.write(["a-0"], [6], [21], [30], [0.75], None)
    rows = read_draft_log(path, "a-")
    assert rows == {("a-0", 5, 11): (21, 0.5, -1), ("a-0", 6, 21): (30, 0.75, None)}
    assert read_draft_log(path)[("b-1", 9, 12)] == (22, 0.25, 2)  # the freed slot's row is gone
    log.write(["a-0"], [5], [11], [99], [0.5], None)
    with pytest.raises(AssertionError, match="drafted 21 then 99"):
        read_draft_log(path, "a-")


def _scheduler_args(gpu_id: int, tp_rank: int, pp_rank: int) -> tuple:
    # run_scheduler_process(server_args, port_args, gpu_id, tp_rank, attn_cp_rank,
    #                       moe_dp_rank, moe_ep_rank, pp_rank, dp_rank, pipe_writer)
    return ("server_args", "port_args", gpu_id, tp_rank, 0, 0, 0, pp_rank, None, "pipe")


def test_share_one_gpu_puts_every_rank_on_an_existing_gpu_with_its_own_nccl_host(monkeypatch):
    for name in ("NCCL_HOSTID", "NCCL_SOCKET_IFNAME", "NCCL_IB_DISABLE"):
        monkeypatch.delenv(name, raising=False)
    hosts = set()
    for tp_rank, pp_rank in ((0, 0), (1, 0), (0, 1), (1, 1)):
        gpu_id = pp_rank * 2 + tp_rank
        args = share_one_gpu(_scheduler_args(gpu_id, tp_rank, pp_rank), num_gpus=1)
        assert args[2] == 0
        assert (
            args[:2] == ("server_args", "port_args")
            and args[3:] == _scheduler_args(gpu_id, tp_rank, pp_rank)[3:]
        )
        hosts.add(os.environ["NCCL_HOSTID"])
    assert len(hosts) == 4  # NCCL refuses two ranks of one host on one GPU
    assert os.environ["NCCL_SOCKET_IFNAME"] == "lo"
    assert share_one_gpu(_scheduler_args(3, 1, 1), num_gpus=2)[2] == 1
    with pytest.raises(RuntimeError, match="needs a CUDA GPU"):
        share_one_gpu(_scheduler_args(0, 0, 0), num_gpus=0)


def test_share_one_gpu_mps_gives_each_rank_its_share_of_the_sms(monkeypatch):
    from types import SimpleNamespace

    server_args = SimpleNamespace(pp_size=2, tp_size=1)
    for name in ("NCCL_HOSTID", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"):
        monkeypatch.delenv(name, raising=False)
    args = ("server_args", "port_args", 1, 0, 0, 0, 0, 1, None, "pipe")
    share_one_gpu((server_args, *args[1:]), num_gpus=1, mode="mps")
    assert os.environ["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "50"
    # four ranks on two GPUs: two clients a GPU
    monkeypatch.delenv("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE")
    share_one_gpu((SimpleNamespace(pp_size=2, tp_size=2), *args[1:]), num_gpus=2, mode="mps")
    assert os.environ["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "50"
    # plain sharing leaves MPS alone; a caller's setting wins
    monkeypatch.delenv("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE")
    share_one_gpu((server_args, *args[1:]), num_gpus=1, mode="1")
    assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" not in os.environ
    monkeypatch.setenv("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "30")
    share_one_gpu((server_args, *args[1:]), num_gpus=1, mode="mps")
    assert os.environ["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "30"


def test_share_gpu_mode_reads_the_switch(monkeypatch):
    from spexis_sglang.srt.config import share_gpu_mode

    for value, mode in ((None, None), ("0", None), ("1", "1"), ("mps", "mps")):
        if value is None:
            monkeypatch.delenv("SPEXIS_SHARE_GPU", raising=False)
        else:
            monkeypatch.setenv("SPEXIS_SHARE_GPU", value)
        assert share_gpu_mode() == mode
    monkeypatch.setenv("SPEXIS_SHARE_GPU", "yes")
    with pytest.raises(ValueError, match="SPEXIS_SHARE_GPU='yes'"):
        share_gpu_mode()


def test_stock_loop_profile_ticks_once_a_step_and_writes_its_file(tmp_path):
    """``SPEXIS_PROFILE_LOOP`` on a plain PP server: stock SGLang's loop is not this
    project's, so the profile ticks in ``process_input_requests`` (once a micro-batch step),
    which still receives the requests, and writes its statistics there."""
    import pstats

    from spexis_sglang.srt.profiling import profile_stock_loop

    class Loop:
        def __init__(self):
            self.received = []

        def process_input_requests(self, recv_reqs):
            self.received.append(list(recv_reqs))

    loop = Loop()
    path = str(tmp_path / "stock.pp0.tp0.prof")
    profiler = profile_stock_loop(loop, path)
    try:
        profiler.interval_s = 0.0
        loop.process_input_requests(["a"])
        loop.process_input_requests([])
    finally:
        profiler.profile.disable()
    assert loop.received == [["a"], []]
    names = {func[2] for func in pstats.Stats(path).stats}
    assert "process_input_requests" in names
