"""The stage-0 draft head inside SGLang's own model (docs/design.md §2 step 1, §4).

Stage 0 of a pipeline with two or more stages carries an early-exit *draft head* on the residual
stream it hands downstream. The head runs inside the model's ``forward`` so that it sees the same
``ForwardBatch``, attention backend, forward metadata and ``out_cache_loc`` as the base layers: its
attention layers are ``K`` more layers of stage 0's KV pool (ids ``end_layer .. end_layer+K-1``),
written for every token (prefill too) into the request's own token slots.

The forward is exactly ``spexis_sglang.models.draft_head.DraftHead``'s (same parameter names)::

    x = norm(h + r)                       # norm.weight  (h, r: stage 0's proxy tensors)
    x = fc(x)                             # fc.weight, fc.bias  (Linear h -> h)
    for each layer i:                     # layers.{i}.*, Llama attention (GQA, RoPE of the base)
        x = x + self_attn(input_layernorm(x))
        x = post_attention_layernorm(x)   # only if an artifact has it (models' head has none)
    x = final_norm(x)                     # final_norm.weight
    logits = x[last token of each sequence] @ embed_tokens.weight[:K].T
    draft = argmax(logits), conf = max(softmax(logits)) (fp32)

``K`` is the vocabulary, or the first ``K`` ids with ``--spexis-draft-vocab K``: the LM head is
the head's largest read (a 128K-id vocabulary of 4096-wide rows is 1 GB in bf16, more than the
head's other weights several times over), and a byte-pair tokenizer numbers the frequent tokens
first. Under TP each rank scores the ids its shard holds and only the best id, its logit and
the sum of exponentials cross ranks (:func:`combine_shard_drafts`).

With constrained decoding, stage 0's scheduler may hand a decode batch's rows their grammar masks
(``sp_grammar``): the forbidden logits are set to -inf before the argmax and the softmax.

Unlike the torch reference (fp32 throughout) the SGLang head runs in the model's dtype, like the
base layers; the softmax is fp32 and the LM-head matmul is fp32 with ``--enable-fp32-lm-head``.

The head is configured per process by ``SPEXIS_DRAFT_HEAD``: an artifact directory
(``config.json`` + ``model.safetensors``) or ``random:<seed>`` (one layer, deterministic given the
seed and identical on every TP rank; for losslessness tests and dummy-weight benchmarks).

The model returns its stage-0 ``PPProxyTensors`` with two extra keys: ``spexis_draft_ids`` (int64
``[num_seqs]``) and ``spexis_draft_conf`` (float32 ``[num_seqs]``). Under SP the forward stops
before the LM head: it returns the head's hidden state (``spexis_draft_hidden``) with placeholder
drafts, and SP's scheduler makes the drafts after the forward (:meth:`spexis_make_drafts`) only
where something will use them, so an iteration that runs like stock PP (alpha 1) skips the LM
head even when the forward is a CUDA-graph replay. With a remaining-length
predictor configured (``--spexis-length-predictor``) a third, ``spexis_length_bucket`` (int64
``[num_seqs]``, the smallest threshold predicted, -1 for none), comes from the same exit residual
stream ``h + r`` at each sequence's last token, in fp32.
"""

from __future__ import annotations

import functools
import json
import logging
from typing import Any, Dict, Iterable, List, Optional, Tuple

import torch
from sglang.srt.distributed import (
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
    tensor_model_parallel_all_gather,
)
from sglang.srt.layers.layernorm import RMSNorm
from sglang.srt.layers.linear import ReplicatedLinear
from sglang.srt.model_executor.forward_batch_info import ForwardBatch, PPProxyTensors
from sglang.srt.model_loader.weight_utils import default_weight_loader
from sglang.srt.models.llama import LlamaAttention, LlamaForCausalLM
from sglang.srt.models.qwen2 import Qwen2ForCausalLM
from sglang.srt.models.qwen3 import Qwen3ForCausalLM
from sglang.srt.runtime_context import get_exec
from torch import nn

