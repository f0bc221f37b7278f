"""Benchmark-only forced acceptance: labelled outputs, the requested acceptance rate, and the
measured effective batch against the paper's Eq. 2 for a 3-stage pipeline."""

from __future__ import annotations

import pytest

from spexis_sglang.core.cost_model import b_eff_star
from spexis_sglang.srt.sp_scheduler import FORCED_LABEL

from .prompts import templated
from .test_sp_lossless import sp_args, spexis_stats

pytestmark = pytest.mark.e2e

THETA = 0.7


def test_forced_acceptance_is_labelled_and_matches_eq2(server_factory, tiny_model_dir):
    args = ["--model-path", tiny_model_dir, "--load-format", "dummy"]
    args += sp_args(3, "random:0", "--spexis-benchmark-force-accept", str(THETA))
    server = server_factory(args)
    prompts = templated(tiny_model_dir, [f"Tell me about the number {i}." for i in range(16)])
    before = spexis_stats(server)
    out = server.generate(
        {
            "input_ids": prompts,
            "sampling_params": {"temperature": 0.0, "max_new_tokens": 150, "ignore_eos": True},
        }
    )
    after = spexis_stats(server)
    for o in out:
        labels = o["meta_info"].get(FORCED_LABEL)
        assert labels is not None, o["meta_info"].keys()
        assert len(labels) == len(o["output_ids"]) == 150
        assert set(labels) == {THETA}
    d = {k: after[k] - before[k] for k in after if isinstance(after[k], (int, float))}
    verdicts = d["accepted"] + d["rejected"]
    theta = d["accepted"] / verdicts
    # 2000+ Bernoulli(0.7) verdicts: 5 standard deviations is about 0.05
    assert verdicts > 1000
    assert theta == pytest.approx(THETA, abs=0.05)
    measured = d["tokens_committed"] / (d["rows_normal"] + d["rows_spec"])
    predicted = b_eff_star(1.0, 3, theta)
    print(f"N=3 forced theta={theta:.3f}: tokens/row {measured:.4f}, Eq. 2 {predicted:.4f}")
    assert measured == pytest.approx(predicted, rel=0.05)
