"""Per-stage decode time with CUDA graphs on one GPU: the simulator's calibration points.

A pipeline stage of an 8B-shaped model is, to the GPU, a model with that stage's layers. For
each ``config:layers`` this loads SGLang's model runner with ``--load-format dummy`` on a copy of
the config with ``num_hidden_layers = layers`` (SGLang's ``sglang.benchmark.one_batch``
machinery, CUDA graphs captured for the measured batch sizes), prefills ``B`` prompts of
``ctx`` tokens and times decode steps two ways:

* ``decode_ms_sync``: median of steps with a device synchronisation around each (host work
  included, as ``bench_one_batch`` reports);
* ``decode_ms_pipelined``: ``K`` steps launched back to back, one synchronisation at the end:
  the GPU time per step whenever the GPU is the bottleneck (what a stage costs in a loop).

The config includes embedding, final norm, LM head and sampling: a 16-layer Llama-3.1-8B
"model" is its last PP=2 stage; two depths (e.g. 16 and 8 layers) separate the per-layer
cost from the fixed part. ``--p2p`` adds NCCL point-to-point bandwidth between two processes
on this one GPU (each its own ``NCCL_HOSTID``, so NCCL sends over loopback sockets, as on
the emulated two-GPU box).

    python3 benchmark/gpu/stage_times.py --out $OUT                     # on the H200
    python3 benchmark/gpu/stage_times.py --cpu-dry-run --out /tmp/st   # anywhere (tiny config)

Writes ``$OUT/stage_times.json``; ``benchmark/sim/calibrate.py --stage-times`` reads it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "benchmark" / "gpu" / "configs"
DEFAULT_STAGES = ("llama-3.1-8b:16", "qwen3-8b:18", "llama-3.1-8b:8", "qwen3-8b:9")
DEFAULT_BATCHES = (1, 8, 16, 32, 64, 128, 256, 512)
DEFAULT_CONTEXTS = (128, 1024, 4096, 8192)


def _stage_config(config: str, layers: int, tmp: Path) -> Path:
    src = json.loads((CONFIGS / config / "config.json").read_text())
    src["num_hidden_layers"] = int(layers)
    d = tmp / f"{config}-{layers}l"
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(src, indent=1))
    for extra in ("generation_config.json",):
        if (CONFIGS / config / extra).is_file():
            shutil.copy(CONFIGS / config / extra, d / extra)
    return d


def worker(args: argparse.Namespace) -> int:
    """One stage shape in this process: load, then time every (ctx, batch) point."""
    if args.cpu_dry_run:
        from spexis_sglang import cpu_support

        cpu_support.activate()
    import numpy as np
    import torch
    from sglang.benchmark import one_batch as ob
    from sglang.srt.server_args import PortArgs, ServerArgs

    ob.get_tokenizer = lambda *a, **k: None  # dummy weights, token-id prompts
    batches = sorted(args.batches)
    contexts = sorted(args.contexts)
    kw = dict(
        model_path=args.model_dir,
        load_format="dummy",
        skip_tokenizer_init=True,
        context_length=max(contexts) + args.steps + 64,
        disable_radix_cache=True,
        trust_remote_code=False,
    )
    if args.cpu_dry_run:
        # a small KV pool: SGLang would size it from a fraction of the host's memory
        kw.update(device="cpu", dtype="float32", disable_cuda_graph=True, max_total_tokens=4096)
    else:
        kw.update(
            dtype="bfloat16",
            attention_backend="triton",
            sampling_backend="pytorch",
            mem_fraction_static=args.mem_fraction,
            # (the dataclass fields behind --cuda-graph-max-bs / --cuda-graph-bs)
            cuda_graph_max_bs_decode=max(batches),
            cuda_graph_bs_decode=batches,
        )
    server_args = ServerArgs(**kw)
    # as sglang.benchmark.one_batch's main() and latency_test() do before loading
    if getattr(server_args, "cuda_graph_config", None) is not None:
        server_args.cuda_graph_config[ob.Phase.DECODE].max_bs = max(batches)
    ob._set_envs_and_config(server_args)
    for name in (
        "initialize_moe_config",
        "initialize_fp8_gemm_config",
        "initialize_fp4_gemm_config",
    ):
        if hasattr(ob, name):
            getattr(ob, name)(server_args)
    port_args = PortArgs.init_new(server_args)
    t0 = time.time()
    runner, _ = ob.load_model(server_args, port_args, 0, 0)
    mr = runner.torch_runner
    load_s = time.time() - t0
    cap_tokens = int(getattr(mr, "max_total_num_tokens", 10**9))
    points = []
    dev = "cpu" if args.cpu_dry_run else "cuda"

    def sync() -> None:
        if dev == "cuda":
            torch.cuda.synchronize()

    deadline = time.time() + args.worker_budget_s
    for ctx in contexts:
        for b in batches:
            if b * ctx > args.max_tokens_per_point or b * (ctx + args.steps + 8) > cap_tokens:
                continue
            if time.time() > deadline:
                break
            runner.clear()
            reqs = ob.prepare_synthetic_inputs_for_latency_test(b, ctx)
            sync()
            tp = time.perf_counter()
            ids, _, batch = runner.extend(reqs)
            sync()
            prefill_ms = 1e3 * (time.perf_counter() - tp)
            for _ in range(2):  # warm-up
                ids, _ = runner.decode(ids, batch)
            sync()
            lat = []
            for _ in range(args.steps):
                t = time.perf_counter()
                ids, _ = runner.decode(ids, batch)
                sync()
                lat.append(time.perf_counter() - t)
            t = time.perf_counter()
            for _ in range(args.steps):
                ids, _ = runner.decode(ids, batch)
            sync()
            pipe = (time.perf_counter() - t) / args.steps
            points.append(
                {
                    "batch": b,
                    "input_len": ctx,
                    "kv_len_mean": ctx + 2 + args.steps,
                    "decode_ms_sync": round(1e3 * float(np.median(lat)), 4),
                    "decode_ms_pipelined": round(1e3 * pipe, 4),
                    "prefill_ms": round(prefill_ms, 2),
                    "steps": args.steps,
                }
            )
            print(
                f"  B={b:4d} ctx={ctx:5d}  sync {points[-1]['decode_ms_sync']:.3f} ms  "
                f"pipelined {points[-1]['decode_ms_pipelined']:.3f} ms",
                flush=True,
            )
    out = {
        "load_s": round(load_s, 1),
        "max_total_num_tokens": cap_tokens,
        "cuda_graph_max_bs": None if args.cpu_dry_run else max(batches),
        "points": points,
    }
    Path(args.worker_out).write_text(json.dumps(out))
    return 0


def p2p_probe(out: Path, sizes_mb: list, reps: int, cpu: bool) -> list:
    """NCCL send/recv between two processes on GPU 0 over loopback sockets (gloo on CPU)."""
    code = """
