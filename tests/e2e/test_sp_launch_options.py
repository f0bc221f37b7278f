"""SGLang launch options combined with SP (issue 14): greedy outputs equal plain SGLang's.

``--dp-size 2``: SGLang's DataParallelController starts one full PP group per replica with the
launcher's ``run_scheduler_process_func``, so each replica runs its own SP loop (its own
draft head, SlotState and KV pool) and the controller spreads requests round-robin. The test
checks that both replicas speculated on their share of the prompts. It runs the tiny model
(four scheduler processes of the default model in float64 need more memory than a busy CI
machine reliably has; by hand, ``--dp-size 2 --pp-size 2 --spexis-draft-head bundled`` on the
default model gave the same tokens as plain SGLang too).
"""

from __future__ import annotations

import pytest
import requests

from .compare import compare_outputs
from .test_sp_lossless import sp_args, tiny_prompts  # noqa: F401

pytestmark = pytest.mark.e2e

NEW_TOKENS = 32


def replica_stats(server):
    """Each data-parallel replica's Spexis counters (``/server_info``, one entry per DP rank)."""
    info = requests.get(server.base_url + "/server_info", timeout=60).json()
    return [state["spexis"] for state in info["internal_states"]]


def test_greedy_dp2_pp2_equals_plain_sglang(
    server_factory, tiny_model_dir, tiny_prompts  # noqa: F811
):
    model = ["--model-path", tiny_model_dir]
    expected = server_factory([*model, "--pp-size", "1"]).greedy_ids(tiny_prompts, NEW_TOKENS)
    sp_server = server_factory([*model, *sp_args(2, "random:0", "--dp-size", "2")])
    before = replica_stats(sp_server)
    got = sp_server.greedy_ids(tiny_prompts, NEW_TOKENS)
    after = replica_stats(sp_server)
    cmp = compare_outputs(tiny_model_dir, tiny_prompts, expected, got)
    print("tiny model, DP=2 x PP=2 SP vs plain PP=1:", cmp.summary())
    assert cmp.all_identical, cmp.summary()
    # both replicas served their half (round-robin), speculated, and had drafts rejected
    assert len(after) == 2
    for b, a in zip(before, after):
        d = {k: a[k] - b[k] for k in ("tokens_committed", "rows_spec", "rows_stale")}
        print("replica:", d)
        # (a request's first token comes from its prefill, not from an SP row)
        assert d["tokens_committed"] >= len(tiny_prompts) // 2 * (NEW_TOKENS - 1)
        assert d["rows_spec"] > 0 and d["rows_stale"] > 0
