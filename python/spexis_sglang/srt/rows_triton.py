"""A decode batch of SP rows completed on the device (:func:`resolve_rows`): on a GPU in one
Triton kernel (:func:`resolve_rows_fused`), elsewhere with PyTorch's ops (:func:`resolve_rows_torch`).

Before its forward, a batch's rows are completed on the device (``_sp_resolve_rows``): a
speculative row takes its request's latest draft as input, and a row with an alternative runs
where the transit batch's verdict puts it, which sets its position, sequence lengths and KV
slot. In PyTorch's ops that is about fifteen small kernels, each launched from Python
(~5–10 µs of the host's time apiece) on stage 0's host, whose time per iteration is what
bounds SP on two GPUs at small batches; here it is one launch. The rows are independent, so
the kernel is a plain elementwise pass: a program per block of rows.
"""

from __future__ import annotations

from typing import Optional

import torch

from spexis_sglang.srt.config import ENV_ROWS_FUSED
from spexis_sglang.srt.fused_switch import FusedSwitch
from spexis_sglang.srt.sp_forced import rejected_token

try:  # Triton comes with torch on GPU machines; on CPU the torch path runs
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the machine
    triton = None

#: rows per program
BLOCK = 256
#: the kernel, unless ``SPEXIS_ROWS_FUSED=0`` or it failed on this GPU
FUSED_ROWS = FusedSwitch(ENV_ROWS_FUSED, "fused row kernel", "completing batches")

#: how a row with an alternative learns where it runs: stage 0 from the transit batch's true
#: token and the draft it verifies (rejected where they differ), stage 0 in the benchmark's
#: forced acceptance (the host chose the rejected rows: every row left with an alternative),
#: a later stage from the positions stage 0 sent down
VERDICT, FORCED, GIVEN = 0, 1, 2


def fused_available(input_ids: torch.Tensor) -> bool:
    """The kernel applies: Triton present and the batch on a CUDA device."""
    return triton is not None and input_ids.is_cuda and input_ids.shape[0] > 0


def resolve_rows(input_ids: torch.Tensor, *args, **kwargs):
    """:func:`resolve_rows_fused` where it applies, else :func:`resolve_rows_torch` (also
    where Triton could not compile or launch the kernel on this GPU: the server then
    completes its batches with PyTorch's ops from here on, said once in the log, instead of
    failing its requests)."""
    if FUSED_ROWS.on and fused_available(input_ids):
        out = FUSED_ROWS.run(resolve_rows_fused, input_ids, *args, **kwargs)
        if out is not None:
            return out
    return resolve_rows_torch(input_ids, *args, **kwargs)


def resolve_rows_torch(
    input_ids: torch.Tensor,
    slots: torch.Tensor,
    seq_lens: torch.Tensor,
    orig_seq_lens: torch.Tensor,
    req_to_token: torch.Tensor,
    draft_by_slot: Optional[torch.Tensor] = None,
    alternatives: Optional[torch.Tensor] = None,
    transit_rows: Optional[torch.Tensor] = None,
    transit: Optional[torch.Tensor] = None,
    given_positions: Optional[torch.Tensor] = None,
    forced_vocab: Optional[int] = None,
):
    """:func:`resolve_rows_fused`'s result with PyTorch's ops (a CPU's, and the reference)."""
    if draft_by_slot is not None:
        input_ids = torch.where(input_ids < 0, draft_by_slot[slots], input_ids)
    if given_positions is not None:
        positions = given_positions
    elif alternatives is not None:
        true_ids, drafts = transit[transit_rows].unbind(1)
        rejected = alternatives >= 0
        if forced_vocab is None:
            rejected &= true_ids != drafts
            token = true_ids
        else:  # the host chose the rows (sp_build_decode_batch)
            token = rejected_token(true_ids, drafts, forced_vocab)
        input_ids = torch.where(rejected, token, input_ids)
        positions = torch.where(rejected, alternatives, seq_lens - 1)
    else:
        return input_ids, None, None
    seq_lens.copy_(positions + 1)
    orig_seq_lens.copy_(seq_lens)
    return input_ids, positions, req_to_token[slots, positions].to(torch.int64)


