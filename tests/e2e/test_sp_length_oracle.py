"""Benchmark-only length oracle in a real server (tiny dummy-weight model, PP=2): its buckets
reach look-ahead admission, it is labelled, and outputs are those of the same server without
it (admission only moves when requests start)."""

from __future__ import annotations

import random
import time

import pytest
import requests

from spexis_sglang.srt.sp_length_oracle import LENGTH_ORACLE_LABEL

from .conftest import start_server
from .test_sp_lossless import sp_args

pytestmark = pytest.mark.e2e

REQUESTS, PROMPT_LEN, KV_TOKENS = 12, 24, 700
ORACLE = ["--spexis-benchmark-length-oracle", "perfect", "--spexis-lookahead-admission"]


def _payload():
    """Requests of fixed lengths (ignore_eos, lengths as in a ShareGPT replay), and one that
    may end at EOS (no prediction for it)."""
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 1000) for _ in range(PROMPT_LEN)] for _ in range(REQUESTS)]
    params = [
        {"temperature": 0.0, "max_new_tokens": rng.randrange(8, 90), "ignore_eos": True}
        for _ in range(REQUESTS - 1)
    ]
    params.append({"temperature": 0.0, "max_new_tokens": 40, "ignore_eos": False})
    return {"input_ids": prompts, "sampling_params": params}


def _serve(args):
    server = start_server(args)
    try:
        out = server.generate(_payload())
        info = requests.get(server.base_url + "/server_info", timeout=60).json()
        metrics = requests.get(server.base_url + "/metrics", timeout=60).text
        time.sleep(2)  # idle: SGLang's leak check runs and would kill a leaking scheduler
        alive = server.alive()
        with open(server.log_path) as f:
            log = f.read()
    finally:
        server.stop()
    assert alive
    return [o["output_ids"] for o in out], info["internal_states"][0], log, metrics


def test_length_oracle_buckets_reach_admission_labelled_and_lossless(tiny_model_dir):
    common = ["--model-path", tiny_model_dir, "--load-format", "dummy"]
    common += ["--max-total-tokens", str(KV_TOKENS), "--skip-tokenizer-init", "--enable-metrics"]
    # one server at a time: the plain SP server first
    expected, plain_state, _, plain_metrics = _serve(sp_args(2, "random:0", *common))
    assert LENGTH_ORACLE_LABEL not in plain_state
    assert plain_state["spexis"]["rows_predicted_ending"] == 0
    got, state, log, metrics = _serve(sp_args(2, "random:0", *common, *ORACLE))
    stats, oracle = state["spexis"], state[LENGTH_ORACLE_LABEL]
    print(
        f"length oracle: {stats['rows_predicted_ending']} rows predicted to end within 64 "
        f"tokens, {stats['admissions_delayed']} requests delayed, oracle {oracle}"
    )
    assert "Spexis BENCHMARK MODE: remaining-length predictions come from a length oracle" in log
    assert "Spexis look-ahead admission: KV capacity" in log
    assert "predictor precision [1.0, 1.0, 1.0, 1.0, 1.0]" in log  # the oracle's, stated
    assert oracle["benchmark_only"] and oracle["preset"] == "perfect"
    assert stats["rows_predicted_ending"] > 0
    assert (
        oracle["admissions_predicted"] >= REQUESTS - 1 and oracle["admissions_unpredictable"] >= 1
    )
    assert oracle["rows_unpredictable"] > 0
    # the perfect oracle's buckets are the truth, and the truth is the server's: every
    # predicted request had a row producing its last token (remaining 1), none went past it
    assert oracle["measured_precision"] == [1.0] * 5 and oracle["measured_recall"] == [1.0] * 5
    assert oracle["rows_at_last_token"] >= REQUESTS - 1 and oracle["rows_past_end"] == 0
    mode = [m for m in metrics.splitlines() if m.startswith("spexis:benchmark_mode{")]
    assert len(mode) == 1 and 'mode="length_oracle"' in mode[0] and mode[0].endswith(" 1.0")
    assert "spexis:benchmark_mode{" not in plain_metrics
    assert [len(o) for o in got] == [len(o) for o in expected]
    assert got == expected
