"""The Spexis model classes in SGLang's model registry: stage 0 with the draft head.

Its own module so that the model modules (``draft_model``: Llama, Qwen3; ``model_gemma3``)
only import downwards: the registry imports them, none of them imports the registry.
"""

from __future__ import annotations

from spexis_sglang.srt.draft_model import SpexisLlamaForCausalLM, SpexisQwen3ForCausalLM

SPEXIS_MODEL_CLASSES = {
    "LlamaForCausalLM": SpexisLlamaForCausalLM,
    "Qwen3ForCausalLM": SpexisQwen3ForCausalLM,
}


def install_model_classes() -> None:
    """Make SGLang build the Spexis model classes in this process (idempotent).

    Must run in every scheduler process before the model is loaded; without
    ``SPEXIS_DRAFT_HEAD`` (or off stage 0, or with PP=1) the classes behave exactly like SGLang's.
    """
    from sglang.srt.models.registry import ModelRegistry

    for arch, cls in SPEXIS_MODEL_CLASSES.items():
        ModelRegistry.models[arch] = cls
    if "Gemma3ForCausalLM" in ModelRegistry.models:  # not when its module is disabled
        from spexis_sglang.srt.model_gemma3 import SpexisGemma3ForCausalLM

        ModelRegistry.models["Gemma3ForCausalLM"] = SpexisGemma3ForCausalLM


__all__ = ["SPEXIS_MODEL_CLASSES", "install_model_classes"]
