"""Stage 0's forward replayed from CUDA graphs makes the same drafts as eager execution.

The draft head and the length predictor run inside stage 0's ``model.forward``, so SGLang's
decode graphs capture them. A replay must give exactly the drafts, confidences and length
buckets of eager execution: with batch-invariant kernels (``--enable-deterministic-inference``,
``benchmark/gpu/sp_correctness.sh``) the two servers then accept and reject the same drafts,
predict the same endings and emit the same tokens. A replay that read stale graph memory or a
stale host tensor would change the verdict counts even though the outputs stay lossless.

GPU only (CPU servers never capture graphs); on two GPUs it runs with the other e2e tests.
"""

from __future__ import annotations

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


def test_graph_replay_drafts_equal_eager(server_factory, model_dir, trained_head):
    prompts = lossless_prompts(model_dir, 16)
    args = sp_args(2, trained_head, "--spexis-length-predictor", "bundled")
    runs = {}
    for mode, extra in (("graph", []), ("eager", ["--disable-cuda-graph"])):
        server = server_factory(args + extra)
        before = spexis_stats(server)
        out = server.greedy_ids(prompts, 48)
        after = spexis_stats(server)
        runs[mode] = (out, {k: after[k] - before[k] for k in COUNTERS + _FORWARDS})
        print(mode, runs[mode][1])
    (g_out, g), (e_out, e) = runs["graph"], runs["eager"]
    assert g["decode_graph_replays"] > 0 and g["decode_eager_forwards"] == 0
    assert e["decode_graph_replays"] == 0 and e["decode_eager_forwards"] > 0
    assert g_out == e_out
    assert {k: g[k] for k in COUNTERS} == {k: e[k] for k in COUNTERS}
    assert g["rows_predicted_ending"] > 0  # the predictor ran inside the graph