from spexis_sglang.srt.config import (
    ENV_DRAFT_FUSED,
    ENV_DRAFT_HEAD,
    ENV_DRAFT_TRACE,
    env_value,
    get_config,
)
from spexis_sglang.srt.draft_artifact import (
    LAYER_PARAM_RE,
    DraftHeadError,
    DraftHeadSpec,
    head_dims,
    resolve_draft_head,
)
from spexis_sglang.srt.draft_graphs import DraftPassGraphs
from spexis_sglang.srt.draft_triton import fused_available, greedy_draft_fused
from spexis_sglang.srt.fused_switch import FusedSwitch
from spexis_sglang.srt.protocol import (
    PLACEHOLDER_TOKEN,
    PROXY_DRAFT_CONF,
    PROXY_DRAFT_HIDDEN,
    PROXY_DRAFT_HOST,
    PROXY_DRAFT_IDS,
    PROXY_LENGTH_BUCKET,
    pack_drafts,
)
from spexis_sglang.srt.sp_grammar import draft_mask_of

logger = logging.getLogger(__name__)


# ------------------------------------------------------------------------------------------------
# The head, built from SGLang modules
# ------------------------------------------------------------------------------------------------


def _rope_args(config: Any) -> Dict[str, Any]:
    """The head's RoPE: default (no scaling) with the base's theta, as the torch reference
    (``models.draft_head``) trains it; for Gemma 3's per-layer-type parameters, the global
    layers' theta."""
    from spexis_sglang.models.artifact import architecture_fields

    return dict(
        rope_theta=architecture_fields(config)["rope_theta"],
        rope_scaling=None,
        rope_is_neox_style=getattr(config, "rope_is_neox_style", True),
        max_position_embeddings=getattr(config, "max_position_embeddings", 8192),
    )


class SpexisDraftLayer(nn.Module):
    """Attention-only decoder layer: one more layer of stage 0's KV pool."""

    def __init__(self, config: Any, layer_id: int, post_attention_norm: bool, prefix: str):
        super().__init__()
        hidden, num_heads, num_kv_heads, _ = head_dims(config)
        self.input_layernorm = RMSNorm(hidden, eps=config.rms_norm_eps)
        self.self_attn = LlamaAttention(
            config=config,
            hidden_size=hidden,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            layer_id=layer_id,
            start_layer=layer_id,
            quant_config=None,
            prefix=f"{prefix}.self_attn",
            bias=False,
            **_rope_args(config),
        )
        self.post_attention_layernorm = (
            RMSNorm(hidden, eps=config.rms_norm_eps) if post_attention_norm else None
        )

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, forward_batch: ForwardBatch
    ) -> torch.Tensor:
        x = x + self.self_attn(
            positions=positions,
            hidden_states=self.input_layernorm(x),
            forward_batch=forward_batch,
        )
        if self.post_attention_layernorm is not None:
            x = self.post_attention_layernorm(x)
        return x


