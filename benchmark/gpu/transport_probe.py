#!/usr/bin/env python3
"""What a message between two pipeline stages costs on this machine, by size.

Two processes (two PP ranks), one round trip after another, for each message size:

* ``nccl``: ``torch.distributed`` send/recv over NCCL, as SGLang's PP sends tensors. With one
  GPU the two processes share it (each its own ``NCCL_HOSTID``: NCCL then talks over loopback
  sockets, as ``SPEXIS_SHARE_GPU`` sets it up); with two GPUs, one each (NVLink);
* ``ipc``: one GPU: the project's same-GPU link (``srt/stage_link.py``, what
  ``SPEXIS_PP_TRANSPORT=ipc`` uses): a device copy into the peer's inbox opened through CUDA
  IPC, an interprocess event, the layout over a local zmq pipe;
* ``gloo`` / ``gloo_lo``: a small Python object over gloo (SGLang sends every tensor dict's
  metadata so), on the interface gloo picks by default and on loopback (``GLOO_SOCKET_IFNAME=lo``);
* ``dict_sglang`` / ``dict_packed``: a whole PP message of ``DICT_ROWS`` rows (hidden states
  and residual of an 8B model's width, three per-row tensors), sent as SGLang sends a tensor
  dict (its metadata pickled over gloo, then one NCCL send per tensor) and through the
  project's ``stage_link.PackedLink`` (``SPEXIS_PP_TRANSPORT=packed``: the layout over a local
  zmq pipe, the tensors in one NCCL send); each checks that the message came back equal.

Under ``SPEXIS_SHARE_GPU=mps`` (an MPS daemon running) each process is a client with half the
SMs, as the emulated two-GPU box runs them. One-way time is half the round trip; the table
adds the bandwidth it implies. Output: ``--out`` JSON.

    python3 benchmark/gpu/transport_probe.py --out $OUT/transport_probe.json
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from typing import Dict, List

SIZES = [8, 1 << 10, 16 << 10, 128 << 10, 1 << 20, 4 << 20, 16 << 20]
#: rows of the whole PP messages (``dict_*`` modes), and their hidden width
DICT_ROWS = [16, 64, 256]
DICT_HIDDEN = 4096


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _time_round_trips(fn, repeats: int, warmup: int = 3) -> float:
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(repeats):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / repeats


def worker(rank: int, mode: str, port: int, gpus: int, repeats: int, queue) -> None:
    import torch
    import torch.distributed as dist

    if gpus == 1:
        os.environ["NCCL_HOSTID"] = f"probe-rank{rank}"
        os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
        os.environ.setdefault("NCCL_IB_DISABLE", "1")
    if os.environ.get("SPEXIS_SHARE_GPU") == "mps":
        os.environ.setdefault("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "50")
    if mode in ("gloo_lo", "ipc") or mode.startswith("dict_"):
        os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.cuda.set_device(rank % gpus)
    backend = "nccl" if mode == "nccl" or mode.startswith("dict_") else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    peer = 1 - rank
    out: Dict[str, float] = {}
    if mode.startswith("dict_"):
        out = _dict_worker(rank, mode, repeats, dist)
    elif mode == "nccl":
        for size in SIZES:
            buf = torch.zeros(size, dtype=torch.uint8, device="cuda")

            def rt():
                if rank == 0:
                    dist.send(buf, peer)
                    dist.recv(buf, peer)
                else:
                    dist.recv(buf, peer)
                    dist.send(buf, peer)

            out[str(size)] = _time_round_trips(rt, repeats) / 2
    elif mode in ("gloo", "gloo_lo"):
        obj = [("hidden_states", (256, 4096), "bfloat16"), ("residual", (256, 4096), "bfloat16")]

        def rt():
            box = [obj]
            if rank == 0:
                dist.send_object_list(box, peer)
                dist.recv_object_list(box, peer)
            else:
                dist.recv_object_list(box, peer)
                dist.send_object_list(box, peer)

        for _ in range(3):
            rt()
        t = time.perf_counter()
        for _ in range(repeats):
            rt()
        out["metadata"] = (time.perf_counter() - t) / repeats / 2
    else:
        out = _ipc_worker(rank, repeats, dist)
    dist.barrier()
    if rank == 0:
        queue.put(out)
    dist.destroy_process_group()


class _Group:
    """The bits of SGLang's GroupCoordinator the links use: this probe's world (gloo, or NCCL
    with a gloo group beside it for objects, as SGLang's ``cpu_group``)."""

    def __init__(self, rank: int, dist, cpu_group=None, device_group=None) -> None:
        self.rank_in_group, self.world_size, self.ranks = rank, 2, [0, 1]
        self.cpu_group, self.device_group = cpu_group, device_group
        self._dist = dist

    def send_object(self, obj, dst: int, async_send: bool = False):
        # async: both ranks send first when they exchange handles
        import pickle

        import torch

        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        size = torch.tensor([data.numel()], dtype=torch.long)
        group = self.cpu_group
        works = [self._dist.isend(size, dst, group=group), self._dist.isend(data, dst, group=group)]
        return [_Work(w, (size, data)) for w in works]

    def recv_object(self, src: int):
        import pickle

        import torch

        size = torch.empty(1, dtype=torch.long)
        self._dist.recv(size, src, group=self.cpu_group)
        data = torch.empty(int(size.item()), dtype=torch.uint8)
        self._dist.recv(data, src, group=self.cpu_group)
        return pickle.loads(data.numpy().tobytes())


class _Work:
    """SGLang's P2PWork: a work and what it sends (kept alive until waited)."""

    def __init__(self, work, keep) -> None:
        self.work, self._keep = work, keep


def _ipc_worker(rank: int, repeats: int, dist) -> Dict[str, float]:
    """Round trips through the project's SameGpuLink (each rank's inbox opened by the other)."""
    import torch

    sys.path.insert(
        0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "python")
    )
    from spexis_sglang.srt.stage_link import SameGpuLink

    link = SameGpuLink.open(_Group(rank, dist), max(SIZES) + (1 << 20), slots=8)
    out: Dict[str, float] = {}
    # the same bytes on both ranks (each checks what it receives), no two neighbours equal
    local = (torch.arange(max(SIZES), device="cuda") % 251).to(torch.uint8)
    for size in SIZES:
        msg = {"x": local[:size], "__msg_type__": "proxy"}

        def rt():
            if rank == 0:
                link.send(msg)
                got = link.recv()
            else:
                got = link.recv()
                link.send(got)
            return got

        out[str(size)] = _time_round_trips(rt, repeats) / 2
        got = rt()
        torch.cuda.synchronize()
        if not torch.equal(got["x"], local[:size]) or got["__msg_type__"] != "proxy":
            raise RuntimeError(f"ipc: message of {size} bytes came back different")
    out["sent_ipc"] = link.sent_ipc
    out["lagging_receiver_messages"] = lagging_receiver_check(link, rank)
    out["send_waits"] = link.send_waits
    return out