import os, sys, json, time, torch, torch.distributed as dist
rank = int(sys.argv[1]); sizes = json.loads(sys.argv[2]); reps = int(sys.argv[3]); \
cpu = sys.argv[4] == "1"
os.environ["NCCL_HOSTID"] = f"spexis-probe-{rank}"  # as srt/hooks.share_one_gpu does
os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
os.environ.setdefault("NCCL_IB_DISABLE", "1")
os.environ.setdefault("NCCL_MNNVL_ENABLE", "0")
backend = "gloo" if cpu else "nccl"
dev = torch.device("cpu") if cpu else torch.device("cuda", 0)
dist.init_process_group(backend, init_method="tcp://127.0.0.1:29517", rank=rank, world_size=2)
res = []
for mb in sizes:
    n = int(mb * 2**20) // 2
    x = torch.ones(n, dtype=torch.bfloat16 if not cpu else torch.float16, device=dev)
    for i in range(reps + 2):
        dist.barrier()
        if not cpu: torch.cuda.synchronize()
        t = time.perf_counter()
        if rank == 0: dist.send(x, 1)
        else: dist.recv(x, 0)
        if not cpu: torch.cuda.synchronize()
        dt = time.perf_counter() - t
        if i >= 2 and rank == 1: res.append({"bytes": n * 2, "ms": dt * 1e3})
