"""Mistral with the Spexis stage-0 draft head.

SGLang's ``MistralForCausalLM`` is its Llama under another name, so the draft head attaches as
it does to Llama. Its own module because ``sglang.srt.models.mistral`` also imports the
multimodal Mistral 3 parts from transformers: it is imported only where SGLang's registry
serves Mistral.
"""

from __future__ import annotations

from sglang.srt.models.mistral import MistralForCausalLM

from spexis_sglang.srt.draft_model import _SpexisDraftMixin


class SpexisMistralForCausalLM(_SpexisDraftMixin, MistralForCausalLM):
    """SGLang's Mistral with the Spexis draft head on the first PP stage."""

    def __init__(self, config, quant_config=None, prefix: str = "") -> None:
        super().__init__(config, quant_config=quant_config, prefix=prefix)
        self._spexis_init_draft_head()


__all__ = ["SpexisMistralForCausalLM"]
