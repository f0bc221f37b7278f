"""Stage 0's forward replayed from CUDA graphs makes the same drafts as eager execution.

The draft head and the length predictor run inside stage 0's ``model.forward``, so SGLang's
decode graphs capture them. A replay must give exactly the drafts, confidences and length
buckets of eager execution. Both servers log every decode row's draft as stage 0's scheduler
received it (``SPEXIS_DRAFT_LOG``, written after the replay) and the test compares them row by
row, keyed by (request, position, input token): with batch-invariant kernels
(``--enable-deterministic-inference``, ``benchmark/correctness/sp_correctness_gpu.sh``) a
replay that read stale graph memory or a stale host tensor would show here even where outputs
stay lossless.

GPU only (CPU servers never capture graphs). With two GPUs each stage has its own; on one GPU
both stages share it (``SPEXIS_SHARE_GPU=1``, ``srt/hooks.share_one_gpu``).
"""

from __future__ import annotations

import json
from typing import Dict, Tuple

import pytest

from spexis_sglang.cpu_support import cuda_available

from .prompts import lossless_prompts
from .test_sp_lossless import sp_args, spexis_stats, trained_head  # noqa: F401

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(not cuda_available(), reason="CUDA graphs need a GPU"),
]

COUNTERS = ("accepted", "rejected", "rows_spec", "rows_stale", "rows_predicted_ending")
_FORWARDS = ("decode_graph_replays", "decode_eager_forwards")
# bf16 model, fp32 softmax: the same kernels on the same rows give the same bits; the slack
# only keeps a last-ulp difference of a reduction order from failing a correct replay
CONF_ATOL = 1e-4
NUM_PROMPTS, NEW_TOKENS = 16, 48
RID_PREFIX = "graphs-"

Key = Tuple[str, int, int]


def _gpu_env(log_path: str) -> Dict[str, str]:
    import torch

    env = {"SPEXIS_DRAFT_LOG": log_path}
    if torch.cuda.device_count() < 2:
        env["SPEXIS_SHARE_GPU"] = "1"
    return env


def read_draft_log(path: str, rid_prefix: str = "") -> Dict[Key, Tuple[int, float, int]]:
    """(rid, position, input token) -> (draft, confidence, bucket) of the rows of live
    requests whose id starts with ``rid_prefix`` (not the server's warm-up, say)."""
    rows: Dict[Key, Tuple[int, float, int]] = {}
    with open(path) as f:
        for line in f:
            r = json.loads(line)
            buckets = r["buckets"] or [None] * len(r["rids"])
            for rid, pos, tok, d, c, b in zip(
                r["rids"], r["positions"], r["tokens"], r["drafts"], r["conf"], buckets
            ):
                if rid is None or not rid.startswith(rid_prefix):
                    continue
                key = (rid, pos, tok)
                # the same prefix twice (a rebuilt row) must draft the same token
                if key in rows:
                    assert rows[key][0] == d, f"{path}: row {key} drafted {rows[key][0]} then {d}"
                rows[key] = (d, c, b)
    return rows


def test_graph_replay_drafts_equal_eager(server_factory, model_dir, trained_head, tmp_path):
    prompts = lossless_prompts(model_dir, NUM_PROMPTS)
    args = sp_args(2, trained_head, "--spexis-length-predictor", "bundled")
    runs = {}
    for mode, extra in (("graph", []), ("eager", ["--disable-cuda-graph"])):
        log = str(tmp_path / f"drafts-{mode}.jsonl")
        server = server_factory(args + extra, env=_gpu_env(log))
        before = spexis_stats(server)
        out = server.generate(
            {
                "input_ids": prompts,
                "rid": [f"{RID_PREFIX}{i}" for i in range(len(prompts))],
                "sampling_params": {
                    "temperature": 0.0,
                    "max_new_tokens": NEW_TOKENS,
                    "ignore_eos": True,
                },
            }
        )
        after = spexis_stats(server)
        counts = {k: after[k] - before[k] for k in COUNTERS + _FORWARDS}
        runs[mode] = ([o["output_ids"] for o in out], counts, read_draft_log(log, RID_PREFIX))
        print(mode, counts, f"{len(runs[mode][2])} logged rows")
    (g_out, g, g_rows), (e_out, e, e_rows) = runs["graph"], runs["eager"]
    assert g["decode_graph_replays"] > 0 and g["decode_eager_forwards"] == 0
    assert e["decode_graph_replays"] == 0 and e["decode_eager_forwards"] > 0
    assert g_out == e_out

    common = g_rows.keys() & e_rows.keys()
    union = g_rows.keys() | e_rows.keys()
    print(f"rows: graph {len(g_rows)}, eager {len(e_rows)}, common {len(common)}")
    assert len(common) >= 0.95 * len(union), "the two servers drafted for different rows"
    assert len(common) >= NUM_PROMPTS * (NEW_TOKENS // 2)
    draft_diff = sorted(k for k in common if g_rows[k][0] != e_rows[k][0])
    bucket_diff = sorted(k for k in common if g_rows[k][2] != e_rows[k][2])
    conf_err = max(abs(g_rows[k][1] - e_rows[k][1]) for k in common)
    print(
        f"drafts differing {len(draft_diff)}, buckets differing {len(bucket_diff)}, "
        f"max |conf diff| {conf_err:.3g}"
    )
    assert not draft_diff, f"replayed drafts differ from eager at {draft_diff[:5]}"
    assert not bucket_diff, f"replayed length buckets differ from eager at {bucket_diff[:5]}"
    assert conf_err <= CONF_ATOL
    assert any(g_rows[k][2] >= 0 for k in common)  # the predictor ran inside the graph
    assert {k: g[k] for k in COUNTERS} == {k: e[k] for k in COUNTERS}
