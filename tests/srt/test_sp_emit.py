"""The vectorised emit path (``srt/sp_emit.py``) against SGLang's per-request path.

Random requests (stop and EOS ids, ``ignore_eos``, ``max_new_tokens``, stop strings, streaming,
aborts, out-of-vocabulary tokens) commit random tokens both ways: SGLang's
``output_ids.append`` + ``update_finish_state`` for every row, and :func:`emit_batch`. Finish
reasons, ``finished_len`` and outputs must be identical, and every row :func:`emit_batch`
leaves out of ``stream_output`` must be one SGLang's stream accumulator would skip.
"""

from __future__ import annotations

import copy
import random
from array import array

import numpy as np
import pytest
from sglang.srt.managers.schedule_batch import FINISH_ABORT, Req
from sglang.srt.managers.scheduler_components.output_streamer import (
    _GenerationStreamAccumulator,
)
from sglang.srt.sampling.sampling_params import SamplingParams

from spexis_sglang.srt.protocol import FORCED_LABEL
from spexis_sglang.srt.sp_emit import SlotEmit, emit_batch, stop_token_ids
from spexis_sglang.srt.sp_forced import ForcedAcceptance

VOCAB = 40
INTERVAL = 5


class _Tokenizer:
    eos_token_id = 3
    additional_stop_token_ids = {4}

    @staticmethod
    def decode(ids, *args, **kwargs) -> str:
        return "".join(chr(97 + int(t) % 26) for t in ids)

    @staticmethod
    def encode(text, *args, **kwargs) -> list:
        return [ord(c) - 97 for c in text]


def _random_req(rng: random.Random, k: int, all_ignore_eos: bool = False) -> Req:
    tokenizer = _Tokenizer() if rng.random() < 0.7 else None
    params = SamplingParams(
        max_new_tokens=rng.randint(1, 12),
        ignore_eos=rng.random() < 0.3 or all_ignore_eos,
        stop_token_ids=rng.sample(range(VOCAB + 3), rng.randint(0, 2)),
        stop=["bc"] if tokenizer is not None and rng.random() < 0.2 else None,
    )
    params.normalize(tokenizer)
    req = Req(
        f"r{k}",
        "",
        array("q", [rng.randrange(VOCAB) for _ in range(rng.randint(1, 6))]),
        params,
        stream=rng.random() < 0.2,
        eos_token_ids={rng.randrange(VOCAB)} if rng.random() < 0.5 else None,
        vocab_size=VOCAB,
    )
    req.tokenizer = tokenizer
    for _ in range(rng.randint(0, 3)):
        req.output_ids.append(rng.randrange(5, VOCAB))
    return req


def _would_stream(req: Req) -> bool:
    """SGLang's accumulator, on a request that has not finished: does it output?"""
    acc = _GenerationStreamAccumulator(
        return_logprob=False,
        return_hidden_states=False,
        return_routed_experts=False,
        return_indexer_topk=False,
        return_sampling_mask=False,
        spec_algorithm=None,
        disaggregation_mode=None,
        default_stream_interval=1,
        default_force_stream_interval=INTERVAL,
        get_cached_tokens_details=lambda r: None,
    )
    try:
        acc.accept(req=req)
    except Exception:  # noqa: BLE001 (outputting goes on to fields these requests lack)
        return True
    return bool(acc.rids)


