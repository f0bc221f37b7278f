"""Speculative parallelism is lossless: same tokens as plain SGLang (greedy), same distribution
(sampling), on real CPU servers."""

from __future__ import annotations

import json
import math
import os
import re
import time
from collections import Counter
from typing import Dict, List

import numpy as np
import pytest
import requests

from spexis_sglang.cpu_support import cuda_available
from spexis_sglang.srt.bundled import BundledHeadError, bundled_draft_head
from spexis_sglang.srt.config import ENV_DRAFT_TRACE, ENV_PP_TRANSPORT
from spexis_sglang.srt.relay import RELAY_LOG_LINE
from spexis_sglang.srt.stage_link import PACKED_LINK_LOG_LINE
from spexis_sglang.testing import SPEXIS_RETRACT_LINE

from .compare import compare_outputs
from .prompts import lossless_prompts, templated

pytestmark = pytest.mark.e2e

BASELINE = ["--pp-size", "1"]


def sp_args(pp: int, head: str, *extra: str) -> List[str]:
    return [
        "--pp-size",
        str(pp),
        "--spexis-draft-head",
        head,
        "--spexis-log-interval",
        "5",
        "--chunked-prefill-size",
        "256",
        *extra,
    ]


def rank0_state(server) -> Dict[str, object]:
    info = requests.get(server.base_url + "/server_info", timeout=60).json()
    return info["internal_states"][0]


def spexis_stats(server) -> Dict[str, float]:
    return rank0_state(server)["spexis"]


@pytest.fixture(scope="module")
def trained_head(model_dir) -> str:
    """The shipped head at the 1/2 exit of SmolLM2 (stage 0 of PP=2).

    ``SPEXIS_TEST_DRAFT_HEAD`` overrides it (e.g. to try a freshly trained head).
    """
    if os.environ.get("SPEXIS_TEST_DRAFT_HEAD"):
        return os.environ["SPEXIS_TEST_DRAFT_HEAD"]
    try:
        return bundled_draft_head(model_dir, 2)
    except BundledHeadError as e:  # pragma: no cover - the artifact is committed
        pytest.fail(str(e))


def test_greedy_default_model_pp2_equals_plain_sglang(server_factory, model_dir, trained_head):
    """The shipped head on PP=2: plain SGLang's tokens, and in the same run committed tokens
    per launched row = 1 / (N - theta (N - 1)) (Eq. 2; measured within 0.1 %)."""
    from spexis_sglang.core.cost_model import b_eff_star

    prompts = lossless_prompts(model_dir, 16)
    assert len(prompts) == 16
    baseline_server = server_factory(BASELINE)
    baseline = baseline_server.greedy_ids(prompts, 64)
    sp_server = server_factory(sp_args(2, trained_head))
    before = spexis_stats(sp_server)
    got = sp_server.greedy_ids(prompts, 64)
    after = spexis_stats(sp_server)
    cmp = compare_outputs(model_dir, prompts, baseline, got)
    print("default model, PP=2 SP vs PP=1 plain:", cmp.summary())
    d = {k: after[k] - before[k] for k in after if isinstance(after[k], (int, float))}
    spec, acc, rej = d["rows_spec"], d["accepted"], d["rejected"]
    # printed before the asserts: the head's acceptance is worth knowing even on a mismatch
    theta = acc / max(1, acc + rej)
    print(f"acceptance over this run: {theta:.3f} ({acc} / {acc + rej})")
    assert cmp.all_identical, cmp.summary()
    # It really speculated, and the trained head's drafts were accepted.
    assert spec > 0 and acc > 0 and rej > 0
    measured = d["tokens_committed"] / (d["rows_normal"] + d["rows_spec"])
    predicted = b_eff_star(1.0, 2, theta)
    print(f"measured tokens/row={measured:.4f} Eq.2={predicted:.4f}")
    assert measured == pytest.approx(predicted, rel=0.03)
    graphs, eager = d["decode_graph_replays"], d["decode_eager_forwards"]
    print(f"stage 0's decode forwards: {graphs} CUDA graph replays, {eager} eager")
    # on a GPU (benchmark/correctness/sp_correctness_gpu.sh) SP decode runs in graphs
    if cuda_available():
        assert graphs > 0 and eager == 0
    else:
        assert graphs == 0 and eager > 0


