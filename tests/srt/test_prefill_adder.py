"""SpexisPrefillAdder (srt/prefill_adder.py): SGLang's PrefillAdder, with its token reservation
replaced by the gate's count only while the scheduler flags the running batch."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from spexis_sglang.srt.prefill_adder import SpexisPrefillAdder, SPRunningBatch

POOL = 400


class _TreeCache:
    """The little of a (disabled) prefix cache that admission touches."""

    disable = True

    def evictable_size(self) -> int:
        return 0

    def supports_mamba(self) -> bool:
        return False

    def is_tree_cache(self) -> bool:
        return False

    def inc_lock_ref(self, node):
        return None

    def dec_lock_ref(self, node, params=None):
        return None


@pytest.fixture(autouse=True)
def _no_parallel_context(monkeypatch):
    """No server publishes a parallel config here: context parallelism is off."""
    from sglang.srt.managers import schedule_policy

    monkeypatch.setattr(schedule_policy, "is_dsa_prefill_cp_in_seq_split", lambda: False)
    monkeypatch.setattr(schedule_policy, "is_prefill_context_parallel_enabled", lambda: False)


def _req(prompt: int, max_new: int, output: int = 0):
    req = SimpleNamespace(
        sampling_params=SimpleNamespace(ignore_eos=False, max_new_tokens=max_new),
        output_ids=[0] * output,
        full_untruncated_fill_ids=[1] * prompt,
        prefix_indices=torch.zeros(0, dtype=torch.int64),
        host_hit_length=0,
        last_node=None,
        retracted_stain=False,
        mamba_pool_idx=None,
        needs_host_load_back=lambda: False,
    )
    req.set_extend_range = lambda a, b: setattr(req, "extend_range", (a, b))
    return req


def _adder(used: int, running, count: bool) -> SpexisPrefillAdder:
    from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator

    alloc = TokenToKVPoolAllocator(POOL, torch.float32, "cpu", kvcache=None, need_sort=False)
    if used:
        alloc.alloc(used)
    batch = SPRunningBatch(reqs=running, admit_by_count=count)
    return SpexisPrefillAdder(1, _TreeCache(), alloc, batch, 0.7, 4096, None)


@pytest.mark.parametrize("count", [False, True])
def test_reservation_applies_unless_the_scheduler_admits_by_count(count):
    """300 of 400 slots used, a running request with 100 tokens to go (70 reserved): SGLang
    refuses a 20-token prompt with 50 to generate (20 + 50 + 1 >= 100 - 70); by count it is
    admitted, since the prompt fits in the 100 free slots."""
    from sglang.srt.managers.schedule_policy import AddReqResult

    adder = _adder(300, [_req(100, 300, output=200)], count)
    res = adder.add_one_req(_req(20, 50), has_chunked_req=False, truncation_align_size=None)
    assert (len(adder.can_run_list) == 1) == count
    if not count:
        assert res == AddReqResult.NO_TOKEN


def test_by_count_the_prompt_must_still_fit_in_the_memory_free_now():
    from sglang.srt.managers.schedule_policy import AddReqResult

    adder = _adder(300, [], count=True)
    assert adder.add_one_req(_req(100, 10), False, None) == AddReqResult.NO_TOKEN
    assert adder.can_run_list == []
    adder.add_one_req(_req(60, 10), False, None)
    assert len(adder.can_run_list) == 1
    # 39 left: the next 40-token prompt (plus a page) does not fit
    assert adder.add_one_req(_req(40, 10), False, None) == AddReqResult.NO_TOKEN
    assert len(adder.can_run_list) == 1


def test_rows_riding_along_take_their_share_of_the_chunk_for_one_pass():
    """With 5 SP rows riding along, the chunk and the pass's input budget shrink by 5 (SGLang's
    num_mixed_decode_tokens); after the pass the batch admits as SGLang would."""
    from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator

    alloc = TokenToKVPoolAllocator(POOL, torch.float32, "cpu", kvcache=None, need_sort=False)
    batch = SPRunningBatch(reqs=[])
    with batch.admission_pass(by_count=True, mixed_decode_rows=5):
        adder = SpexisPrefillAdder(1, _TreeCache(), alloc, batch, 0.7, 4096, 64)
        assert adder.count_admission
    assert (adder.rem_chunk_tokens, adder.rem_input_tokens) == (64 - 5, 4096 - 5)
    assert not batch.admit_by_count and batch.mixed_decode_rows == 0
    plain = SpexisPrefillAdder(1, _TreeCache(), alloc, batch, 0.7, 4096, 64)
    assert (plain.rem_chunk_tokens, plain.rem_input_tokens) == (64, 4096)
    assert not plain.count_admission
