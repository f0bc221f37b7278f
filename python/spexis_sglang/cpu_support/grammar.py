"""Constrained decoding (SGLang's xgrammar backend) on a CPU-only machine.

SGLang 0.5.17's xgrammar backend has two pieces that only work with an accelerator:

* ``_allocate_token_bitmask`` allocates the vocabulary bitmask with ``pin_memory=True``, which
  raises without a pinned-memory allocator;
* ``apply_vocab_mask`` dispatches to a CUDA / Triton / NPU kernel and raises
  ``Unsupported device: cpu`` otherwise.

xgrammar itself ships a CPU kernel for applying the bitmask (float32, float16, bfloat16
logits) and a torch implementation for any dtype. :func:`install` rebinds the two pieces, once
the module is imported, to versions that use them for CPU tensors and leave every other device
to SGLang's code. Nothing here runs on a GPU machine (:mod:`spexis_sglang.cpu_support` installs
it only in the CPU environment).
"""

from __future__ import annotations

import logging
import sys

import torch

logger = logging.getLogger(__name__)

XGRAMMAR_BACKEND_MODULE = "sglang.srt.constrained.xgrammar_backend"
# dtypes xgrammar's CPU kernel takes; other dtypes (the exact mode's float64) use its torch path
_CPU_KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def apply_token_bitmask_cpu(logits: torch.Tensor, vocab_mask: torch.Tensor) -> None:
    """Set ``logits[i, j] = -inf`` where bit ``j`` of ``vocab_mask[i]`` is 0 (in place)."""
    from xgrammar import apply_token_bitmask_inplace

    vocab_mask = vocab_mask.to(logits.device)
    backend = "cpu" if logits.dtype in _CPU_KERNEL_DTYPES else "torch_native"
    apply_token_bitmask_inplace(logits, vocab_mask, backend=backend)


def _patch(module) -> None:
    if getattr(module, "_spexis_cpu_patched", False):
        return
    allocate = module._allocate_token_bitmask
    grammar_apply = module.XGrammarGrammar.apply_vocab_mask
    backend_apply = module.XGrammarGrammarBackend.apply_vocab_mask

    def _allocate_token_bitmask(vocab_size: int, batch_size: int) -> torch.Tensor:
        if torch.cuda.is_available():  # pragma: no cover - never installed with CUDA
            return allocate(vocab_size, batch_size)
        return torch.full(
            module.get_bitmask_shape(batch_size, vocab_size), -1, dtype=module.bitmask_dtype
        )

    def grammar_apply_vocab_mask(self, logits: torch.Tensor, vocab_mask: torch.Tensor) -> None:
        if logits.device.type == "cpu":
            return apply_token_bitmask_cpu(logits, vocab_mask)
        return grammar_apply(self, logits, vocab_mask)

    def backend_apply_vocab_mask(logits: torch.Tensor, vocab_mask: torch.Tensor) -> None:
        if logits.device.type == "cpu":
            return apply_token_bitmask_cpu(logits, vocab_mask)
        return backend_apply(logits, vocab_mask)

    module._allocate_token_bitmask = _allocate_token_bitmask
    module.XGrammarGrammar.apply_vocab_mask = grammar_apply_vocab_mask
    module.XGrammarGrammarBackend.apply_vocab_mask = staticmethod(backend_apply_vocab_mask)
    module._spexis_cpu_patched = True
    logger.debug("xgrammar backend: CPU bitmask allocation and application installed")


def install() -> None:
    """Patch SGLang's xgrammar backend now if it is imported, else right after its import."""
    module = sys.modules.get(XGRAMMAR_BACKEND_MODULE)
    if module is not None:
        _patch(module)
        return
    from spexis_sglang.cpu_support.quiet import after_import

    def patch_if_loaded() -> None:
        loaded = sys.modules.get(XGRAMMAR_BACKEND_MODULE)
        if loaded is not None:  # (None: its import failed, and that error propagates)
            _patch(loaded)

    after_import(XGRAMMAR_BACKEND_MODULE, patch_if_loaded)
