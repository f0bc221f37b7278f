"""SGLang launch options combined with SP: greedy outputs equal plain SGLang's.

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
from typing import List

import pytest
import requests

from spexis_sglang.testing import SPEXIS_RETRACT_LINE

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
    sp_server = server_factory([*model, *sp_args(2, "random:0", "--dp-size", "2")], keep=False)
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


def early_stops(outputs: List[List[int]]) -> List[dict]:
    """Per prompt, greedy sampling that stops on the token its full output ends with. The tiny
    model's greedy output settles on one repeated token after a few, so each request ends
    early, with an SP row past its end still in flight."""
    return [
        {
            "temperature": 0.0,
            "max_new_tokens": len(out),
            "ignore_eos": False,
            "stop_token_ids": [out[-1]],
        }
        for out in outputs
    ]


def output_ids(server, prompts: List[List[int]], sampling: List[dict]) -> List[List[int]]:
    out = server.generate({"input_ids": prompts, "sampling_params": sampling})
    return [o["output_ids"] for o in out]


def assert_pools_intact(server) -> None:
    """SGLang's idle check (every stage's KV pool and request slots) found no leak: it raises
    in the scheduler, which then stops serving."""
    time.sleep(3)  # idle: the check runs
    r = requests.get(server.base_url + "/health_generate", timeout=300)
    assert r.status_code == 200
    with open(server.log_path) as f:
        log = f.read()
    assert "memory leak detected" not in log and "Traceback" not in log


def test_paged_kv_under_memory_pressure_equals_plain_sglang(server_factory, tiny_model_dir):
    """Pages of 4 slots, a pool too small for the batch (SP retracts), prompts sharing a
    templated prefix (page-aligned radix hits), a second pass over the same prompts (whole
    prompts cached), and a pass that stops each request early (rows in flight past its end,
    so unverified pages are freed): same tokens as plain SGLang with one-slot pages, and no
    page leaks."""
    model = ["--model-path", tiny_model_dir]
    prompts = templated(
        tiny_model_dir, [f"Question {i}: list {i + 2} things about {i * 7}." for i in range(12)]
    )
    # every baseline output first: starting the SP server may stop the baseline (conftest)
    baseline = server_factory([*model, "--pp-size", "1"])
    expected = baseline.greedy_ids(prompts, 80)
    stops = early_stops(expected)
    expected_stop = output_ids(baseline, prompts, stops)
    pressure = ["--max-total-tokens", "600", "--chunked-prefill-size", "128"]
    sp_server = server_factory([*model, *sp_args(2, "random:0", "--page-size", "4", *pressure)])
    for attempt in range(2):
        got = sp_server.greedy_ids(prompts, 80)
        cmp = compare_outputs(tiny_model_dir, prompts, expected, got)
        print(f"page size 4, pass {attempt}:", cmp.summary())
        assert cmp.all_identical, cmp.summary()
    with open(sp_server.log_path) as f:
        retractions = f.read().count(SPEXIS_RETRACT_LINE)
    print(f"{retractions} retractions")
    assert retractions > 0  # the test really exercised retraction
    got = output_ids(sp_server, prompts, stops)
    cmp = compare_outputs(tiny_model_dir, prompts, expected_stop, got)
    print("page size 4, early stops:", cmp.summary(), [len(x) for x in got])
    assert cmp.all_identical, cmp.summary()
    # every request stopped early, and their KV ends fall on every offset in a page: some
    # in-flight rows past an end opened a page of their own (which must be freed; breaking
    # that free makes this test fail in SGLang's idle leak check)
    assert all(len(x) < 80 for x in got)
    assert {(len(p) + len(x)) % 4 for p, x in zip(prompts, got)} == {0, 1, 2, 3}
    stats = replica_stats(sp_server)[0]
    assert stats["rows_spec"] > 0 and stats["rows_stale"] > 0
    assert_pools_intact(sp_server)