def assert_greedy_equal(model_dir: str, baseline, sp_server, prompts, new_tokens: int, label: str):
    """``sp_server``'s greedy outputs equal ``baseline``'s; returns the SP server's counters."""
    expected = baseline.greedy_ids(prompts, new_tokens)
    got = sp_server.greedy_ids(prompts, new_tokens)
    cmp = compare_outputs(model_dir, prompts, expected, got)
    print(f"{label}:", cmp.summary())
    assert cmp.all_identical, cmp.summary()
    return spexis_stats(sp_server)


def tiny_sp_args(pp: int) -> List[str]:
    """Tiny-model SP server: a deep pipeline, and selective speculation on (alpha relay)."""
    return sp_args(pp, "random:0", "--spexis-alpha", "0.25")


@pytest.fixture(scope="module")
def tiny_prompts(tiny_model_dir):
    texts = [
        f"Question {i}: list {i + 2} things you like about the number {i * 7}." for i in range(16)
    ]
    return templated(tiny_model_dir, texts)


@pytest.mark.parametrize("pp", [4])
def test_greedy_tiny_model_deep_pipeline_equals_plain(
    server_factory, tiny_model_dir, tiny_prompts, pp
):
    """A deep pipeline over SGLang's own PP transport (``SPEXIS_PP_TRANSPORT=nccl``; an SP
    server's default on one host is the packed link)."""
    baseline = server_factory(["--model-path", tiny_model_dir, "--pp-size", "1"])
    sp_server = server_factory(
        ["--model-path", tiny_model_dir, *tiny_sp_args(pp)], env={ENV_PP_TRANSPORT: "nccl"}
    )
    label = f"tiny model, PP={pp} SP vs PP=1 plain"
    stats = assert_greedy_equal(tiny_model_dir, baseline, sp_server, tiny_prompts, 48, label)
    assert stats["rows_spec"] > 0 and stats["rows_stale"] > 0
    # stage 0's alpha drops reached the other stages (they would desynchronise otherwise)
    assert stats["drafts_dropped"] > 0
    assert rank0_state(sp_server)["spexis_pp_link"] == "sglang"
    # on one node every stage took its relay from the local pipe, not gloo (srt/relay.py)
    with open(sp_server.log_path) as f:
        log = f.read()
    assert log.count(RELAY_LOG_LINE) == pp
    assert PACKED_LINK_LOG_LINE not in log


def test_greedy_tiny_model_over_the_packed_link_equals_plain(
    server_factory, tiny_model_dir, tiny_prompts
):
    """The packed link (``stage_link.PackedLink``: a message's layout over a local pipe, its
    tensors in one send), an SP server's default on one host: SP at PP=3, where a middle stage
    forwards the outputs too, and stock PP=2 under ``SPEXIS_PP_TRANSPORT=packed`` give plain
    SGLang's tokens, every rank over the link."""
    baseline = server_factory(["--model-path", tiny_model_dir, "--pp-size", "1"])
    servers = {
        "SP PP=3": server_factory(["--model-path", tiny_model_dir, *tiny_sp_args(3)], keep=False),
        "stock PP=2": server_factory(
            ["--model-path", tiny_model_dir, "--pp-size", "2"],
            env={ENV_PP_TRANSPORT: "packed"},
            keep=False,
        ),
    }
    for name, server in servers.items():
        label = f"tiny model, {name} over the packed link vs PP=1 plain"
        expected = baseline.greedy_ids(tiny_prompts, 40)
        got = server.greedy_ids(tiny_prompts, 40)
        cmp = compare_outputs(tiny_model_dir, tiny_prompts, expected, got)
        print(f"{label}:", cmp.summary())
        assert cmp.all_identical, cmp.summary()
        with open(server.log_path) as f:
            assert f.read().count(PACKED_LINK_LOG_LINE) == int(name[-1])
        assert rank0_state(server)["spexis_pp_link"] == "packed"
    assert spexis_stats(servers["SP PP=3"])["rows_spec"] > 0


