"""AIConfigurator's measured SGLang operator tables as per-stage GPU times.

AIConfigurator (``aiconfigurator-core`` 0.12.0, Apache-2.0; the optional extra
``spexis-sglang[planner]``) ships latency tables measured on SGLang 0.5.x for 14 systems:
GEMM by (m, n, k, dtype), decode and prefill attention by batch, KV length and head shape,
SGLang's custom all-reduce and NCCL collectives for 2/4/8 GPUs, and each system's node model
(NVLink bandwidth, p2p latency, memory). Its SDK turns a model into lists of operators and
evaluates them with a compiled engine. We use exactly that engine, but on our own operator
lists, because a Spexis stage is not something its models describe:

* **a stage, not a model.** AIConfigurator's PP model charges every layer of the model to
  one request's TPOT and multiplies the throughput by ``pp`` (its batch is per micro-batch).
  We evaluate one decoder layer's operators and let the simulator put ``layers`` of them in
  each stage, with the embedding on the first and the LM head on the last.
* **the draft head and the length predictor** (stage 0 under SP) are built from the same
  operator classes: norm, ``fc`` (H x H), one attention-only layer (QKV, attention, O), final
  norm, the base model's LM head and a softmax; the predictor's three small GEMMs.
* **sampling** has no operator: modelled as element-wise passes over the fp32 logits (cast,
  argmax); the draft head's softmax likewise (cast, max, exp, sum: about 22 bytes per
  vocabulary entry and row).
* **the logits all-gather of a vocab-parallel LM head under TP** (SGLang gathers the logits
  of every TP rank) is missing from its Llama model: added as an NCCL all-gather.
* **transfers between stages** come from its node model (``p2p_latency``,
  ``intra_node_bw``) as a :class:`~spexis_sglang.core.stage_costs.LinkSpec` for our FIFO
  links, not from its ``P2P`` operator, because the simulator places each transfer in time.
* **the memory-bound share** of each component (for the emulated box, where two stages
  share one GPU) comes from its speed-of-light decomposition (``evaluate_ops_sol_json``).

Its SGLang database is for 0.5.14 (``current`` slot) on most systems; we run 0.5.17. The
attention rows used are SGLang's triton kernels (our GPU runs use ``--attention-backend
triton``). Dense decoder models only (Llama, Qwen2/3, Mistral, Phi-3, GLM-4-style
``config.json``); the mixture-of-experts models SP serves are not modelled.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

import numpy as np

from spexis_sglang.core.stage_costs import CostGrid, LinkSpec, StageCosts

logger = logging.getLogger(__name__)

__all__ = [
    "ModelShape",
    "load_model_shape",
    "AICBridge",
    "aic_available",
    "AIC_VERSION",
    "DECODE_ROWS",
    "DECODE_CTX",
]

#: The pinned AIConfigurator core (its tables and engine) this bridge was written against.
AIC_VERSION = "0.12.0"
DECODE_ROWS = (1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024)
DECODE_CTX = (128, 256, 512, 1024, 2048, 4096, 8192, 16384)
PREFILL_TOKENS = (64, 256, 1024, 2048, 4096, 8192, 16384)
PREFILL_CTX = (64, 256, 1024, 2048, 8192)
#: The length predictor's hidden width (``models/length_predictor.py`` default).
LENGTH_PREDICTOR_HIDDEN = 512
_DENSE_ARCHS = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Phi3ForCausalLM",  # Llama's shapes, q/k/v and gate/up stored fused
    "Glm4ForCausalLM",  # Llama's GEMMs plus two element-wise norms per layer
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)


def aic_available() -> bool:
    try:
        import aiconfigurator_core  # noqa: F401
    except ImportError:
        return False
    return True


def _require_aic():
    try:
        import aiconfigurator_core
    except ImportError as e:
        raise ImportError(
            "AIConfigurator is not installed: pip install 'spexis-sglang[planner]' "
            f"(aiconfigurator-core=={AIC_VERSION})"
        ) from e
    return aiconfigurator_core


@dataclass(frozen=True)
class ModelShape:
    """What the stage costs need from a Hugging Face ``config.json``."""

    name: str
    architecture: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    qk_norm: bool = False
    #: the draft head drafts among the first this-many ids (``--spexis-draft-vocab``; None: all)
    draft_vocab: Optional[int] = None

    @classmethod
    def from_hf_config(cls, cfg: Mapping[str, Any], name: str = "") -> "ModelShape":
        archs = cfg.get("architectures") or ["?"]
        arch = archs[0]
        if arch not in _DENSE_ARCHS:
            raise ValueError(
                f"{name or 'config'}: architecture {arch!r} is not supported by the planner "
                f"(dense decoders only: {', '.join(_DENSE_ARCHS)})"
            )
        for key in ("num_hidden_layers", "hidden_size", "num_attention_heads", "vocab_size"):
            if key not in cfg:
                raise ValueError(f"{name or 'config'}: config.json lacks {key!r}")
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        return cls(
            name=name or cfg.get("_name_or_path", arch),
            architecture=arch,
            num_layers=int(cfg["num_hidden_layers"]),
            hidden_size=hidden,
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads", heads)),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            intermediate_size=int(cfg["intermediate_size"]),
            vocab_size=int(cfg["vocab_size"]),
            qk_norm=arch == "Qwen3ForCausalLM",
        )

    def weight_bytes(self, act_bytes: int = 2) -> float:
        """Parameters of the decoder layers, embedding and LM head, in bytes."""
        h, d = self.hidden_size, self.head_dim
        attn = h * (self.num_heads * d + 2 * self.num_kv_heads * d) + self.num_heads * d * h
        mlp = 3 * h * self.intermediate_size
        return act_bytes * (self.num_layers * (attn + mlp) + 2 * self.vocab_size * h)

    def kv_bytes_per_token(self, layers: Optional[int] = None, act_bytes: int = 2) -> float:
        n = self.num_layers if layers is None else layers
        return 2.0 * n * self.num_kv_heads * self.head_dim * act_bytes


def load_model_shape(model: str) -> ModelShape:
    """A ``config.json`` file, a directory holding one, or a model name AIConfigurator ships."""
    path = model
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            cfg = json.load(f)
        name = os.path.basename(os.path.dirname(os.path.abspath(path)))
        return ModelShape.from_hf_config(cfg, name)
    aic = _require_aic()
    shipped = os.path.join(
        os.path.dirname(aic.__file__), "model_configs", model.replace("/", "--") + "_config.json"
    )
    if not os.path.isfile(shipped):
        raise FileNotFoundError(
            f"{model!r} is neither a config.json (or a directory with one) nor a model "
            "AIConfigurator ships a config for"
        )
    with open(shipped, encoding="utf-8") as f:
        cfg = json.load(f)
    return ModelShape.from_hf_config(cfg, model)


@functools.lru_cache(maxsize=8)
def _bridge_state(system: str, backend: str, version: str, attention_backend: str):
    _require_aic()
    from aiconfigurator_core.sdk import perf_database
    from aiconfigurator_core.sdk.engine import EngineHandle

    db = perf_database.get_database(system, backend, version)
    if db is None:
        raise ValueError(f"AIConfigurator has no {backend} database for system {system!r}")
    handle = EngineHandle.for_database(db)
    spec = perf_database.load_system_spec(system)
    return db, handle, spec


class AICBridge:
    """Evaluate our per-component operator lists with AIConfigurator's engine and tables."""

    def __init__(
        self,
        system: str,
        backend: str = "sglang",
        version: str = "current",
        attention_backend: str = "triton",
    ) -> None:
        self.system = system
        self.backend = backend
        self.attention_backend = attention_backend
        self.db, self.handle, self.spec = _bridge_state(system, backend, version, attention_backend)
        self.version = getattr(self.db, "version", version)

    # -- operator lists --------------------------------------------------------------------
    def _quant(self):
        from aiconfigurator_core.sdk import common

        return (
            common.GEMMQuantMode.bfloat16,
            common.KVCacheQuantMode.bfloat16,
            common.FMHAQuantMode.bfloat16,
            common.CommQuantMode.half,
        )

    def component_ops(self, m: ModelShape, tp: int, phase: str) -> dict[str, list]:
        """Operators per cost component, each for one layer (layer components) or once."""
        import aiconfigurator_core.sdk.operations as ops

        if m.num_heads % tp or m.vocab_size < tp:
            raise ValueError(f"{m.name}: {m.num_heads} heads do not split over TP={tp}")
        gq, kvq, fq, cq = self._quant()
        h, d = m.hidden_size, m.head_dim
        nh = m.num_heads // tp
        nkv = max(1, math.ceil(m.num_kv_heads / tp))
        inter = m.intermediate_size // tp
        vocab = m.vocab_size // tp
        p = "context" if phase == "prefill" else "generation"

        def attention(name: str):
            if phase == "prefill":
                return ops.ContextAttention(
                    f"{p}_{name}", 1, nh, nkv, kvq, fq, head_size=d, use_qk_norm=m.qk_norm
                )
            return ops.GenerationAttention(
                f"{p}_{name}", 1, nh, nkv, kvq, head_size=d, use_qk_norm=m.qk_norm
            )

        def ar(name: str):
            return [ops.CustomAllReduce(f"{p}_{name}", 1, h, tp)] if tp > 1 else []

        def logits_gather(name: str):
            if tp == 1:
                return []
            return [ops.NCCL(f"{p}_{name}", 1, "all_gather", m.vocab_size // tp, tp, cq)]

        def draft_logits():
            if m.draft_vocab is None:  # every id: the logits gathered, the softmax over all
                return [
                    ops.GEMM(f"{p}_draft_logits_gemm", 1, vocab, h, gq),
                    *logits_gather("draft_logits_gather"),
                    ops.ElementWise(f"{p}_draft_softmax", 1, 11 * m.vocab_size, 1, 0.8),
                ]
            # the first draft_vocab ids: the rank holding most of them scores its share, and
            # the ranks exchange their best id, its logit and their sum of exponentials
            ids = min(m.draft_vocab, vocab)
            exchange = [ops.NCCL(f"{p}_draft_best_gather", 1, "all_gather", 3, tp, cq)]
            return [
                ops.GEMM(f"{p}_draft_logits_gemm", 1, ids, h, gq),
                *(exchange if tp > 1 else []),
                ops.ElementWise(f"{p}_draft_softmax", 1, 11 * ids, 1, 0.8),
            ]

        qkv_n = nh * d + 2 * nkv * d
        out = {
            "gemm": [
                ops.GEMM(f"{p}_qkv_gemm", 1, qkv_n, h, gq),
                ops.GEMM(f"{p}_proj_gemm", 1, h, nh * d, gq, low_precision_input=True),
                ops.GEMM(f"{p}_gate_ffn1_gemm", 1, 2 * inter, h, gq),
                ops.GEMM(f"{p}_ffn2_gemm", 1, h, inter, gq, low_precision_input=True),
            ],
            "attention": [attention("attention")],
            "elementwise": [
                ops.ElementWise(f"{p}_add_norm_1", 1, 2 * h, 2 * h, 0.8),
                ops.ElementWise(f"{p}_add_norm_2", 1, 2 * h, 2 * h, 0.8),
                ops.ElementWise(f"{p}_act_gate", 1, 2 * inter, inter, 0.8),
            ],
            "allreduce": ar("ar_1") + ar("ar_2"),
            "embedding": [ops.Embedding(f"{p}_embedding", 1, vocab, h, 0.3)] + ar("embedding_ar"),
            "lm_head": [
                ops.ElementWise(f"{p}_final_norm", 1, h, h, 0.8),
                ops.GEMM(f"{p}_logits_gemm", 1, vocab, h, gq),
            ]
            + logits_gather("logits_gather"),
            # ElementWise moves 2 * (dim_in + dim_out) bytes per row
            "sampling": [ops.ElementWise(f"{p}_sampling", 1, 6 * m.vocab_size, 1, 0.8)],
            "draft_head": [
                ops.ElementWise(f"{p}_draft_norm", 1, h, h, 0.8),
                ops.GEMM(f"{p}_draft_fc", 1, h, h, gq),
                ops.ElementWise(f"{p}_draft_attn_norm", 1, h, h, 0.8),
                ops.GEMM(f"{p}_draft_qkv_gemm", 1, qkv_n, h, gq),
                attention("draft_attention"),
                ops.GEMM(f"{p}_draft_proj_gemm", 1, h, nh * d, gq, low_precision_input=True),
                *ar("draft_ar"),
                ops.ElementWise(f"{p}_draft_final_norm", 1, 2 * h, h, 0.8),
                *draft_logits(),
            ],
            "length_predictor": [
                ops.GEMM(f"{p}_lp_fc1", 1, LENGTH_PREDICTOR_HIDDEN, h, gq),
                ops.GEMM(f"{p}_lp_fc2", 1, LENGTH_PREDICTOR_HIDDEN, LENGTH_PREDICTOR_HIDDEN, gq),
                ops.GEMM(f"{p}_lp_fc3", 1, 8, LENGTH_PREDICTOR_HIDDEN, gq),
            ],
        }
        if phase == "prefill":
            # prefill computes logits (and drafts) for the last token of each request only
            for c in ("lm_head", "sampling", "draft_head", "length_predictor"):
                out.pop(c)
        return {c: v for c, v in out.items() if v}

    def _ops_json(self, op_list: list) -> str:
        from aiconfigurator_core.sdk.engine import _resolve_attention_lane_orders, build_ops_json

        _resolve_attention_lane_orders(op_list, self.db, self.attention_backend)
        return build_ops_json(op_list)

    def evaluate_ms(self, ops_json: str, phase: str, batch: int, s: int) -> float:
        vals = self.handle.evaluate_ops_json(
            ops_json, is_context=phase == "prefill", batch_size=int(batch), s=int(s)
        )
        return float(sum(v[1] for v in vals))

    def _mem_frac(self, ops_json: str, phase: str, batch: int, s: int) -> float:
        try:
            vals = self.handle.evaluate_ops_sol_json(
                ops_json, is_context=phase == "prefill", batch_size=int(batch), s=int(s)
            )
        except Exception:  # families without a SOL decomposition: call them half and half
            return 0.5
        # per operator: memory-bound weight mem^2 / (mem^2 + math^2) of its roofline times,
        # averaged with the operators' speed-of-light times as weights
        num = den = 0.0
        for _, sol, math_ms, mem_ms in vals:
            a, b = max(math_ms, 0.0) ** 2, max(mem_ms, 0.0) ** 2
            if a + b <= 0 or sol <= 0:
                continue
            num += sol * b / (a + b)
            den += sol
        return float(num / den) if den > 0 else 0.5

    # -- tables ----------------------------------------------------------------------------
    def _grid(self, op_list: list, phase: str, rows: Sequence[int], ctx: Sequence[int]) -> CostGrid:
        js = self._ops_json(op_list)
        sec = np.zeros((len(rows), len(ctx)))
        for i, n in enumerate(rows):
            for j, c in enumerate(ctx):
                if phase == "prefill":
                    # n prompt tokens in the batch, c tokens per request
                    batch = max(1, int(round(n / c)))
                    sec[i, j] = 1e-3 * self.evaluate_ms(js, phase, batch, min(c, n))
                else:
                    sec[i, j] = 1e-3 * self.evaluate_ms(js, phase, n, c)
        if phase == "prefill":
            mf = [self._mem_frac(js, phase, 1, min(n, 2048)) for n in rows]
        else:
            mf = [self._mem_frac(js, phase, n, 512) for n in rows]
        # the tables are noisy at small batches (a GEMM at m=1 may time slower than at m=8):
        # a batch is never slower than a larger one, so take the running minimum from above
        sec = np.minimum.accumulate(sec[::-1], axis=0)[::-1]
        return CostGrid(rows, ctx, sec, mf)

    def _component_grid(self, m: ModelShape, comp: str, op_list, phase, rows, ctx) -> CostGrid:
        try:
            return self._grid(op_list, phase, rows, ctx)
        except Exception as e:  # the engine raises PerfDataNotAvailableError for holes
            if type(e).__name__ != "PerfDataNotAvailableError":
                raise
            raise ValueError(
                f"AIConfigurator's {self.system} {self.backend} tables cannot price the "
                f"{phase} {comp} of {m.name} (heads {m.num_heads}/{m.num_kv_heads}, head_dim "
                f"{m.head_dim}): {str(e).splitlines()[0][:300]}"
            ) from None

    def stage_costs(
        self,
        m: ModelShape,
        tp: int = 1,
        rows: Sequence[int] = DECODE_ROWS,
        ctx: Sequence[int] = DECODE_CTX,
        prefill_tokens: Sequence[int] = PREFILL_TOKENS,
        prefill_ctx: Sequence[int] = PREFILL_CTX,
    ) -> StageCosts:
        """Per-component decode and prefill tables of ``m`` at TP ``tp`` on this system."""
        decode = {
            c: self._component_grid(m, c, v, "decode", rows, ctx)
            for c, v in self.component_ops(m, tp, "decode").items()
        }
        prefill = {
            c: self._component_grid(m, c, v, "prefill", prefill_tokens, prefill_ctx)
            for c, v in self.component_ops(m, tp, "prefill").items()
        }
        return StageCosts(
            model=m.name,
            num_layers=m.num_layers,
            hidden_size=m.hidden_size,
            tp=tp,
            decode=decode,
            prefill=prefill,
            source=(
                f"AIConfigurator {AIC_VERSION} tables, system {self.system}, "
                f"{self.backend} {self.version}, attention {self.attention_backend}"
            ),
        )

    # -- node model ------------------------------------------------------------------------
    def link(self) -> LinkSpec:
        """Stage-to-stage transfer over the node's NVLink (AIConfigurator's node model)."""
        node = self.spec["node"]
        return LinkSpec(
            latency_s=float(node["p2p_latency"]),
            bandwidth_Bps=float(node["intra_node_bw"]),
            name=f"{self.system} intra-node",
        )

    @property
    def gpu_memory_bytes(self) -> float:
        return float(self.spec["gpu"]["mem_capacity"])

    @property
    def gpus_per_node(self) -> int:
        return int(self.spec["node"]["num_gpus_per_node"])

    def describe(self) -> dict:
        return {
            "system": self.system,
            "backend": self.backend,
            "database_version": self.version,
            "attention_backend": self.attention_backend,
            "aiconfigurator_core": AIC_VERSION,
        }


def aic_static_prediction(
    model: str, system: str, mode: str, gpus: int, batch: int, isl: int = 128, osl: int = 128
) -> dict:
    """AIConfigurator's own ``estimate --estimate-mode static_gen`` for stock TP or PP.

    Returned in our convention: ``batch`` is the number of requests decoding at once. Its PP
    figure at batch ``b`` is ``pp * b / TPOT`` with TPOT the time of all layers at ``b``: it
    counts ``b`` per micro-batch. So our PP with ``B`` requests is its PP at ``b = B / pp``.
    """
    _require_aic()
    from aiconfigurator_core.sdk.engine import EngineHandle

    tp, pp = (gpus, 1) if mode == "tp" else (1, gpus)
    b = batch if mode == "tp" else max(1, batch // pp)
    h = EngineHandle.compile(
        model, system, "sglang", backend_version="current", tp_size=tp, pp_size=pp
    )
    _, gen_ms, _ = h.run_static(batch_size=b, isl=isl, osl=osl, mode="static_gen")
    tpot = gen_ms / (osl - 1) / 1e3
    return {
        "mode": mode,
        "gpus": gpus,
        "batch": batch,
        "aic_batch_arg": b,
        "tpot_s": tpot,
        "tok_s": pp * b / tpot,
    }
