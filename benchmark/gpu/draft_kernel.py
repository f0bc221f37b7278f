"""Stage 0's draft from the logits on a GPU: the fused Triton pass (``srt/draft_triton.py``)
against PyTorch's ops (``greedy_draft``, then ``pack_drafts``: what ``SPEXIS_DRAFT_FUSED=0`` runs),
checked and timed.

For each vocabulary, dtype and row count: random logits with planted ties (two equal maxima,
the first must win) and, in one row, nothing but ``-inf`` (a grammar masked every draft id:
confidence 0), and a length bucket per row. The ids and the packed block's id and bucket
columns must be equal; the confidences within ``--rtol``. Each variant is
timed as a CUDA graph of ``--reps`` calls (what a replay costs), with CUDA events.

    python benchmark/gpu/draft_kernel.py --out $OUT/draft_kernel.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "python"))

from spexis_sglang.srt import draft_model  # noqa: E402
from spexis_sglang.srt.draft_triton import greedy_draft_fused  # noqa: E402
from spexis_sglang.srt.protocol import pack_drafts  # noqa: E402


def torch_packed(logits, buckets):
    """PyTorch's ops: the drafts and the block stage 0 reads back."""
    ids, conf = draft_model.greedy_draft(logits)
    return ids, conf, pack_drafts(ids, conf, buckets)


def logits_for(rows: int, vocab: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(rows, vocab, device="cuda", generator=g) * 4
    x = x.to(dtype)
    if rows >= 2:
        best = x[1].max()
        x[1, vocab // 3] = best + 1
        x[1, vocab - 1] = best + 1  # a tie: the first id must win
    if rows >= 3:
        x[2] = float("-inf")
    return x


def graph_ms(fn, reps: int) -> float:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # warm-up (Triton compiles here)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 16, 64, 128, 256, 512])
    ap.add_argument("--vocabs", type=int, nargs="+", default=[49152, 128256, 151936])
    ap.add_argument("--dtypes", nargs="+", default=["bfloat16", "float16", "float32"])
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--rtol", type=float, default=1e-5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    records, failures = [], 0
    for vocab in args.vocabs:
        for dtype_name in args.dtypes:
            dtype = getattr(torch, dtype_name)
            for rows in args.rows:
                x = logits_for(rows, vocab, dtype, seed=rows + vocab)
                buckets = torch.arange(rows, device="cuda", dtype=torch.int64) % 5
                ids_t, conf_t, packed_t = torch_packed(x, buckets)
                ids_f, conf_f, packed_f = greedy_draft_fused(x, buckets)
                ids_equal = bool(torch.equal(ids_t, ids_f))
                ids_equal &= bool(torch.equal(packed_t[:, [0, 2]], packed_f[:, [0, 2]]))
                conf_ok = bool(torch.allclose(conf_f, conf_t, rtol=args.rtol, atol=0.0))
                conf_ok &= bool(torch.equal(packed_f[:, 1], conf_f.double()))
                failures += not (ids_equal and conf_ok)
                rec = {
                    "vocab": vocab,
                    "dtype": dtype_name,
                    "rows": rows,
                    "ids_equal": ids_equal,
                    "conf_within_rtol": conf_ok,
                    "conf_max_rel_diff": float(
                        ((conf_f - conf_t).abs() / conf_t.abs().clamp_min(1e-30)).max()
                    ),
                    "torch_ms": graph_ms(lambda: torch_packed(x, buckets), args.reps),
                    "fused_ms": graph_ms(lambda: greedy_draft_fused(x, buckets), args.reps),
                }
                rec["speedup"] = rec["torch_ms"] / rec["fused_ms"]
                records.append(rec)
                print(json.dumps(rec), flush=True)
    result = {
        "script": "benchmark/gpu/draft_kernel.py",
        "command": "python " + " ".join(["benchmark/gpu/draft_kernel.py", *sys.argv[1:]]),
        "device": torch.cuda.get_device_name(),
        "unit": "ms per call, CUDA graph of --reps calls",
        "failures": failures,
        "records": records,
    }
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
