"""One pass over the draft head's logits on a GPU: each row's best id and its softmax
probability (:func:`greedy_draft_fused`).

PyTorch's ops read the ``[rows, vocab]`` logits twice and write a float32 copy of them
(``max``, then ``exp(logits - max)`` and its sum), about ten kernels: at 64 rows of a 128K
vocabulary ~0.3 ms of stage 0's eager work on an H200 half, for two numbers a row. Here each
program keeps a running maximum, its id and the sum of exponentials rescaled to it (as an
online softmax does) over its part of a row, reading each logit once. A row is split into
parts when there are few rows (so that enough programs run at once); a second, tiny pass then
combines each row's parts and writes the block stage 0 reads back.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

try:  # Triton comes with torch on GPU machines; on CPU the torch path runs
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the machine
    triton = None

#: logits per block of a row; rows narrower than a block take one masked block
BLOCK = 2048
#: programs wanted at once (an H200 has 132 SMs); few rows are split into up to MAX_SPLITS
TARGET_PROGRAMS = 256
MAX_SPLITS = 32


def fused_available(logits: torch.Tensor) -> bool:
    """The fused pass applies: Triton present, logits on a CUDA device, a 2-D float tensor
    whose rows are contiguous."""
    return (
        triton is not None
        and logits.is_cuda
        and logits.dim() == 2
        and logits.dtype in (torch.float16, torch.bfloat16, torch.float32)
        and logits.stride(-1) == 1
        and logits.shape[0] > 0
        and logits.shape[1] > 0
    )


def row_splits(rows: int, vocab: int) -> Tuple[int, int]:
    """``(splits, span)``: parts per row and the logits each covers (a multiple of BLOCK)."""
    blocks = -(-vocab // BLOCK)
    splits = max(1, min(MAX_SPLITS, blocks, -(-TARGET_PROGRAMS // rows)))
    span = -(-blocks // splits) * BLOCK
    return -(-vocab // span), span


if triton is not None:
    # Sizes are not specialized on (Triton would compile a variant per value class of each:
    # equal to 1, a multiple of 16, other), so a server compiles each kernel once per logits
    # dtype, at its first drafts (SGLang's warm-up request unless skipped), not again for
    # another batch size while it serves.

    @triton.jit(do_not_specialize=["row_stride", "vocab", "span", "splits"])
    def _part_kernel(
        logits_ptr,
        best_ptr,
        id_ptr,
        sum_ptr,
        row_stride,
        vocab,
        span,
        splits,
        BLOCK_SIZE: tl.constexpr,
    ):
        """Program (row, part): the part's maximum, its first id and the sum of
        ``exp(logit - maximum)`` (-inf, 0, 0 for a part of -inf only)."""
        row = tl.program_id(0)
        part = tl.program_id(1)
        base = logits_ptr + row.to(tl.int64) * row_stride
        offsets = tl.arange(0, BLOCK_SIZE)
        best = tl.full((), -float("inf"), tl.float32)
        best_id = tl.full((), 0, tl.int32)
        total = tl.full((), 0.0, tl.float32)
        first = part * span
        for step in range(0, span, BLOCK_SIZE):  # (the last part's blocks may end past vocab)
            start = first + step
            cols = start + offsets
            x = tl.load(base + cols, mask=cols < vocab, other=-float("inf")).to(tl.float32)
            block_best = tl.max(x, axis=0)
            block_id = tl.argmax(x, axis=0)  # the first of equal maxima
            new_best = tl.maximum(best, block_best)
            finite = new_best > -float("inf")
            # the running sum, rescaled to the new maximum (0 while every logit is -inf)
            scale = tl.where(finite, tl.exp(best - new_best), 0.0)
            block_sum = tl.sum(tl.where(finite, tl.exp(x - new_best), 0.0), axis=0)
            total = total * scale + block_sum
            # strictly greater: an earlier block keeps a tie (torch's max takes the first id)
            best_id = tl.where(block_best > best, start + block_id, best_id)
            best = new_best
        at = row * splits + part
        tl.store(best_ptr + at, best)
        tl.store(id_ptr + at, best_id)
        tl.store(sum_ptr + at, total)

    @triton.jit(do_not_specialize=["splits"])
    def _combine_kernel(
        best_ptr,
        id_ptr,
        sum_ptr,
        ids_ptr,
        conf_ptr,
        packed_ptr,
        buckets_ptr,
        splits,
        SPLITS_P2: tl.constexpr,
        HAS_BUCKETS: tl.constexpr,
    ):
        """Program row: its parts combined (the first part holding the maximum gives the id),
        the confidence ``1 / sum`` (0 for a row of -inf only), and the packed block."""
        row = tl.program_id(0)
        k = tl.arange(0, SPLITS_P2)
        valid = k < splits
        at = row * splits + k
        bests = tl.load(best_ptr + at, mask=valid, other=-float("inf"))
        sums = tl.load(sum_ptr + at, mask=valid, other=0.0)
        best = tl.max(bests, axis=0)
        winner = tl.argmax(bests, axis=0)  # the first part with the maximum: the lowest id
        best_id = tl.load(id_ptr + row * splits + winner)
        # (a part of -inf only adds nothing; where every part is, neither does any)
        scaled = tl.where(bests > -float("inf"), sums * tl.exp(bests - best), 0.0)
        total = tl.sum(scaled, axis=0)
        conf = tl.where(best > -float("inf"), 1.0 / total, 0.0)
        tl.store(ids_ptr + row, best_id.to(tl.int64))
        tl.store(conf_ptr + row, conf)
        # protocol.pack_drafts' row: id, confidence, length bucket (-1: none)
        bucket = tl.full((), -1.0, tl.float64)
        if HAS_BUCKETS:
            bucket = tl.load(buckets_ptr + row).to(tl.float64)
        tl.store(packed_ptr + 3 * row, best_id.to(tl.float64))
        tl.store(packed_ptr + 3 * row + 1, conf.to(tl.float64))
        tl.store(packed_ptr + 3 * row + 2, bucket)


def greedy_draft_fused(
    logits: torch.Tensor, buckets: Optional[torch.Tensor] = None
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(ids int64 [rows], conf fp32 [rows], packed)``: each row's first maximal id and
    ``1 / sum(exp(logits - max))`` (0 for a row of ``-inf`` only), as
    :func:`~spexis_sglang.srt.draft_model.greedy_draft` computes them, and
    :func:`~spexis_sglang.srt.protocol.pack_drafts`' ``[rows, 3]`` block of them (``buckets``:
    each row's length bucket). The ids are the same; the confidence can differ in its last
    bits (another order of summation)."""
    rows, vocab = logits.shape
    device = logits.device
    splits, span = row_splits(rows, vocab)
    # the sums' row starts 16-byte aligned like the maxima's (Triton specializes on alignment)
    parts = torch.empty((2, -(-rows * splits // 4) * 4), dtype=torch.float32, device=device)
    part_ids = torch.empty(rows * splits, dtype=torch.int32, device=device)
    block = min(BLOCK, triton.next_power_of_2(vocab))
    _part_kernel[(rows, splits)](
        logits,
        parts[0],
        part_ids,
        parts[1],
        logits.stride(0),
        vocab,
        span,
        splits,
        BLOCK_SIZE=block,
    )
    ids = torch.empty(rows, dtype=torch.int64, device=device)
    conf = torch.empty(rows, dtype=torch.float32, device=device)
    packed = torch.empty((rows, 3), dtype=torch.float64, device=device)
    has_buckets = buckets is not None
    _combine_kernel[(rows,)](
        parts[0],
        part_ids,
        parts[1],
        ids,
        conf,
        packed,
        buckets.contiguous() if has_buckets else ids,
        splits,
        SPLITS_P2=triton.next_power_of_2(MAX_SPLITS),
        HAS_BUCKETS=has_buckets,
    )
    return ids, conf, packed
