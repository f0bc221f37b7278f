"""Look-ahead admission in a real server: the default model, its shipped draft head and length
predictor, a KV pool too small for the load. The gate decides how many requests to admit in
place of SGLang's reservation: some earlier than SGLang would, some held back.
Requests are admitted at other times, never changed."""

from __future__ import annotations

import time

import pytest

from spexis_sglang.testing import SPEXIS_RETRACT_LINE

from .compare import compare_outputs
from .conftest import start_server
from .prompts import lossless_prompts
from .test_sp_lossless import BASELINE, sp_args, spexis_stats, trained_head  # noqa: F401

pytestmark = pytest.mark.e2e

# up to 80 tokens: some of these prompts' outputs end at 8 to 22 tokens while the others run
# on to the limit, the memory SGLang's reservation leaves idle (with 64 tokens in a larger pool
# most end together and the gate admits what SGLang would). Seen: 5 requests admitted early,
# 236 gated iterations, 29 rows predicted ending, 2 retractions.
PROMPTS, NEW_TOKENS, KV_TOKENS = 8, 80, 250
# requests end at EOS or max_new_tokens, as in real use (the predictor predicts EOS)
PARAMS = {"ignore_eos": False}


def test_lookahead_admission_decides_the_count_under_memory_pressure_and_is_lossless(
    server_factory, model_dir, trained_head
):
    prompts = lossless_prompts(model_dir, PROMPTS)
    baseline = server_factory(BASELINE)
    expected = baseline.greedy_ids(prompts, NEW_TOKENS, **PARAMS)
    args = ["--spexis-length-predictor", "bundled", "--spexis-lookahead-admission"]
    args += ["--max-total-tokens", str(KV_TOKENS)]
    # not a session server: one more PP=2 server for the rest of the suite costs memory
    sp_server = start_server(sp_args(2, trained_head, *args))
    try:
        got = sp_server.greedy_ids(prompts, NEW_TOKENS, **PARAMS)
        stats = spexis_stats(sp_server)
        time.sleep(2)  # idle: SGLang's leak check runs and would kill a leaking scheduler
        alive = sp_server.alive()
        with open(sp_server.log_path) as f:
            log = f.read()
    finally:
        sp_server.stop()
    retractions = log.count(SPEXIS_RETRACT_LINE)
    print(
        f"look-ahead admission: {stats['admissions_early']} requests admitted before SGLang's "
        f"reservation would, {stats['admissions_delayed']} delayed, "
        f"{stats['admission_gated_iterations']} iterations held some back, "
        f"{retractions} retractions, "
        f"{stats['rows_predicted_ending']} rows predicted to end within 64 tokens, "
        f"acceptance {stats['acceptance_rate']:.3f}"
    )
    assert alive
    assert f"Spexis look-ahead admission: KV capacity {KV_TOKENS} tokens, 2 stages" in log
    # the predictor ran on stage 0; the gate admitted requests SGLang's reservation would
    # still have held back, and held others back
    assert stats["rows_predicted_ending"] > 0
    assert stats["admissions_early"] > 0 and stats["admission_gated_iterations"] > 0
    cmp = compare_outputs(model_dir, prompts, expected, got)
    print("look-ahead admission vs plain:", cmp.summary())
    assert cmp.all_identical, cmp.summary()
