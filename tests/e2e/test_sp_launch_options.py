"""SGLang launch options combined with SP (issue 14): greedy outputs equal plain SGLang's.

``--dp-size 2``: SGLang's DataParallelController starts one full PP group per replica with the
launcher's ``run_scheduler_process_func``, so each replica runs its own SP loop (its own
draft head, SlotState and KV pool) and the controller spreads requests round-robin. The test
checks that both replicas speculated on their share of the prompts. It runs the tiny model
(four scheduler processes of the default model in float64 need more memory than a busy CI
machine reliably has; by hand, ``--dp-size 2 --pp-size 2 --spexis-draft-head bundled`` on the
default model gave the same tokens as plain SGLang too).

``--page-size 4``: SP allocates a new position the way SGLang's paged ``alloc_decode`` does (a
position that opens a page takes a fresh page, any other continues its request's last page),
re-executes a rejected position in its own slot, and when a request ends or is retracted frees
the whole pages past its verified tokens, leaving the page that holds the last verified one to
SGLang's release. (On CPU the paged allocator's two triton kernels run as torch stand-ins,
``cpu_support/paged_kernels.py``; plain SGLang could not serve ``--page-size > 1`` here before.)
"""

from __future__ import annotations

import time

import pytest
import requests

from .compare import compare_outputs
from .prompts import templated
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


def test_paged_kv_under_memory_pressure_equals_plain_sglang(server_factory, tiny_model_dir):
    """Pages of 4 slots, a pool too small for the batch (SP retracts), prompts sharing a
    templated prefix (page-aligned radix hits), and a second pass over the same prompts
    (whole prompts cached): same tokens as plain SGLang with one-slot pages, and SGLang's
    idle leak check (it kills a scheduler whose pool lost a page) passes."""
    model = ["--model-path", tiny_model_dir]
    baseline = server_factory([*model, "--pp-size", "1"])
    pressure = ["--max-total-tokens", "600", "--chunked-prefill-size", "128"]
    sp_server = server_factory([*model, *sp_args(2, "random:0", "--page-size", "4", *pressure)])
    prompts = templated(
        tiny_model_dir, [f"Question {i}: list {i + 2} things about {i * 7}." for i in range(12)]
    )
    expected = baseline.greedy_ids(prompts, 80)
    for attempt in range(2):
        got = sp_server.greedy_ids(prompts, 80)
        cmp = compare_outputs(tiny_model_dir, prompts, expected, got)
        print(f"page size 4, pass {attempt}:", cmp.summary())
        assert cmp.all_identical, cmp.summary()
    with open(sp_server.log_path) as f:
        retractions = f.read().count("KV cache pool is full, retracting request")
    print(f"{retractions} retractions")
    assert retractions > 0  # the test really exercised retraction
    stats = replica_stats(sp_server)[0]
    assert stats["rows_spec"] > 0 and stats["rows_stale"] > 0
    time.sleep(2)  # idle: SGLang's leak check runs and would kill a leaking scheduler
    assert sp_server.alive()