class SpexisDraftHead(nn.Module):
    """norm -> fc -> K attention-only layers -> final norm; the LM head is the base embedding."""

    def __init__(self, config: Any, spec: DraftHeadSpec, first_layer_id: int, prefix: str):
        super().__init__()
        hidden = int(config.hidden_size)
        self.num_layers = spec.num_layers
        self.first_layer_id = first_layer_id
        self.vocab_size = int(config.vocab_size)
        self.norm = RMSNorm(hidden, eps=config.rms_norm_eps)
        self.fc = ReplicatedLinear(hidden, hidden, bias=True, prefix=f"{prefix}.fc")
        self.layers = nn.ModuleList(
            SpexisDraftLayer(
                config, first_layer_id + i, spec.post_attention_norm, f"{prefix}.layers.{i}"
            )
            for i in range(spec.num_layers)
        )
        self.final_norm = RMSNorm(hidden, eps=config.rms_norm_eps) if spec.final_norm else None
        self.tp_size = get_tensor_model_parallel_world_size()
        self.tp_rank = get_tensor_model_parallel_rank()
        draft_vocab = get_config().draft_vocab
        self.draft_vocab = min(draft_vocab or self.vocab_size, self.vocab_size)
        # Like SGLang's LogitsProcessor: model dtype unless --enable-fp32-lm-head.
        self.fp32_lm_head = bool(get_exec().features.enable_fp32_lm_head)

    def load_weights(self, weights: Dict[str, torch.Tensor]) -> None:
        """Load full (unsharded) artifact tensors; q/k/v go through QKVParallelLinear's loader."""
        params = dict(self.named_parameters())
        loaded = set()
        for name, tensor in weights.items():
            m = LAYER_PARAM_RE.match(name)
            if m and m.group(2) in (
                "self_attn.q_proj.weight",
                "self_attn.k_proj.weight",
                "self_attn.v_proj.weight",
            ):
                shard = m.group(2).split(".")[1][0]  # "q" | "k" | "v"
                target = f"layers.{m.group(1)}.self_attn.qkv_proj.weight"
                param = params[target]
                param.weight_loader(param, tensor, shard)
            else:
                target = name
                param = params[target]
                getattr(param, "weight_loader", default_weight_loader)(param, tensor)
            loaded.add(target)
        missing = sorted(set(params) - loaded)
        if missing:
            raise DraftHeadError(f"draft head: parameters left unloaded: {missing}")

    def forward(
        self,
        hidden_states: torch.Tensor,
        residual: Optional[torch.Tensor],
        positions: torch.Tensor,
        forward_batch: ForwardBatch,
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        """The head up to its LM head: ``(x [S, hidden], last-token row indices [S])``, ``x``
        normed at each sequence's last token (:meth:`drafts` turns it into drafts)."""
        x = hidden_states if residual is None else hidden_states + residual
        x = self.norm(x)
        x, _ = self.fc(x)
        # Every token goes through attention so the head's KV exists for every position.
        for layer in self.layers:
            x = layer(positions, x, forward_batch)
        if forward_batch.forward_mode.is_extend():
            last = forward_batch.extend_start_loc + forward_batch.extend_seq_lens - 1
            last = last.to(torch.long)
            x = x[last]
        else:
            last = torch.arange(x.shape[0], device=x.device)
        if self.final_norm is not None:
            x = self.final_norm(x)
        return x, last

    def drafts(
        self, x: torch.Tensor, lm_head_weight: torch.Tensor, draft_mask=None, buckets=None
    ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(draft_ids int64 [S], conf fp32 [S], packed)`` from :meth:`forward`'s ``x``: the
        LM head (a decode forward's grammar ``draft_mask`` applied first), and the
        :func:`pack_drafts` block stage 0 reads back (``buckets``: each row's length bucket),
        on a GPU from one pass over the logits."""
        if not self._sharded(draft_mask):
            logits = self._draft_logits(x, lm_head_weight, draft_mask)
            if FUSED_DRAFTS.on and fused_available(logits):
                fused = FUSED_DRAFTS.run(greedy_draft_fused, logits, buckets)
                if fused is not None:
                    return fused
            ids, conf = greedy_draft(logits)
        else:
            ids, conf = self._shard_drafts(x, lm_head_weight)
        return ids, conf, pack_drafts(ids, conf, buckets)

    def _sharded(self, draft_mask) -> bool:
        """Each TP rank drafts among its shard of the draft vocabulary (``_shard_drafts``)."""
        return self.tp_size > 1 and self.draft_vocab < self.vocab_size and draft_mask is None

    def _draft_logits(self, x: torch.Tensor, lm_head_weight: torch.Tensor, draft_mask=None):
        """The draft vocabulary's logits, the grammar's ``draft_mask`` applied."""
        vocab = self.vocab_size if self.tp_size > 1 else self.draft_vocab
        logits = self._logits(x, lm_head_weight[:vocab])
        if self.tp_size > 1:
            logits = tensor_model_parallel_all_gather(logits, dim=-1)
        logits = logits[:, : self.draft_vocab]
        if draft_mask is not None:  # constrained decoding: draft what the grammar allows
            logits = logits.float()
            draft_mask.apply(logits)  # (the mask's first ``draft_vocab`` ids)
        return logits

    def _logits(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if self.fp32_lm_head:
            return torch.matmul(x.float(), weight.float().T)
        return torch.matmul(x.to(weight.dtype), weight.T)

    def _shard_drafts(
        self, x: torch.Tensor, shard: torch.Tensor
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        """``--spexis-draft-vocab`` under TP: each rank scores the draft ids its vocabulary
        shard holds (rank r holds ids ``[r * rows, (r + 1) * rows)``), and the ranks exchange
        only their best id, its logit and their sum of ``exp(logit - best)``."""
        rows = shard.shape[0]
        first = self.tp_rank * rows
        own = max(0, min(rows, self.draft_vocab - first))
        if own:
            logits = self._logits(x, shard[:own]).float()
        else:  # none of the draft ids is on this rank: no GEMM
            logits = x.new_zeros((x.shape[0], 0), dtype=torch.float32)
        part = shard_draft_part(logits, first)
        parts = tensor_model_parallel_all_gather(part, dim=-1)
        return combine_shard_drafts(parts.view(x.shape[0], self.tp_size, 3))


#: the fused pass, unless ``SPEXIS_DRAFT_FUSED=0`` or it failed on this GPU
FUSED_DRAFTS = FusedSwitch(ENV_DRAFT_FUSED, "fused draft pass", "drafting")


def greedy_draft(logits: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Draft id (int64) and its softmax probability (fp32) per row of ``logits``; a row a
    grammar masked entirely (possible only within ``--spexis-draft-vocab``) gets confidence 0
    (its draft is rejected).

    16-bit logits are read as they are: each converts to fp32 exactly, so their max and its id
    are those of their fp32 copy, and the subtraction promotes to fp32 for the exponentials
    and their sum. No fp32 copy of the ``[rows, vocab]`` logits is made: at 64 rows of 128K
    ids that copy and a max over it were ~0.1 ms of stage 0's eager draft work on an H200.
    Wider logits (float64: the CPU's exact mode) are rounded to fp32 first. On a GPU the
    draft head reads the logits in one Triton pass instead (:meth:`SpexisDraftHead.drafts`,
    :mod:`~spexis_sglang.srt.draft_triton`: the same ids, the confidence to its last bits)."""
    if logits.dtype not in (torch.float16, torch.bfloat16):
        logits = logits.float()
    top, ids = logits.max(dim=-1)
    top = top.float()
    conf = 1.0 / torch.exp(logits - top.unsqueeze(-1)).sum(dim=-1)
    conf = torch.where(torch.isfinite(top), conf, torch.zeros_like(conf))
    return ids.to(torch.int64), conf.to(torch.float32)


def shard_draft_part(logits: torch.Tensor, first: int) -> torch.Tensor:
    """One rank's part for :func:`combine_shard_drafts` (``[rows, 3]`` fp32; ids < 2**24 are
    exact) from its fp32 ``logits`` of the draft ids ``first, first + 1, ...`` it holds (none:
    ``-inf``, 0, 0)."""
    if logits.shape[-1] == 0:
        top = torch.full(logits.shape[:-1], float("-inf"), device=logits.device)
        return torch.stack((top, torch.zeros_like(top), torch.zeros_like(top)), dim=-1)
    top, ids = logits.max(dim=-1)
    total = torch.exp(logits - top.unsqueeze(-1)).sum(dim=-1)
    return torch.stack((top, (ids + first).float(), total), dim=-1)


def combine_shard_drafts(parts: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """``greedy_draft`` over a vocabulary split across ranks, from each rank's part
    ``[rows, ranks, 3]``: its best logit, that id and its sum of ``exp(logit - best)``
    (``-inf``, any, 0 for a rank that holds none of the ids). The same id and confidence as
    over the whole logits (ties: the lowest id, as ``max`` takes)."""
    tops, ids, totals = parts.unbind(-1)
    top, rank = tops.max(dim=-1)
    scale = torch.where(torch.isfinite(tops), torch.exp(tops - top.unsqueeze(-1)), 0.0)
    conf = 1.0 / (totals * scale).sum(dim=-1)
    ids = ids.gather(-1, rank.unsqueeze(-1)).squeeze(-1)
    return ids.to(torch.int64), conf.to(torch.float32)


# ------------------------------------------------------------------------------------------------
# The model classes
# ------------------------------------------------------------------------------------------------


class _SpexisDraftMixin:
    """Adds the draft head to a Llama-style ``*ForCausalLM`` on the first of >= 2 PP stages."""

    spexis_draft_head: Optional[SpexisDraftHead]

    def _spexis_init_draft_head(self) -> None:
        self.spexis_draft_head = None
        self._spexis_length_path: Optional[str] = None
        self._spexis_length_predictor = None
        self._spexis_pending_weights: Optional[Dict[str, torch.Tensor]] = None
        self._spexis_trace_path = env_value(ENV_DRAFT_TRACE)
        #: the forward leaves the drafts to SP's scheduler (``spexis_make_drafts``)
        self.spexis_deferred_drafts = False
        value = env_value(ENV_DRAFT_HEAD)
        pp = self.pp_group
        if not value or pp.world_size < 2 or not pp.is_first_rank:
            return
        end_layer = int(self.model.end_layer)
        spec = resolve_draft_head(value, self.config, end_layer, pp.world_size)
        if spec is None:
            return
        self.spexis_draft_head = SpexisDraftHead(
            self.config, spec, first_layer_id=end_layer, prefix="spexis_draft_head"
        )
        self._spexis_pending_weights = spec.weights
        self.spexis_deferred_drafts = get_config().enabled
        self._spexis_length_path = get_config().length_predictor
        logger.info(
            "spexis draft head %s: %d attention layer(s) at KV layer ids %d..%d after stage 0's "
            "layers [%d, %d), drafting among %d of %d token ids",
            spec.source,
            spec.num_layers,
            end_layer,
            end_layer + spec.num_layers - 1,
            int(self.model.start_layer),
            end_layer,
            self.spexis_draft_head.draft_vocab,
            self.spexis_draft_head.vocab_size,
        )

    @property
    def spexis_draft_num_layers(self) -> int:
        """Extra KV layers stage 0's pool needs (0 without an active head)."""
        head = getattr(self, "spexis_draft_head", None)
        return head.num_layers if head is not None else 0

    def _spexis_load_draft_weights(self) -> None:
        if self._spexis_pending_weights is None or self.spexis_draft_head is None:
            return
        self.spexis_draft_head.load_weights(self._spexis_pending_weights)
        self._spexis_pending_weights = None
        if self._spexis_length_path is not None:
            self._spexis_load_length_predictor()

    def _spexis_load_length_predictor(self) -> None:
        """Load the predictor with the weights, in fp32 on the model's device: before the CUDA
        graphs are captured, and a broken artifact fails at start-up, not at the first forward."""
        from spexis_sglang.models.length_predictor import load_length_predictor

        lp, _ = load_length_predictor(
            self._spexis_length_path,
            self.config,
            exit_layer=int(self.model.end_layer),
            device=self.model.embed_tokens.weight.device,
        )
        self._spexis_length_predictor = lp.eval()
        logger.info("spexis length predictor %s on stage 0", self._spexis_length_path)

    def load_weights(self, weights: Iterable[Tuple[str, torch.Tensor]]):
        result = super().load_weights(weights)
        self._spexis_load_draft_weights()
        return result

    def post_load_weights(self) -> None:
        """Called by loaders that bypass ``load_weights`` (``--load-format dummy``, ...)."""
        parent = getattr(super(), "post_load_weights", None)
        if parent is not None:
            parent()
        self._spexis_load_draft_weights()

    def _spexis_trace(self, mode: str, rids: List[str], positions: List[int], ids, conf) -> None:
        if get_tensor_model_parallel_rank() != 0:
            return
        record = {
            "mode": mode,
            "rids": list(rids or []),
            "positions": list(positions),
            "ids": ids.tolist(),
            "conf": conf.tolist(),
        }
        with open(self._spexis_trace_path, "a") as f:
            f.write(json.dumps(record) + "\n")

    @property
    def spexis_traces_drafts(self) -> bool:
        """``SPEXIS_DRAFT_TRACE`` is set: every draft made is written there."""
        return bool(self._spexis_trace_path)

    def _spexis_length_buckets(self, exit_hidden: torch.Tensor) -> torch.Tensor:
        """Remaining-length bucket per row (the predictor runs in fp32; it is 1 MB)."""
        from spexis_sglang.models.length_predictor import predicted_bucket

        return predicted_bucket(self._spexis_length_predictor.predict(exit_hidden.float()))

    def _spexis_forward(self, out: Any, positions: torch.Tensor, forward_batch: ForwardBatch):
        hidden = out["hidden_states"]
        residual = out.tensors.get("residual")
        if forward_batch.forward_mode.is_idle() or hidden.shape[0] == 0:
            out[PROXY_DRAFT_IDS] = torch.zeros(0, dtype=torch.int64, device=hidden.device)
            out[PROXY_DRAFT_CONF] = torch.zeros(0, dtype=torch.float32, device=hidden.device)
            if self._spexis_length_path is not None:
                out[PROXY_LENGTH_BUCKET] = torch.zeros(0, dtype=torch.int64, device=hidden.device)
            out[PROXY_DRAFT_HOST] = torch.zeros((0, 3), dtype=torch.float64, device=hidden.device)
            return out
        head = self.spexis_draft_head
        x, last = head(hidden, residual, positions, forward_batch)
        buckets = None
        if self._spexis_length_path is not None:
            h = hidden if residual is None else hidden + residual
            out[PROXY_LENGTH_BUCKET] = buckets = self._spexis_length_buckets(h[last])
        out[PROXY_DRAFT_HIDDEN] = x
        if not self.spexis_deferred_drafts:
            mode = forward_batch.forward_mode
            mask = None if mode.is_extend() else draft_mask_of(forward_batch)
            trace = None
            capturing = torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
            if self._spexis_trace_path and not capturing:  # (a replay writes no trace)
                trace = (mode.name, list(forward_batch.rids or []), positions[last].tolist())
            self.spexis_make_drafts(out.tensors, x.shape[0], mask, trace, graph=False)
            return out
        # SP's scheduler makes the drafts after the forward where it wants them
        # (spexis_make_drafts); until then: draft PLACEHOLDER_TOKEN at confidence 0
        ids = torch.full((x.shape[0],), PLACEHOLDER_TOKEN, dtype=torch.int64, device=x.device)
        conf = torch.zeros(x.shape[0], dtype=torch.float32, device=x.device)
        out[PROXY_DRAFT_IDS] = ids
        out[PROXY_DRAFT_CONF] = conf
        # what stage 0's scheduler reads back, in one block (inside the graph when captured)
        out[PROXY_DRAFT_HOST] = pack_drafts(ids, conf, buckets)
        return out

    def spexis_make_drafts(
        self,
        tensors: Dict[str, torch.Tensor],
        rows: int,
        draft_mask=None,
        trace: Optional[Tuple[str, List[str], List[int]]] = None,
        graph: bool = True,
    ) -> bool:
        """The drafts of a forward's first ``rows`` rows (a CUDA-graph replay's outputs are
        padded) from the head's hidden state, into ``tensors``: the forward's own last step,
        or under SP the scheduler's after the forward, in place of the forward's placeholders,
        so that a forward whose drafts nothing would use skips the LM head, the head's largest
        read, even when it is a graph replay. ``trace``: the forward's mode, request ids and
        positions, for ``SPEXIS_DRAFT_TRACE``. ``graph``: the pass may replay a CUDA graph of its
        own (not inside the forward, which SGLang may be capturing). Returns whether one made
        them."""
        x = tensors.pop(PROXY_DRAFT_HIDDEN)
        buckets = tensors.get(PROXY_LENGTH_BUCKET)
        drafts = None
        if graph and draft_mask is None:
            graphs = self._spexis_graphs(x)
            if graphs is not None:
                drafts = graphs.run(x, rows, buckets)
        replayed = drafts is not None
        if drafts is None:
            drafts = self.spexis_draft_head.drafts(
                x[:rows],
                self.model.embed_tokens.weight,
                draft_mask,
                None if buckets is None else buckets[:rows],
            )
        ids, conf, packed = drafts
        tensors[PROXY_DRAFT_IDS] = ids
        tensors[PROXY_DRAFT_CONF] = conf
        tensors[PROXY_DRAFT_HOST] = packed
        if self._spexis_trace_path and trace is not None:
            self._spexis_trace(*trace, ids, conf)
        return replayed

    def _spexis_graphs(self, x: torch.Tensor) -> Optional[DraftPassGraphs]:
        """Stage 0's draft pass graphs (``draft_graphs``): on a GPU, with one TP rank (the
        ranks' exchange of logits stays eager)."""
        graphs = getattr(self, "_spexis_draft_graphs", None)
        if graphs is None:
            head = self.spexis_draft_head
            graphs = False  # (a CPU, or TP: decided once)
            if x.is_cuda and head.tp_size == 1:
                weight = self.model.embed_tokens.weight

                def draft(hidden: torch.Tensor, buckets: Optional[torch.Tensor]):
                    return head.drafts(hidden, weight, None, buckets)

                graphs = DraftPassGraphs(draft, x.shape[-1], x.dtype, x.device)
            self._spexis_draft_graphs = graphs
        return graphs if graphs and graphs.on else None

    @torch.no_grad()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        forward_batch: ForwardBatch,
        input_embeds: torch.Tensor = None,
        get_embedding: bool = False,
        pp_proxy_tensors: Optional[PPProxyTensors] = None,
    ):
        # SGLang's MoE classes take no ``get_embedding`` (they serve no embeddings)
        kwargs = {"get_embedding": True} if get_embedding else {}
        out = super().forward(
            input_ids,
            positions,
            forward_batch,
            input_embeds=input_embeds,
            pp_proxy_tensors=pp_proxy_tensors,
            **kwargs,
        )
        if self.spexis_draft_head is None or get_embedding or not isinstance(out, PPProxyTensors):
            return out
        return self._spexis_forward(out, positions, forward_batch)


@functools.lru_cache(maxsize=None)
def with_draft_head(base: type, name: Optional[str] = None) -> type:
    """Spexis' class for an SGLang model class whose pipeline stages hand on
    ``hidden_states`` and ``residual`` and whose first stage holds ``model.embed_tokens`` (as
    Llama's do): ``base`` with the draft head on stage 0, named ``name`` (default
    ``Spexis<base>``). Idempotent, and one class per base: the registry's and this module's
    are the same object."""
    if issubclass(base, _SpexisDraftMixin):
        return base

    def __init__(self, config, quant_config=None, prefix: str = "") -> None:
        base.__init__(self, config, quant_config=quant_config, prefix=prefix)
        self._spexis_init_draft_head()

    return type(
        name or f"Spexis{base.__name__}",
        (_SpexisDraftMixin, base),
        {
            "__init__": __init__,
            "__module__": __name__,
            "__doc__": f"{base.__name__} with the Spexis draft head on the first PP stage.",
        },
    )


SpexisLlamaForCausalLM = with_draft_head(LlamaForCausalLM)
SpexisQwen2ForCausalLM = with_draft_head(Qwen2ForCausalLM)  # Qwen2.5 and its distills too
SpexisQwen3ForCausalLM = with_draft_head(Qwen3ForCausalLM)


def draft_num_layers(model: nn.Module) -> int:
    """Number of draft-head KV layers ``model`` needs in this rank's pool (0 if none)."""
    return int(getattr(model, "spexis_draft_num_layers", 0) or 0)


__all__: List[str] = [
    "ENV_DRAFT_HEAD",
    "ENV_DRAFT_TRACE",
    "PROXY_DRAFT_CONF",
    "PROXY_DRAFT_IDS",
    "SpexisDraftHead",
    "SpexisLlamaForCausalLM",
    "SpexisQwen2ForCausalLM",
    "SpexisQwen3ForCausalLM",
    "combine_shard_drafts",
    "draft_num_layers",
    "greedy_draft",
    "shard_draft_part",
    "with_draft_head",
]
