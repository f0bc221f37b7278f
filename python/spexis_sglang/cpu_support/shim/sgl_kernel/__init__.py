"""CPU stand-in for the few ``sgl_kernel`` ops SGLang 0.5.17 imports when
``SGLANG_USE_CPU_ENGINE=1``.

The real CPU build of ``sgl_kernel`` (Intel's) is not on PyPI, and the PyPI ``sglang-kernel``
is CUDA-only. This package is put on ``sys.path`` only by :mod:`spexis_sglang.cpu_support` in
the CPU environment, so it never shadows the real ``sgl_kernel`` on a GPU machine.

Only the names SGLang imports at module level exist here. Any other name raises
``AttributeError`` (so SGLang's ``try: from sgl_kernel import X`` fallbacks stay in force),
and nothing is registered under ``torch.ops.sgl_kernel`` (so SGLang never switches to its
AMX kernel paths).
"""

import torch

__version__ = "0.0.0+spexis.cpu.standin"


def assign_req_to_token_pool_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    max_context_len: int,
) -> None:
    """Write each request's chunk of ``out_cache_loc`` into ``req_to_token[row, start:end]``."""
    del max_context_len  # implied by req_to_token's width
    offset = 0
    for row, start, end in zip(
        req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist()
    ):
        n = end - start
        req_to_token[row, start:end] = out_cache_loc[offset : offset + n].to(req_to_token.dtype)
        offset += n


def _unsupported(name: str):
    def op(*args, **kwargs):
        raise NotImplementedError(
            f"sgl_kernel.{name} is not available in the CPU stand-in "
            "(only SGLang's speculative-decoding paths call it; they are not used on CPU)"
        )

    op.__name__ = name
    return op


copy_all_layer_kv_cache_cpu = _unsupported("copy_all_layer_kv_cache_cpu")
fill_accept_out_cache_loc_cpu = _unsupported("fill_accept_out_cache_loc_cpu")
fill_bonus_tokens_cpu = _unsupported("fill_bonus_tokens_cpu")
assign_extend_cache_locs_cpu = _unsupported("assign_extend_cache_locs_cpu")
build_tree_kernel_efficient_cpu = _unsupported("build_tree_kernel_efficient_cpu")
verify_tree_greedy_cpu = _unsupported("verify_tree_greedy_cpu")
