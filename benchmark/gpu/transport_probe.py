#!/usr/bin/env python3
"""What a message between two pipeline stages costs on this machine, by size.

Two processes (two PP ranks), one round trip after another, for each message size:

* ``nccl``: ``torch.distributed`` send/recv over NCCL, as SGLang's PP sends tensors. With one
  GPU the two processes share it (each its own ``NCCL_HOSTID``: NCCL then talks over loopback
  sockets, as ``SPEXIS_SHARE_GPU`` sets it up); with two GPUs, one each (NVLink);
* ``ipc``: one GPU: the sender copies into a buffer the receiver opened through CUDA IPC and
  records an interprocess event, the receiver's stream waits on it (what a same-GPU transport
  would cost: a device copy and the event handshake);
* ``gloo``: a small Python object over gloo (SGLang sends every tensor dict's metadata so).

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
    torch.cuda.set_device(rank % gpus)
    backend = "nccl" if mode == "nccl" else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    peer = 1 - rank
    out: Dict[str, float] = {}
    if mode == "nccl":
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
    elif mode == "gloo":
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


def _ipc_worker(rank: int, repeats: int, dist) -> Dict[str, float]:
    """Each process owns an inbox the other opened through CUDA IPC; a send is a device copy
    into the peer's inbox plus an interprocess event, announced over gloo (as metadata is)."""
    import torch
    from torch.multiprocessing.reductions import reduce_tensor

    big = max(SIZES)
    inbox = torch.zeros(big, dtype=torch.uint8, device="cuda")
    ready = torch.cuda.Event(interprocess=True)
    mine = [reduce_tensor(inbox), ready.ipc_handle()]
    theirs = [None]
    if rank == 0:
        dist.send_object_list([mine], 1)
        dist.recv_object_list(theirs, 1)
    else:
        dist.recv_object_list(theirs, 0)
        dist.send_object_list([mine], 0)
    (rebuild, rargs), handle = theirs[0]
    peer_inbox = rebuild(*rargs)
    peer_ready = torch.cuda.Event.from_ipc_handle(torch.cuda.current_device(), handle)
    out: Dict[str, float] = {}
    local = torch.zeros(big, dtype=torch.uint8, device="cuda")
    stream = torch.cuda.current_stream()
    box = [0]
    for size in SIZES:

        def send():
            peer_inbox[:size].copy_(local[:size])
            peer_ready.record(stream)
            dist.send_object_list(box, 1 - rank)

        def recv():
            dist.recv_object_list(box, 1 - rank)
            stream.wait_event(ready)
            local[:size].copy_(inbox[:size])

        def rt():
            if rank == 0:
                send()
                recv()
            else:
                recv()
                send()

        out[str(size)] = _time_round_trips(rt, repeats) / 2
    return out


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
    ap.add_argument("--modes", default="nccl,ipc,gloo")
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
            gbps = int(k) / v / 1e9 if k.isdigit() and v > 0 else None
            cells.append(f"{k}: {v * 1e6:.0f} us" + (f" ({gbps:.1f} GB/s)" if gbps else ""))
        print(f"{mode}: " + ", ".join(cells))
    print("errors:", res["errors"] or "none")
    return 0


if __name__ == "__main__":
    sys.exit(main())