def _pp_message(rows: int):
    """A PP proxy as SP sends it: hidden states and residual, the drafts, their confidences
    and the rows' positions (distinct values, checked on return)."""
    import torch

    hidden = torch.arange(rows * DICT_HIDDEN, device="cuda").reshape(rows, DICT_HIDDEN) % 251
    return {
        "hidden_states": hidden.to(torch.bfloat16),
        "residual": (hidden + 1).to(torch.bfloat16),
        "spexis_draft_ids": torch.arange(rows, device="cuda"),
        "spexis_draft_conf": torch.rand(rows, device="cuda"),
        "spexis_positions": torch.arange(rows, device="cuda", dtype=torch.int64) + 128,
        "__msg_type__": "proxy",
    }


def _dict_worker(rank: int, mode: str, repeats: int, dist) -> Dict[str, float]:
    """Round trips of whole PP messages: SGLang's way (``dict_sglang``) or the packed link's."""
    import torch

    sys.path.insert(
        0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "python")
    )
    from spexis_sglang.srt.stage_link import PackedLink

    group = _Group(rank, dist, dist.new_group(backend="gloo"), dist.group.WORLD)
    peer = 1 - rank
    if mode == "dict_packed":
        link = PackedLink.open(group, "cuda")
        send, recv = link.send, link.recv
    else:

        def send(msg):  # GroupCoordinator.send_tensor_dict, async
            meta = [
                (k, ("t", v.dtype, tuple(v.shape)) if isinstance(v, torch.Tensor) else ("v", v))
                for k, v in msg.items()
            ]
            works = group.send_object(meta, dst=peer, async_send=True)
            for v in msg.values():
                if isinstance(v, torch.Tensor):
                    works.append(_Work(dist.isend(v, peer), v))
            return works

        def recv():  # GroupCoordinator.recv_tensor_dict
            out = {}
            for k, (kind, *spec) in group.recv_object(src=peer):
                if kind == "v":
                    out[k] = spec[0]
                    continue
                t = torch.empty(spec[1], dtype=spec[0], device="cuda")
                dist.irecv(t, peer).wait()
                out[k] = t
            return out

    out: Dict[str, float] = {}
    for rows in DICT_ROWS:
        msg = _pp_message(rows)
        last = {}

        def rt():
            if rank == 0:
                works = send(msg)
                last["got"] = recv()
            else:
                works = send(recv())
            for w in works:  # the PP loop commits a send before its next one
                w.work.wait()

        out[str(rows)] = _time_round_trips(rt, repeats) / 2
        if rank == 0:
            got = last["got"]
            for k, v in msg.items():
                same = torch.equal(got[k], v) if isinstance(v, torch.Tensor) else got[k] == v
                if not same:
                    raise RuntimeError(f"{mode}: {k} of a {rows}-row message came back different")
    return out


