"""Benchmark-only forced acceptance: labelled outputs, the requested acceptance rate, and the
measured effective batch against the paper's Eq. 2 for a 3-stage pipeline."""

from __future__ import annotations

import pytest

from spexis_sglang.core.cost_model import b_eff_star
from spexis_sglang.srt.sp_scheduler import FORCED_LABEL
from spexis_sglang.srt.stats import SP_PHASES

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


def test_forced_acceptance_per_request_theta(server_factory, tiny_model_dir):
    """One server sweeps several thetas: ``custom_params.spexis_force_accept`` per request."""
    import requests

    args = ["--model-path", tiny_model_dir, "--load-format", "dummy"]
    args += sp_args(3, "random:0", "--spexis-benchmark-force-accept", str(THETA))
    server = server_factory(args)  # the same server as above
    prompts = templated(tiny_model_dir, [f"Count to {i}." for i in range(12)])
    own_theta = 0.25
    before = spexis_stats(server)
    out = server.generate(
        {
            "input_ids": prompts,
            "sampling_params": {
                "temperature": 0.0,
                "max_new_tokens": 120,
                "ignore_eos": True,
                "custom_params": {"spexis_force_accept": own_theta},
            },
        }
    )
    after = spexis_stats(server)
    for o in out:
        assert set(o["meta_info"][FORCED_LABEL]) == {own_theta}
    d = {k: after[k] - before[k] for k in after if isinstance(after[k], (int, float))}
    verdicts = d["accepted"] + d["rejected"]
    assert verdicts > 500
    assert d["accepted"] / verdicts == pytest.approx(own_theta, abs=0.06)
    # the loop's phase timers add up to no more than its busy time
    phases = [k for k in d if k.startswith("time_") and k != "time_busy_s"]
    assert len(phases) == len(SP_PHASES) and all(d[k] >= 0 for k in phases)
    # forced acceptance is timed apart from result processing (benchmarks leave it out)
    assert d["time_forced_s"] > 0 and d["cpu_forced_s"] > 0
    assert 0 < sum(d[k] for k in phases) <= d["time_busy_s"] * 1.001

    bad = requests.post(
        server.base_url + "/generate",
        json={
            "input_ids": prompts[0],
            "sampling_params": {"max_new_tokens": 4, "custom_params": {"spexis_force_accept": 1.5}},
        },
        timeout=120,
    )
    assert "spexis_force_accept must be a number in [0, 1], got 1.5" in bad.text


def test_penalties_are_served_and_grammars_refused_with_a_clear_error(
    server_factory, tiny_model_dir
):
    """Penalties and min_new_tokens run under SP (their equality with plain SGLang is in
    test_sp_penalties.py); constrained decoding, served under SP (test_sp_grammar.py), is
    refused by name in this benchmark-only mode, and the server serves on."""
    import requests

    args = ["--model-path", tiny_model_dir, "--load-format", "dummy"]
    args += sp_args(3, "random:0", "--spexis-benchmark-force-accept", str(THETA))
    server = server_factory(args)  # the same server as above
    prompt = templated(tiny_model_dir, ["Say something."])[0]
    penalized = server.generate(
        {
            "input_ids": [prompt],
            "sampling_params": {
                "temperature": 0.0,
                "max_new_tokens": 8,
                "frequency_penalty": 0.5,
                "presence_penalty": 0.5,
                "repetition_penalty": 1.3,
                "min_new_tokens": 2,
            },
        }
    )
    assert len(penalized[0]["output_ids"]) == 8
    bad = requests.post(
        server.base_url + "/generate",
        json={"input_ids": prompt, "sampling_params": {"max_new_tokens": 8, "regex": "[ab]+"}},
        timeout=120,
    )
    # a forced acceptance could commit a token the grammar forbids (sp_grammar)
    assert "--spexis-benchmark-force-accept does not support regex" in bad.text, bad.text
    out = server.generate(
        {"input_ids": [prompt], "sampling_params": {"temperature": 0.0, "max_new_tokens": 8}}
    )
    assert len(out[0]["output_ids"]) == 8


def test_full_batch_is_admitted_across_a_prefill_chunk_boundary(server_factory, tiny_model_dir):
    """64 requests whose prefill spans several chunks (one request split across two) all
    decode together: SP's single running batch must not stay "full" after the chunked
    request (measured before the fix: 32 rows per iteration, the last request queued for a
    whole wave)."""
    import random

    batch, prompt_len, new_tokens = 64, 16, 96
    args = ["--model-path", tiny_model_dir, "--load-format", "dummy", "--skip-tokenizer-init"]
    args += sp_args(2, "random:0", "--spexis-benchmark-force-accept", "0.76")
    args += ["--max-running-requests", str(batch), "--chunked-prefill-size", "250"]
    args += ["--max-total-tokens", str(int(batch * (prompt_len + new_tokens) * 1.068))]
    # sp_args sets --chunked-prefill-size 256; the last value wins
    server = server_factory(args)
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 1000) for _ in range(prompt_len)] for _ in range(batch)]
    before = spexis_stats(server)
    out = server.generate(
        {
            "input_ids": prompts,
            "sampling_params": {
                "temperature": 0.0,
                "max_new_tokens": new_tokens,
                "ignore_eos": True,
            },
        }
    )
    after = spexis_stats(server)
    assert all(len(o["output_ids"]) == new_tokens for o in out)
    iterations = after["decode_iterations"] - before["decode_iterations"]
    rows = (after["rows_normal"] + after["rows_spec"]) - (
        before["rows_normal"] + before["rows_spec"]
    )
    print(f"rows per decode iteration: {rows / iterations:.1f} of {batch}")
    assert rows / iterations >= 0.8 * batch