if rank == 1: print(json.dumps(res))
dist.destroy_process_group()
"""
    env = dict(os.environ)
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-c",
                code,
                str(r),
                json.dumps(sizes_mb),
                str(reps),
                "1" if cpu else "0",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for r in (0, 1)
    ]
    outs = [p.communicate(timeout=240) for p in procs]
    for p, (o, e) in zip(procs, outs):
        if p.returncode != 0:
            print(f"p2p probe failed: {e[-2000:]}", file=sys.stderr)
            return []
    rows = json.loads(outs[1][0].strip().splitlines()[-1])
    # median per size
    by = {}
    for r in rows:
        by.setdefault(r["bytes"], []).append(r["ms"])
    return [{"bytes": b, "ms": sorted(v)[len(v) // 2]} for b, v in sorted(by.items())]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--stages", nargs="+", default=list(DEFAULT_STAGES), help="config:layers")
    ap.add_argument("--batches", nargs="+", type=int, default=list(DEFAULT_BATCHES))
    ap.add_argument("--contexts", nargs="+", type=int, default=list(DEFAULT_CONTEXTS))
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--max-tokens-per-point", type=int, default=262144)
    # the rest holds a 256K-token prefill's activations (~20 GB for an 8B-shaped stage)
    ap.add_argument("--mem-fraction", type=float, default=0.7)
    ap.add_argument("--budget-s", type=float, default=450.0, help="wall time for all stages")
    ap.add_argument("--p2p", action="store_true", help="also probe NCCL p2p over loopback")
    ap.add_argument("--p2p-sizes-mb", nargs="+", type=float, default=[0.25, 1, 4, 8])
    ap.add_argument("--cpu-dry-run", action="store_true", help="tiny config on the CPU")
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp/out")))
    # worker mode (internal)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--model-dir", help=argparse.SUPPRESS)
    ap.add_argument("--worker-out", help=argparse.SUPPRESS)
    ap.add_argument("--worker-budget-s", type=float, default=1e9, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return worker(args)
    if args.cpu_dry_run:
        args.stages = ["tiny-llama:4", "tiny-llama:2"]
        args.batches = [1, 4]
        args.contexts = [16, 64]
        args.steps = 3
    args.out.mkdir(parents=True, exist_ok=True)
    t_start = time.time()
    result = {
        "script": "benchmark/gpu/stage_times.py",
        "argv": sys.argv[1:],
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "cpu_dry_run": args.cpu_dry_run,
        "stages": [],
        "not_run": [],
    }
    try:
        smi = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
        )
        result["gpu"] = smi.stdout.strip().splitlines()
    except (OSError, subprocess.SubprocessError):
        result["gpu"] = []
    tmp = Path(tempfile.mkdtemp(prefix="stage-times-"))
    for i, st in enumerate(args.stages):
        config, layers = st.split(":")
        left = args.budget_s - (time.time() - t_start)
        if left < 60:
            result["not_run"].append({"stage": st, "reason": f"{left:.0f} s of the budget left"})
            continue
        model_dir = _stage_config(config, int(layers), tmp)
        wout = tmp / f"w{i}.json"
        cmd = [
            sys.executable,
            __file__,
            "--worker",
            "--model-dir",
            str(model_dir),
            "--worker-out",
            str(wout),
            "--worker-budget-s",
            str(max(left - 45, 10)),
            "--steps",
            str(args.steps),
            "--max-tokens-per-point",
            str(args.max_tokens_per_point),
            "--mem-fraction",
            str(args.mem_fraction),
            "--batches",
            *map(str, args.batches),
            "--contexts",
            *map(str, args.contexts),
        ] + (["--cpu-dry-run"] if args.cpu_dry_run else [])
        print(f"[{time.time() - t_start:5.0f} s] {st}", flush=True)
        log = args.out / f"stage_times_{config}_{layers}l.log"
        with open(log, "w") as lf:
            rc = subprocess.run(
                cmd, stdout=lf, stderr=subprocess.STDOUT, timeout=max(left, 30)
            ).returncode
        sys.stdout.write("".join(line for line in open(log) if line.startswith("  B=")))
        if rc != 0 or not wout.is_file():
            result["not_run"].append({"stage": st, "reason": f"worker exit {rc}, see {log.name}"})
            continue
        w = json.loads(wout.read_text())
        result["stages"].append(
            {
                "model": config,
                "config_dir": f"benchmark/gpu/configs/{config}",
                "layers": int(layers),
                "includes": ["embedding", "lm_head", "sampling"],
                **w,
            }
        )
        (args.out / "stage_times.json").write_text(json.dumps(result, indent=1))
    if args.p2p and (args.budget_s - (time.time() - t_start)) > 30:
        print(f"[{time.time() - t_start:5.0f} s] p2p probe", flush=True)
        result["p2p_loopback"] = p2p_probe(args.out, args.p2p_sizes_mb, 5, args.cpu_dry_run)
    result["elapsed_s"] = round(time.time() - t_start, 1)
    shutil.rmtree(tmp, ignore_errors=True)
    (args.out / "stage_times.json").write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out / 'stage_times.json'} in {result['elapsed_s']} s")
    return 0 if result["stages"] else 1


if __name__ == "__main__":
    sys.exit(main())
