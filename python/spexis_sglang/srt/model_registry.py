"""The Spexis model classes in SGLang's model registry: stage 0 with the draft head.

Its own module so that the model modules (``draft_model``: Llama, Qwen2, Qwen3 and
:func:`~.draft_model.with_draft_head`; ``model_gemma3``) only import downwards: the registry
imports them, none of them imports the registry. The names below are plain strings, so the
launcher can refuse an architecture SP does not serve without importing any model code.
"""

from __future__ import annotations

import importlib
from typing import Dict, Optional, Tuple

#: checkpoint class (``architectures[0]`` of the model's config.json) -> the module and name of
#: Spexis' own class for it
SPEXIS_MODEL_CLASSES: Dict[str, Tuple[str, str]] = {
    "LlamaForCausalLM": ("spexis_sglang.srt.draft_model", "SpexisLlamaForCausalLM"),
    "Qwen2ForCausalLM": ("spexis_sglang.srt.draft_model", "SpexisQwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("spexis_sglang.srt.draft_model", "SpexisQwen3ForCausalLM"),
    # SGLang 0.5.17's Gemma 3 has no pipeline stages: Spexis brings them
    "Gemma3ForCausalLM": ("spexis_sglang.srt.model_gemma3", "SpexisGemma3ForCausalLM"),
}

#: checkpoint classes whose SGLang class gets the draft head as it is registered
#: (:func:`~.draft_model.with_draft_head`): its stages already pass on what the head reads
DRAFT_HEAD_ON_SGLANG_CLASS: Tuple[str, ...] = (
    "Glm4ForCausalLM",
    "MistralForCausalLM",  # SGLang's Llama under another name
    "MixtralForCausalLM",
    "Phi3ForCausalLM",  # Phi-3 and Phi-4: SGLang's Llama with fused projections
    "Qwen3MoeForCausalLM",
)


def sp_architectures() -> Tuple[str, ...]:
    """The checkpoint classes SP serves (``--spexis-draft-head``), sorted."""
    return tuple(sorted({*SPEXIS_MODEL_CLASSES, *DRAFT_HEAD_ON_SGLANG_CLASS}))


def unserved_architecture(architectures) -> Optional[str]:
    """The checkpoint class of a config's ``architectures`` list when SP cannot serve it
    (None when it can, or when the config names none: SGLang then refuses it itself)."""
    if not architectures:
        return None
    arch = str(architectures[0])
    return None if arch in sp_architectures() else arch


def install_model_classes() -> None:
    """Make SGLang build the Spexis model classes in this process (idempotent).

    Must run in every scheduler process before the model is loaded; without
    ``SPEXIS_DRAFT_HEAD`` (or off stage 0, or with PP=1) the classes behave exactly like
    SGLang's. An architecture whose SGLang module is disabled
    (``SGLANG_DISABLED_MODEL_ARCHS``) is left out, with its module unimported.
    """
    from sglang.srt.models.registry import ModelRegistry

    from spexis_sglang.srt.draft_model import with_draft_head

    models = ModelRegistry.models
    for arch, (module, name) in SPEXIS_MODEL_CLASSES.items():
        if arch in models:
            models[arch] = getattr(importlib.import_module(module), name)
    for arch in DRAFT_HEAD_ON_SGLANG_CLASS:
        if arch in models:
            models[arch] = with_draft_head(models[arch])


__all__ = [
    "DRAFT_HEAD_ON_SGLANG_CLASS",
    "SPEXIS_MODEL_CLASSES",
    "install_model_classes",
    "sp_architectures",
    "unserved_architecture",
]
