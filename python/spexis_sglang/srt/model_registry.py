"""The Spexis model classes in SGLang's model registry: stage 0 with the draft head.

Its own module so that the model modules (``draft_model``: Llama, Qwen2, Qwen3;
``model_mistral``; ``model_gemma3``) only import downwards: the registry imports them, none of
them imports the registry. The names below are plain strings, so the launcher can refuse an
architecture SP does not serve without importing any model code.
"""

from __future__ import annotations

import importlib
from typing import Dict, Optional, Tuple

#: checkpoint class (``architectures[0]`` of the model's config.json) -> the module and name of
#: the Spexis class that serves it under SP
SPEXIS_MODEL_CLASSES: Dict[str, Tuple[str, str]] = {
    "LlamaForCausalLM": ("spexis_sglang.srt.draft_model", "SpexisLlamaForCausalLM"),
    "MistralForCausalLM": ("spexis_sglang.srt.model_mistral", "SpexisMistralForCausalLM"),
    "Qwen2ForCausalLM": ("spexis_sglang.srt.draft_model", "SpexisQwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("spexis_sglang.srt.draft_model", "SpexisQwen3ForCausalLM"),
    "Gemma3ForCausalLM": ("spexis_sglang.srt.model_gemma3", "SpexisGemma3ForCausalLM"),
}


def sp_architectures() -> Tuple[str, ...]:
    """The checkpoint classes SP serves (``--spexis-draft-head``), sorted."""
    return tuple(sorted(SPEXIS_MODEL_CLASSES))


def unserved_architecture(architectures) -> Optional[str]:
    """The checkpoint class of a config's ``architectures`` list when SP cannot serve it
    (None when it can, or when the config names none: SGLang then refuses it itself)."""
    if not architectures:
        return None
    arch = str(architectures[0])
    return None if arch in SPEXIS_MODEL_CLASSES else arch


def install_model_classes() -> None:
    """Make SGLang build the Spexis model classes in this process (idempotent).

    Must run in every scheduler process before the model is loaded; without
    ``SPEXIS_DRAFT_HEAD`` (or off stage 0, or with PP=1) the classes behave exactly like
    SGLang's. An architecture whose SGLang module is disabled
    (``SGLANG_DISABLED_MODEL_ARCHS``) is left out, with its module unimported.
    """
    from sglang.srt.models.registry import ModelRegistry

    for arch, (module, name) in SPEXIS_MODEL_CLASSES.items():
        if arch in ModelRegistry.models:
            ModelRegistry.models[arch] = getattr(importlib.import_module(module), name)


__all__ = [
    "SPEXIS_MODEL_CLASSES",
    "install_model_classes",
    "sp_architectures",
    "unserved_architecture",
]
