"""Gemma 3 under pipeline parallelism, with the Spexis stage-0 draft head.

SGLang 0.5.17's ``Gemma3ForCausalLM`` has no PP support: its ``forward`` takes no
``pp_proxy_tensors`` and every rank builds every layer, so ``--pp-size 2`` stops in
``ModelRunner.__init__`` with "Pipeline Parallel is not compatible with this model". This class
adds what SGLang's Llama has: each rank keeps only its layers (``get_pp_indices``, the others
become ``PPMissingLayer``), the first rank embeds, later ranks start from the previous rank's
``hidden_states`` / ``residual``, and only the last rank applies the final norm and the logits.
The per-layer computation is SGLang's own ``Gemma3DecoderLayer``; the residual stream a stage
hands on (``hidden_states + residual``) is HF's ``output_hidden_states[end_layer]``, what the
draft head is trained on. The embedding stays on every rank: it is the (tied) LM head the
last rank and stage 0's draft head both read.
"""

from __future__ import annotations

import logging
from typing import Iterable, Optional, Tuple

import torch
from sglang.srt.distributed import get_pp_group
from sglang.srt.layers.utils import PPMissingLayer
from sglang.srt.model_executor.forward_batch_info import ForwardBatch, PPProxyTensors
from sglang.srt.models import gemma3_causal
from sglang.srt.models.gemma3_causal import Gemma3ForCausalLM

from spexis_sglang.srt.draft_model import with_draft_head

logger = logging.getLogger(__name__)

_LAYER_PREFIX = "model.layers."


class Gemma3ForCausalLMPP(Gemma3ForCausalLM):
    """SGLang's Gemma 3 with pipeline stages (see the module docstring)."""

    def __init__(self, config, quant_config=None, prefix: str = "") -> None:
        super().__init__(config, quant_config=quant_config, prefix=prefix)
        from sglang.srt.distributed import get_pp_indices

        self.pp_group = get_pp_group()
        start, end = get_pp_indices(
            config.num_hidden_layers, self.pp_group.rank_in_group, self.pp_group.world_size
        )
        for i in list(range(0, start)) + list(range(end, config.num_hidden_layers)):
            self.model.layers[i] = PPMissingLayer(return_tuple=True)
        self.model.start_layer = self.start_layer = start
        self.model.end_layer = self.end_layer = end

    @torch.no_grad()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        forward_batch: ForwardBatch,
        input_embeds: torch.Tensor = None,
        get_embedding: bool = False,
        pp_proxy_tensors: Optional[PPProxyTensors] = None,
        **kwargs,
    ):
        m = self.model
        if self.pp_group.is_first_rank:
            hidden = m.embed_tokens(input_ids) if input_embeds is None else input_embeds
            residual = None
        else:
            hidden = pp_proxy_tensors["hidden_states"]
            residual = pp_proxy_tensors["residual"]
        if gemma3_causal._is_cpu and gemma3_causal._is_cpu_amx_available:
            pos, pe_global, pe_local = positions, None, None
        else:  # as Gemma3TextModel.forward
            pos = positions[None] if positions.dim() == 1 else positions
            pe_global = m.rotary_emb(hidden, pos)
            pe_local = m.rotary_emb_local(hidden, pos)
        for i in range(m.start_layer, m.end_layer):
            hidden, residual = m.layers[i](
                positions=pos,
                position_embeddings_global=pe_global,
                position_embeddings_local=pe_local,
                hidden_states=hidden,
                forward_batch=forward_batch,
                residual=residual,
                **kwargs,
            )
        if not self.pp_group.is_last_rank:
            return PPProxyTensors({"hidden_states": hidden, "residual": residual})
        hidden, _ = m.norm(hidden, residual)
        return self.logits_processor(input_ids, hidden, m.embed_tokens, forward_batch)

    def load_weights(self, weights: Iterable[Tuple[str, torch.Tensor]]):
        """Gemma's loader on this rank's layers only (the others have no parameters here)."""

        def mine(item: Tuple[str, torch.Tensor]) -> bool:
            name = item[0]
            if not name.startswith(_LAYER_PREFIX):
                return True
            layer = int(name[len(_LAYER_PREFIX) :].split(".", 1)[0])
            return self.model.start_layer <= layer < self.model.end_layer

        return super().load_weights(filter(mine, weights))


# Gemma 3 with pipeline stages and the Spexis draft head on stage 0
SpexisGemma3ForCausalLM = with_draft_head(Gemma3ForCausalLMPP, "SpexisGemma3ForCausalLM")
SpexisGemma3ForCausalLM.__module__ = __name__