def test_greedy_tiny_model_alpha_one_equals_plain(server_factory, tiny_model_dir, tiny_prompts):
    """``--spexis-alpha 1`` (stock PP's schedule): stage 0 keeps only the rows the device
    would redo and holds the other drafts; the held slots reach the later stages in the plan,
    through a middle stage (PP=3). Away from its observed iterations stage 0 makes no drafts
    (the rows built on their placeholders are redone on the true token)."""
    baseline = server_factory(["--model-path", tiny_model_dir, "--pp-size", "1"])
    sp_server = server_factory(
        ["--model-path", tiny_model_dir, *sp_args(3, "random:0", "--spexis-alpha", "1")],
        keep=False,
    )
    label = "tiny model, PP=3 SP alpha 1 vs PP=1 plain"
    stats = assert_greedy_equal(tiny_model_dir, baseline, sp_server, tiny_prompts, 48, label)
    keys = ("rows_normal", "rows_spec", "rows_redone", "rows_stale", "drafts_unmade_forwards")
    print({k: stats[k] for k in keys + ("unmade_drafts_verified",)})
    # the rows kept rode on drafts the transit batch then judged (redone where rejected)
    assert stats["rows_spec"] > 0 and stats["rows_redone"] > 0 and stats["drafts_dropped"] == 0
    assert stats["drafts_unmade_forwards"] > 0 and stats["unmade_drafts_verified"] > 0


def chi2_sf(x: float, dof: int) -> float:
    """Survival function of the chi-square distribution (regularised upper gamma, series)."""
    a, z = dof / 2.0, x / 2.0
    if z <= 0:
        return 1.0
    term = total = 1.0 / a
    k = 0
    while term > 1e-14 * total and k < 10000:
        k += 1
        term *= z / (a + k)
        total += term
    lower = math.exp(-z + a * math.log(z) - math.lgamma(a)) * total
    return max(0.0, 1.0 - lower)


def _pool(c: Counter, rare: set) -> Counter:
    out: Counter = Counter()
    for k, v in c.items():
        out["rare" if k in rare else k] += v
    return out


def two_sample_chi2(a: Counter, b: Counter, min_count: int = 10) -> tuple[float, int]:
    """Two-sample chi-square; outcomes seen fewer than ``min_count`` times are pooled."""
    rare = {k for k in set(a) | set(b) if a.get(k, 0) + b.get(k, 0) < min_count}
    a, b = _pool(a, rare), _pool(b, rare)
    keys = sorted(set(a) | set(b), key=str)
    na, nb = sum(a.values()), sum(b.values())
    stat = 0.0
    for k in keys:
        x, y = a.get(k, 0), b.get(k, 0)
        if x + y == 0:
            continue
        ea, eb = na * (x + y) / (na + nb), nb * (x + y) / (na + nb)
        stat += (x - ea) ** 2 / ea + (y - eb) ** 2 / eb
    return stat, max(1, len(keys) - 1)