@pytest.mark.parametrize("all_ignore_eos", [False, True])  # True: no stop id applies anywhere
@pytest.mark.parametrize("seed", range(40))
def test_emit_batch_matches_the_per_request_path(seed, all_ignore_eos):
    rng = random.Random(seed)
    n = rng.randint(1, 24)
    # two identical sets of requests (built alike: a deep copy may reorder a set of stop ids,
    # and SGLang rewrites an out-of-vocabulary token to the first one)
    reqs = [_random_req(random.Random(1000 * seed + k), k, all_ignore_eos) for k in range(n)]
    refs = [_random_req(random.Random(1000 * seed + k), k, all_ignore_eos) for k in range(n)]
    emit = SlotEmit(capacity=64, vocab_size=VOCAB, force_stream_interval=INTERVAL)
    slots = np.array(rng.sample(range(64), n), dtype=np.int64)
    prompt = np.array([len(r.origin_input_ids) for r in reqs], dtype=np.int64)
    verified = prompt + [len(r.output_ids) for r in reqs]
    # the benchmark mode's per-token tags ride along (kept by slot)
    forced = ForcedAcceptance(capacity=64, seed=0, default_theta=0.5, vocab_size=VOCAB)
    for s, r, v in zip(slots.tolist(), reqs, verified.tolist()):
        emit.admit(s, r, v)
        r.req_pool_idx = s
        forced.label(r)
    for step in range(14):
        live = [k for k, r in enumerate(reqs) if not r.finished()]
        if not live:
            break
        rows = [k for k in live if rng.random() < 0.8]
        if not rows:
            continue
        for k in rows:
            if rng.random() < 0.03:
                reqs[k].to_finish = FINISH_ABORT()
                refs[k].to_finish = FINISH_ABORT()
                emit.flag(int(slots[k]))  # as SpexisScheduler.abort_request does
        tokens = np.array(
            [rng.choice([rng.randrange(VOCAB), VOCAB + 1, -1, 3, 4, 1, 2]) for _ in rows],
            dtype=np.int64,
        )
        positions = verified[rows] - 1
        ref = [refs[k] for k in rows]
        ref_stream = []
        for req, token in zip(ref, tokens.tolist()):
            req.output_ids.append(token)
            req.update_finish_state(1)
            ref_stream.append(req.finished() or _would_stream(copy.deepcopy(req)))
        got = [reqs[k] for k in rows]
        finished, to_stream = emit_batch(
            emit, got, slots[rows], tokens, positions, 1.0 + step, forced.top_up
        )
        acted = {id(r) for r in finished} | {id(r) for r in to_stream}
        for a, b in zip(ref, got):
            if id(b) in acted:  # SGLang's code reads them now: nothing may be held back
                assert list(a.output_ids) == list(b.output_ids)
        if rng.random() < 0.5:  # the scheduler flushes when SGLang reads running requests
            emit.flush(got, slots[rows])
        else:
            pending = emit.pending_slots()
            by_slot = {int(s): r for s, r in zip(slots.tolist(), reqs)}
            emit.flush([by_slot[int(s)] for s in pending], pending)
        for a, b in zip(ref, got):
            assert list(a.output_ids) == list(b.output_ids)
            assert (a.finished_reason is None) == (b.finished_reason is None)
            if a.finished_reason is not None:
                assert a.finished_reason.to_json() == b.finished_reason.to_json()
            assert a.finished_len == b.finished_len
            assert (a.to_finish is None) == (b.to_finish is None)
            assert b.kv_committed_len == len(b.origin_input_ids) + len(b.output_ids) - 1
        assert [id(r) for r in finished] == [id(r) for r in got if r.finished()]
        streamed = {id(r) for r in to_stream}
        for req in to_stream:  # what only the stream reads is up to date when it streams
            assert req.time_stats.last_decode_finish_time == 1.0 + step
            assert len(req.customized_info[FORCED_LABEL]) == len(req.output_ids)
        for req, want in zip(got, ref_stream):
            if want:
                assert id(req) in streamed, "a request SGLang would stream was left out"
        verified[rows] += 1


def test_stop_ids_cover_sglang_token_check():
    rng = random.Random(7)
    for k in range(200):
        req = _random_req(rng, k)
        ids = set(stop_token_ids(req))
        for token in range(VOCAB):
            req.finished_reason = None
            if req.sampling_params.ignore_eos:
                break
            if req._check_token_based_finish([token]):
                assert token in ids
