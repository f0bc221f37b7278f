"""The CPU stand-ins for the paged KV allocator's triton kernels (``--page-size > 1``).

Driven through SGLang's own ``PagedTokenToKVPoolAllocator`` with the stand-ins installed as on
a CPU server, and checked against the paging rules: a request's tokens fill its pages in order,
a page belongs to one request, and a short pool returns None.
"""

from __future__ import annotations

import pytest
import torch

from spexis_sglang.srt.hooks import install_cpu_paged_kernels

PAGE = 4


@pytest.fixture
def allocator():
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator

    install_cpu_paged_kernels()
    return PagedTokenToKVPoolAllocator(
        64, PAGE, torch.float32, "cpu", kvcache=None, need_sort=False
    )


def _extend(allocator, prefix_lens, seq_lens, last_loc):
    p, s = torch.tensor(prefix_lens), torch.tensor(seq_lens)
    return allocator.alloc_extend(
        p, p, s, s, torch.tensor(last_loc), extend_num_tokens=int((s - p).sum())
    )


def _check_pages(slots):
    """Position i of a request sits at offset i % PAGE of its page; pages are whole."""
    for i, slot in enumerate(slots):
        assert slot % PAGE == i % PAGE, slots
        if i % PAGE:
            assert slot == slots[i - 1] + 1, slots


def test_extend_then_decode_fill_pages_in_order(allocator):
    # two new requests of 6 and 3 tokens, then 7 decode steps each
    out = _extend(allocator, [0, 0], [6, 3], [-1, -1]).tolist()
    reqs = [out[:6], out[6:]]
    assert allocator.available_size() == 64 - 3 * PAGE  # pages a, a', b (0 is padding)
    for _ in range(7):
        seq_lens = torch.tensor([len(r) + 1 for r in reqs])
        last = torch.tensor([r[-1] for r in reqs])
        new = allocator.alloc_decode(seq_lens, seq_lens, last).tolist()
        for r, slot in zip(reqs, new):
            r.append(slot)
    for r in reqs:
        _check_pages(r)
    pages = [{s // PAGE for s in r} for r in reqs]
    assert not pages[0] & pages[1] and 0 not in pages[0] | pages[1]
    assert allocator.available_size() == 64 - PAGE * (len(pages[0]) + len(pages[1]))


def test_extend_continues_a_cached_prefix_page(allocator):
    first = _extend(allocator, [0], [6], [-1]).tolist()
    more = _extend(allocator, [6], [11], [first[-1]]).tolist()
    _check_pages(first + more)


def test_a_short_pool_returns_none(allocator):
    assert _extend(allocator, [0], [64 + 1], [-1]) is None  # 16 pages of 4 slots
    full = _extend(allocator, [0], [64], [-1])
    assert full is not None and allocator.available_size() == 0
    seq = torch.tensor([64 + 1])
    assert allocator.alloc_decode(seq, seq, full[-1:]) is None