def lagging_receiver_check(link, rank: int, rounds: int = 3) -> int:
    """Rank 0 sends ``rounds`` times as many messages as the link has slots while rank 1 is
    still asleep, each its own contents; rank 1 then takes them all and checks every one (a
    sender that reused a slot before its message was taken would overwrite it). The messages
    sent; raises on rank 1 if any arrived different."""
    import torch

    n = rounds * link.slots
    if rank == 0:
        for i in range(n):
            link.send({"x": torch.full((4096,), i, dtype=torch.int32, device="cuda"), "i": i})
        torch.cuda.synchronize()
    else:
        time.sleep(1.0)
        for i in range(n):
            got = link.recv()
            want = torch.full((4096,), i, dtype=torch.int32, device="cuda")
            if got["i"] != i or not torch.equal(got["x"], want):
                raise RuntimeError(f"ipc: message {i} of a lagging receiver arrived different")
    return n


def run_mode(mode: str, gpus: int, repeats: int) -> Dict[str, float]:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.SimpleQueue()
    port = _free_port()
    procs = [ctx.Process(target=worker, args=(r, mode, port, gpus, repeats, q)) for r in (0, 1)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=180)
    if any(p.exitcode != 0 for p in procs):
        raise RuntimeError(f"{mode}: worker exit codes {[p.exitcode for p in procs]}")
    return q.get()


def main(argv: List[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--modes", default="nccl,ipc,gloo,gloo_lo,dict_sglang,dict_packed")
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "transport.json"))
    a = ap.parse_args(argv)
    import torch

    gpus = torch.cuda.device_count()
    res: Dict[str, object] = {
        "script": "benchmark/gpu/transport_probe.py",
        "gpu": torch.cuda.get_device_name(0) if gpus else None,
        "gpus": gpus,
        "share_gpu": os.environ.get("SPEXIS_SHARE_GPU"),
        "sizes_bytes": SIZES,
        "dict_rows": DICT_ROWS,
        "dict_hidden": DICT_HIDDEN,
        "one_way_s": {},
        "errors": {},
    }
    for mode in a.modes.split(","):
        if mode == "ipc" and gpus != 1:
            continue
        t = time.time()
        try:
            res["one_way_s"][mode] = run_mode(mode, gpus, a.repeats)
        except Exception as e:  # noqa: BLE001 - recorded, the other modes still run
            res["errors"][mode] = repr(e)
        print(f"{mode}: {time.time() - t:.1f} s", flush=True)
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)
    for mode, by_size in res["one_way_s"].items():
        cells = []
        for k, v in by_size.items():
            if not k.isdigit() and k != "metadata":
                continue
            if mode.startswith("dict_"):  # keyed by the message's rows
                cells.append(f"{k} rows: {v * 1e6:.0f} us")
                continue
            gbps = int(k) / v / 1e9 if k.isdigit() and v > 0 else None
            cells.append(f"{k}: {v * 1e6:.0f} us" + (f" ({gbps:.1f} GB/s)" if gbps else ""))
        print(f"{mode}: " + ", ".join(cells))
    print("errors:", res["errors"] or "none")
    return 0


if __name__ == "__main__":
    sys.exit(main())