def test_sampling_distribution_matches_plain(server_factory, tiny_model_dir, tiny_prompts):
    """Temperature 1: the SP server's per-position token frequencies match plain SGLang's."""
    baseline = server_factory(["--model-path", tiny_model_dir, "--pp-size", "1"])
    sp_server = server_factory(["--model-path", tiny_model_dir, *tiny_sp_args(4)])
    n, steps = 300, 6
    prompt = tiny_prompts[0]
    # top_k=8 over a model whose mass sits on 24 tokens: a tiny vocabulary of outcomes.
    params = {"temperature": 1.0, "top_k": 8, "max_new_tokens": steps, "ignore_eos": True}

    def sample(server):
        out = server.generate({"input_ids": [prompt] * n, "sampling_params": params})
        return [o["output_ids"] for o in out]

    a = sample(baseline)
    before = spexis_stats(sp_server)
    b = sample(sp_server)
    after = spexis_stats(sp_server)
    # speculative rows were launched, and both verdicts happened under sampling
    assert after["accepted"] > before["accepted"] and after["rejected"] > before["rejected"]
    assert all(len(x) == steps for x in a + b)
    pvalues = []
    for pos in range(1, steps):
        ca = Counter(x[pos] for x in a)
        cb = Counter(x[pos] for x in b)
        stat, dof = two_sample_chi2(ca, cb)
        pvalues.append(chi2_sf(stat, dof))
        # a tiny vocabulary: few outcomes carry the mass
        assert len(ca) >= 2  # a real distribution, not a single forced token
    print("per-position chi-square p-values:", np.round(pvalues, 4).tolist())
    # Five tests: with a correct server each p-value is uniform, so one of the five falls below
    # 1e-4 in about 1 run of 2,000 (sampling is unseeded: a looser bound makes a flaky test).
    # A real sampling bug moves far more mass than the noise of 300 samples: see below.
    assert min(pvalues) > 1e-4, pvalues
    # Sanity of the test itself: a distribution that moves n/5 samples (at most the top
    # token's count, >= n/8 under top_k=8) from the most likely token to one never sampled is
    # detected far below the bound, whatever the sample (the check once added n/3 to the top
    # token, which a sample with a dominant token could absorb: p = 0.0032 in one run).
    observed = Counter(x[1] for x in a)
    top = observed.most_common(1)[0][0]
    shifted = Counter(observed)
    moved = min(n // 5, shifted[top])
    shifted[top] -= moved
    shifted["never sampled"] += moved
    assert chi2_sf(*two_sample_chi2(observed, shifted)) < 1e-6


# the first 30000 of the tiny model's 49152 ids: past TP rank 0's shard of the embedding
# (24576 rows), so both ranks score draft ids
TP_DRAFT_VOCAB = 30000
# what the tiny model's constrained answers must read (a random model: any letters fit)
TP_GRAMMAR_REGEX = r"(yes|no), [a-z ]{4,60}\."


def test_pp_x_tp_x_sp_tiny_model_equals_plain(
    server_factory, tiny_model_dir, tiny_prompts, tmp_path
):
    """PP=2 x TP=2 with SP (and alpha drops relayed): the same tokens as plain PP=1. The head
    drafts among the first ``TP_DRAFT_VOCAB`` ids (``--spexis-draft-vocab``), which the two
    ranks' vocabulary shards hold between them: every draft it made lies below."""
    baseline = server_factory(["--model-path", tiny_model_dir, "--pp-size", "1"])
    trace = str(tmp_path / "drafts.jsonl")
    sp_server = server_factory(
        [
            *["--model-path", tiny_model_dir, "--tp-size", "2", *tiny_sp_args(2)],
            *["--spexis-draft-vocab", str(TP_DRAFT_VOCAB)],
        ],
        # SGLang's CPU TP needs one entry per rank
        env={"SGLANG_CPU_OMP_THREADS_BIND": "0|1", ENV_DRAFT_TRACE: trace},
        keep=False,
    )
    prompts = tiny_prompts[:8]
    label = "tiny model, PP=2 x TP=2 SP vs PP=1 plain"
    stats = assert_greedy_equal(tiny_model_dir, baseline, sp_server, prompts, 40, label)
    assert stats["rows_spec"] > 0 and stats["drafts_dropped"] > 0
    # constrained decoding on the same servers: a batch with grammar masks drafts from the
    # ranks' gathered logits over the draft vocabulary, masked, not from the shards' exchange
    sampling = {"temperature": 0.0, "max_new_tokens": 32, "regex": TP_GRAMMAR_REGEX}
    payload = {"input_ids": prompts[:4], "sampling_params": sampling}
    expected = [o["output_ids"] for o in baseline.generate(payload)]
    out = sp_server.generate(payload)
    after = spexis_stats(sp_server)
    cmp = compare_outputs(tiny_model_dir, prompts[:4], expected, [o["output_ids"] for o in out])
    print(f"{label}, regex:", cmp.summary(), [o["text"] for o in out])
    assert cmp.all_identical, cmp.summary()
    assert all(re.match(r"(yes|no), [a-z ]", o["text"]) for o in out)
    assert after["rows_spec"] > stats["rows_spec"]
    with open(trace) as f:
        drafts = [i for line in f for i in json.loads(line)["ids"]]
    print(f"{len(drafts)} drafts traced, the largest id {max(drafts)}")
    assert len(drafts) > 100 and max(drafts) < TP_DRAFT_VOCAB
    assert max(drafts) >= 24576  # rank 1's shard drafted too


def test_retraction_under_memory_pressure_is_lossless(server_factory, tiny_model_dir):
    """A KV pool too small for the batch: SP retracts (after draining) and still matches plain."""
    prompts = templated(
        tiny_model_dir, [f"Question {i}: list {i + 2} things about {i * 7}." for i in range(12)]
    )
    # the baseline first: starting the SP server may stop it (conftest's make_room)
    baseline = server_factory(["--model-path", tiny_model_dir, "--pp-size", "1"])
    expected = baseline.greedy_ids(prompts, 80)
    sp_server = server_factory(
        [
            "--model-path",
            tiny_model_dir,
            *sp_args(2, "random:0", "--max-total-tokens", "600", "--chunked-prefill-size", "128"),
        ]
    )
    got = sp_server.greedy_ids(prompts, 80)
    with open(sp_server.log_path) as f:
        retractions = f.read().count(SPEXIS_RETRACT_LINE)
    assert retractions > 0  # the test really exercised retraction
    cmp = compare_outputs(tiny_model_dir, prompts, expected, got)
    print(f"retraction test ({retractions} retractions):", cmp.summary())
    assert cmp.all_identical, cmp.summary()
    time.sleep(2)  # idle: SGLang's leak check runs and would kill a leaking scheduler
    assert sp_server.alive()


def _session_turns(server, prompts: List[List[int]]) -> List[List[int]]:
    """SGLang's sessions: each turn names the turn it continues (its context and KV kept),
    then two turns branch from the first one, one appended and one spliced at a token
    offset."""
    url = server.base_url
    r = requests.post(url + "/open_session", json={"capacity_of_str_len": 8000})
    assert r.status_code == 200, r.text[:300]
    sid = r.json()
    sampling = {"temperature": 0.0, "max_new_tokens": 16, "ignore_eos": True}
    turns = [{"rid": i - 1} for i in range(len(prompts))] + [{"rid": 0}, {"rid": 0, "offset": 5}]
    prompts = prompts + prompts[:2]
    outputs, ids = [], []
    for prompt, turn in zip(prompts, turns):
        params = {"id": sid}
        if turn["rid"] >= 0:
            params["rid"] = ids[turn["rid"]]
        if "offset" in turn:
            params["offset"] = turn["offset"]
        body = {"input_ids": prompt, "sampling_params": sampling, "session_params": params}
        r = requests.post(url + "/generate", json=body, timeout=300)
        assert r.status_code == 200, r.text[:300]
        outputs.append(r.json()["output_ids"])
        ids.append(r.json()["meta_info"]["id"])
    assert requests.post(url + "/close_session", json={"session_id": sid}).status_code == 200
    return outputs


def test_session_turns_equal_plain_sglang(server_factory, model_dir, trained_head):
    """Multi-turn sessions (/open_session, session_params) over SP: every turn's tokens are
    plain SGLang's, so what the session keeps of a turn is its verified context only. (A
    streaming session, ``--enable-streaming-session``, which keeps the previous turn's own KV
    slots, gave plain SGLang's tokens too when checked by hand; its extra server is left out
    of the suite for time.)"""
    prompts = [p[:24] for p in lossless_prompts(model_dir, 4)]
    expected = _session_turns(server_factory(BASELINE), prompts)
    sp_server = server_factory(sp_args(2, trained_head))
    before = spexis_stats(sp_server)
    assert _session_turns(sp_server, prompts) == expected
    assert spexis_stats(sp_server)["rows_spec"] > before["rows_spec"]  # it speculated
