"""``--enable-mixed-chunk`` under SP: the running requests' SP rows ride along prefill chunks.

A small chunk (``--chunked-prefill-size 32``) against prompts of 30-40 tokens makes SGLang
admit about one prompt per chunk, so most prefill chunks find requests decoding: under SP
their rows (normal and speculative, on drafts a later verdict may reject) ride along the
chunk in one ``MIXED`` forward, here with paged KV (``--page-size 4``) in a pool too small for
all of them (requests are retracted and resumed). Greedy outputs equal
plain SGLang's, with and without mixed chunks (float64, so the extend and decode kernels agree
to the token), and the counters show that rows did ride along.
"""

from __future__ import annotations

import pytest

from .compare import compare_outputs
from .test_sp_lossless import sp_args, spexis_stats, tiny_prompts  # noqa: F401

pytestmark = pytest.mark.e2e

NEW_TOKENS = 24
MIXED = ["--enable-mixed-chunk", "--chunked-prefill-size", "32"]
# paged KV, and a pool the 16 requests outgrow: requests are retracted and resumed
PAGED_SMALL_KV = ["--page-size", "4", "--max-total-tokens", "600"]


def test_greedy_mixed_chunk_equals_plain_sglang(
    server_factory, tiny_model_dir, tiny_prompts  # noqa: F811
):
    model = ["--model-path", tiny_model_dir]
    plain = server_factory([*model, "--pp-size", "1"]).greedy_ids(tiny_prompts, NEW_TOKENS)
    # stock PP=2 mixes its decode batch into the chunks; its penalizers see the exact output
    # so far (no overlap scheduler under PP)
    plain_pp2_mixed = server_factory([*model, "--pp-size", "2", *MIXED], keep=False)
    plain_mixed = plain_pp2_mixed.greedy_ids(tiny_prompts, NEW_TOKENS)
    # (the later --chunked-prefill-size wins over sp_args' own; paged KV: a row riding along
    # takes its slot by SGLang's paged rule, the prefill beside it by its own; the small pool
    # retracts requests, the references never do)
    sp_server = server_factory(
        [*model, *sp_args(2, "random:0", "--spexis-alpha", "0.25", *MIXED, *PAGED_SMALL_KV)],
        keep=False,
    )
    before = spexis_stats(sp_server)
    got = sp_server.greedy_ids(tiny_prompts, NEW_TOKENS)
    after = spexis_stats(sp_server)
    for name, expected in (("plain", plain), ("plain with mixed chunks", plain_mixed)):
        cmp = compare_outputs(tiny_model_dir, tiny_prompts, expected, got)
        print(f"tiny model, SP with mixed chunks vs {name}:", cmp.summary())
        assert cmp.all_identical, cmp.summary()
    grew = {k: after[k] - before[k] for k in ("mixed_iterations", "rows_spec", "rows_stale")}
    print("counters:", grew)
    # rows rode along chunks (how many depends on how the prompts reach the scheduler),
    # speculative rows on drafts that were then rejected among them
    assert grew["mixed_iterations"] > 0, grew
    assert grew["rows_spec"] > 0 and grew["rows_stale"] > 0, grew

    # Requests whose rows need more than tokens (here a penalizer reading the output so far)
    # keep every chunk unmixed, and are still served exactly: a retracted request resumes
    # with its penalties counting the output it had (stock SGLang's prefill would start them
    # from zero, and a retraction would change its output).
    penalty = {"frequency_penalty": 0.5}
    expected = plain_pp2_mixed.greedy_ids(tiny_prompts, NEW_TOKENS, **penalty)
    before = spexis_stats(sp_server)
    got = sp_server.greedy_ids(tiny_prompts, NEW_TOKENS, **penalty)
    after = spexis_stats(sp_server)
    cmp = compare_outputs(tiny_model_dir, tiny_prompts, expected, got)
    print("tiny model, SP vs plain PP=2, mixed chunks, frequency penalty:", cmp.summary())
    assert cmp.all_identical, cmp.summary()
    assert after["mixed_iterations"] == before["mixed_iterations"], (before, after)
    # 16 requests of ~35 + 24 tokens in a 600-token pool: some were retracted and resumed
    assert after["retractions"] > 0, after
