"""Torch stand-ins for the two triton kernels of SGLang's paged KV allocator (CPU only).

SGLang 0.5.17's ``PagedTokenToKVPoolAllocator`` (``--page-size > 1``) computes its slot indices
with ``alloc_extend_kernel`` and ``alloc_decode_kernel``, triton kernels launched as
``kernel[(bs,)](...)``. Here there is no triton (the stub makes them plain functions), so
without these stand-ins any server with ``--page-size > 1`` crashes at its first prefill
("'function' object is not subscriptable"). They take the kernels' arguments and fill
``out_indices`` the same way: the extend one is SGLang's own reference ``alloc_extend_naive``
(same module), the decode one is the kernel's rule written as tensor operations.

When the free pages do not suffice, the kernels read past ``free_pages`` and the allocator
returns None afterwards without using ``out_indices``; the stand-ins then leave it untouched.
:func:`spexis_sglang.srt.hooks.install` puts them in place on CPU
(``install_cpu_paged_kernels``).
"""

from __future__ import annotations

from typing import Callable

import torch


class TorchKernel:
    """``kernel[grid](*args)`` runs ``fn(*args)``: the launch syntax of a triton kernel."""

    def __init__(self, fn: Callable[..., None]):
        self.fn = fn

    def __getitem__(self, grid) -> Callable[..., None]:
        return self.fn


def _new_pages(prefix_lens: torch.Tensor, seq_lens: torch.Tensor, page_size: int) -> torch.Tensor:
    """Pages each row opens when its KV grows from ``prefix_lens`` to ``seq_lens`` tokens."""
    return (seq_lens + page_size - 1) // page_size - (prefix_lens + page_size - 1) // page_size


def alloc_extend(
    prefix_lens: torch.Tensor,
    seq_lens: torch.Tensor,
    last_loc: torch.Tensor,
    free_pages: torch.Tensor,
    out_indices: torch.Tensor,
    bs_upper: int,
    page_size: int,
) -> None:
    """``alloc_extend_kernel``: fill the last partial page, then whole new pages, then a new
    partial page, for each row in turn (pages taken from ``free_pages`` in row order)."""
    from sglang.srt.mem_cache.allocator.paged import alloc_extend_naive

    if int(_new_pages(prefix_lens, seq_lens, page_size).sum()) > len(free_pages):
        return
    alloc_extend_naive(
        prefix_lens, seq_lens, last_loc, free_pages, out_indices, page_size, out_indices.device
    )


def alloc_decode(
    seq_lens: torch.Tensor,
    last_loc: torch.Tensor,
    free_pages: torch.Tensor,
    out_indices: torch.Tensor,
    bs_upper: int,
    page_size: int,
) -> None:
    """``alloc_decode_kernel``: a row whose new token opens a page takes the next free page's
    first slot (pages in row order); any other row continues its page (``last_loc + 1``)."""
    opens = _new_pages(seq_lens - 1, seq_lens, page_size) > 0
    n = int(opens.sum())
    if n > len(free_pages):
        return
    out = last_loc.to(out_indices.dtype) + 1
    out[opens] = free_pages[:n].to(out_indices.dtype) * page_size
    out_indices.copy_(out)