if triton is not None:

    @triton.jit(do_not_specialize=["n", "req_to_token_stride", "transit_stride", "vocab"])
    def _resolve_kernel(
        ids_ptr,  # int64 [n]: the host's tokens, -1 for a speculative row (stage 0)
        slots_ptr,  # int64 [n]
        draft_by_slot_ptr,  # int64 [slots]: each slot's latest draft (stage 0)
        seq_lens_ptr,  # int64 [n], rewritten
        orig_seq_lens_ptr,  # int32 [n], rewritten
        alternatives_ptr,  # int64 [n]: -1, or the position the row runs at if rejected
        transit_rows_ptr,  # int64 [n]: the row's request's row in the transit batch
        transit_ptr,  # int64 [m, 2]: its true token and the draft it verified
        given_ptr,  # int64 [n]: each row's position, as stage 0 ran it (GIVEN)
        req_to_token_ptr,  # int32 [slots, context]
        ids_out_ptr,  # int64 [n]
        positions_out_ptr,  # int64 [n]
        loc_out_ptr,  # int64 [n]: out_cache_loc
        n,
        req_to_token_stride,
        transit_stride,
        vocab,
        HAS_SPEC: tl.constexpr,
        HAS_ALTERNATIVES: tl.constexpr,
        MODE: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
    ):
        i = tl.program_id(0) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
        live = i < n
        token = tl.load(ids_ptr + i, mask=live, other=0)
        slot = tl.load(slots_ptr + i, mask=live, other=0)
        if HAS_SPEC:
            spec = live & (token < 0)
            token = tl.where(spec, tl.load(draft_by_slot_ptr + slot, mask=spec, other=0), token)
        if HAS_ALTERNATIVES:
            if MODE == 2:  # GIVEN
                position = tl.load(given_ptr + i, mask=live, other=0)
            else:
                position = tl.load(seq_lens_ptr + i, mask=live, other=1) - 1
                alternative = tl.load(alternatives_ptr + i, mask=live, other=-1)
                has = live & (alternative >= 0)
                row = tl.load(transit_rows_ptr + i, mask=has, other=0)
                true_id = tl.load(transit_ptr + row * transit_stride, mask=has, other=0)
                draft = tl.load(transit_ptr + row * transit_stride + 1, mask=has, other=0)
                if MODE == 1:  # FORCED: sp_forced.rejected_token
                    rejected = has
                    redo = tl.where(true_id == draft, (draft + 1) % vocab, true_id)
                else:
                    rejected = has & (true_id != draft)
                    redo = true_id
                token = tl.where(rejected, redo, token)
                position = tl.where(rejected, alternative, position)
                tl.store(positions_out_ptr + i, position, mask=live)
            tl.store(seq_lens_ptr + i, position + 1, mask=live)
            tl.store(orig_seq_lens_ptr + i, (position + 1).to(tl.int32), mask=live)
            loc = tl.load(req_to_token_ptr + slot * req_to_token_stride + position, mask=live)
            tl.store(loc_out_ptr + i, loc.to(tl.int64), mask=live)
        tl.store(ids_out_ptr + i, token, mask=live)


def resolve_rows_fused(
    input_ids: torch.Tensor,
    slots: torch.Tensor,
    seq_lens: torch.Tensor,
    orig_seq_lens: torch.Tensor,
    req_to_token: torch.Tensor,
    draft_by_slot: Optional[torch.Tensor] = None,
    alternatives: Optional[torch.Tensor] = None,
    transit_rows: Optional[torch.Tensor] = None,
    transit: Optional[torch.Tensor] = None,
    given_positions: Optional[torch.Tensor] = None,
    forced_vocab: Optional[int] = None,
):
    """``(input_ids, positions, out_cache_loc)`` of a decode batch completed as
    ``_sp_resolve_rows``' PyTorch ops complete it: a row whose token is negative takes
    ``draft_by_slot[slot]`` (with ``draft_by_slot``); with ``alternatives``, each row runs at
    its alternative where the transit batch rejects it (``transit``: ``[m, 2]`` true token
    and draft, rows ``transit_rows``; ``forced_vocab``: the benchmark's forced acceptance,
    whose rejected token is ``sp_forced.rejected_token``'s), or where ``given_positions``
    say, and ``seq_lens`` / ``orig_seq_lens`` are rewritten in place. Without alternatives
    the positions and KV slots are not returned (None)."""
    n = input_ids.shape[0]
    device = input_ids.device
    ids_out = torch.empty_like(input_ids)
    has_alternatives = alternatives is not None or given_positions is not None
    if given_positions is not None:
        mode = GIVEN
    elif forced_vocab is not None:
        mode = FORCED
    else:
        mode = VERDICT
    positions = loc = None
    if has_alternatives:
        positions = given_positions if mode == GIVEN else torch.empty_like(input_ids)
        loc = torch.empty(n, dtype=torch.int64, device=device)
    transit_stride = 0
    if transit is not None:
        if transit.stride(1) != 1:
            transit = transit.contiguous()
        transit_stride = transit.stride(0)
    _resolve_kernel[(triton.cdiv(n, BLOCK),)](
        input_ids,
        slots,
        draft_by_slot if draft_by_slot is not None else input_ids,
        seq_lens,
        orig_seq_lens,
        alternatives if alternatives is not None else input_ids,
        transit_rows if transit_rows is not None else input_ids,
        transit if transit is not None else input_ids,
        given_positions if given_positions is not None else input_ids,
        req_to_token,
        ids_out,
        positions if positions is not None else ids_out,
        loc if loc is not None else ids_out,
        n,
        req_to_token.stride(0),
        transit_stride,
        forced_vocab or 1,
        HAS_SPEC=draft_by_slot is not None,
        HAS_ALTERNATIVES=has_alternatives,
        MODE=mode,
        BLOCK_SIZE=BLOCK,
    )
    return ids_out, positions, loc
