"""Stage 0's thread CPU per request relay: ``[SpexisPlan]`` vs ``[]``.

Two processes on one gloo group; the sender relays through SGLang's own
``point_to_point_pyobj`` as ``_sp_relay_requests`` does (commit the previous send's work, then
``isend``), the receiver receives as a later stage does. A non-empty list is pickled and sent
as two messages (size, bytes); an empty one is one size message. Each variant runs twice,
alternating, as the first pass warms up.

    .venv/bin/python benchmark/decode/sp_relay_cost.py --iterations 3000
"""

from __future__ import annotations

import argparse
import os
import time

from spexis_sglang.cpu_support import activate

activate()

import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from sglang.srt.utils.common import point_to_point_pyobj  # noqa: E402

from spexis_sglang.srt.protocol import SpexisPlan, relay_payload  # noqa: E402

VARIANTS = (
    ("empty plan relayed (before)", lambda i: [SpexisPlan(iteration=i)]),
    ("empty plan left out (after)", lambda i: relay_payload([], SpexisPlan(iteration=i))),
)


def run(rank: int, iterations: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    group = dist.group.WORLD
    for label, payload in VARIANTS + VARIANTS:
        dist.barrier()
        work: list = []
        t0 = time.thread_time()
        for i in range(iterations):
            if rank == 0:
                for w in work:
                    w.work.wait()
                work = point_to_point_pyobj(payload(i), 0, group, 0, 1, async_send=True)
            else:
                point_to_point_pyobj([], 1, group, 0, 1)
        for w in work:
            w.work.wait()
        if rank == 0:
            us = (time.thread_time() - t0) / iterations * 1e6
            print(f"{label}: {us:.1f} µs of the sender's thread CPU per iteration", flush=True)
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--iterations", type=int, default=3000)
    ap.add_argument("--port", type=int, default=29633)
    args = ap.parse_args()
    mp.spawn(run, args=(args.iterations, args.port), nprocs=2)


if __name__ == "__main__":
    main()
