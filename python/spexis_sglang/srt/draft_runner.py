"""Stage 0's KV pool grows by the draft head's layers (docs/design.md §4).

:class:`SpexisModelRunner` gives stage 0's ``MHATokenToKVPool`` ``K`` more layers (ids
``end_layer .. end_layer+K-1``) for the draft head's attention, before SGLang sizes the pool.
The per-token cell grows by ``(L0+K)/L0`` on stage 0, so stage 0 profiles fewer tokens; the PP
MIN all-reduce of the token capacity (``KVCacheConfigurator._apply_token_constraints``) then makes
every rank adopt stage 0's ``max_total_num_tokens``, which keeps token slots mirrored across ranks.

Use from a scheduler process, in this order, before the model is loaded:

1. :func:`spexis_sglang.srt.model_registry.install_model_classes`;
2. build the TP worker with :func:`spexis_tp_worker_class` (in ``Scheduler.init_tp_model_worker``)
   or, with the stock scheduler, call :func:`install_worker_class`.

``python -m spexis_sglang.draft_head_server [sglang args]`` serves stock SGLang scheduling with
the draft head on stage 0 (:func:`run_draft_head_scheduler_process`; drafts are computed and
travel downstream, nobody consumes them): a baseline for the head's cost, and the test bed for
the head itself.
"""

from __future__ import annotations

import logging

from sglang.srt.managers.tp_worker import TpModelWorker
from sglang.srt.model_executor.model_runner import ModelRunner
from sglang.srt.model_executor.model_runner_components.layer_setup import (
    ModelLayerInfo,
)
from sglang.srt.runtime_context import get_schedule

from spexis_sglang.srt.draft_artifact import DraftHeadError
from spexis_sglang.srt.draft_model import draft_num_layers
from spexis_sglang.srt.model_registry import install_model_classes

logger = logging.getLogger(__name__)


class SpexisModelRunner(ModelRunner):
    """A ``ModelRunner`` whose KV pool has room for the draft head's layers on stage 0."""

    def alloc_memory_pool(self, memory_pool_config=None):
        k = draft_num_layers(self.model)
        li = self.layer_info
        if k > 0 and li.end_layer == int(self.model.end_layer):  # not grown yet
            if self.use_mla_backend or self.is_hybrid_swa:
                raise DraftHeadError(
                    "the Spexis draft head needs a plain MHA KV pool on stage 0 "
                    "(MLA and hybrid sliding-window pools are not supported)"
                )
            self.layer_info = ModelLayerInfo(
                start_layer=li.start_layer,
                end_layer=li.end_layer + k,
                num_effective_layers=li.num_effective_layers + k,
            )
            logger.info(
                "spexis: stage-0 KV pool holds %d base + %d draft-head layer(s), ids [%d, %d)",
                li.num_effective_layers,
                k,
                li.start_layer,
                li.end_layer + k,
            )
        super().alloc_memory_pool(memory_pool_config)


class SpexisTpModelWorker(TpModelWorker):
    """``TpModelWorker`` that builds a :class:`SpexisModelRunner` (mirrors the parent exactly)."""

    def _init_model_runner(self):
        self._model_runner = SpexisModelRunner(
            model_config=self.model_config,
            mem_fraction_static=get_schedule().mem_fraction_static,
            gpu_id=self.gpu_id,
            ps=self.ps,
            nccl_port=self.nccl_port,
            server_args=self.server_args,
            is_draft_worker=self.is_draft_worker,
            req_to_token_pool=self.req_to_token_pool,
            token_to_kv_pool_allocator=self.token_to_kv_pool_allocator,
            memory_pool_config=self.memory_pool_config,
            draft_model_idx=0 if self.is_multi_layer_eagle else None,
        )


def spexis_tp_worker_class() -> type:
    """The TP worker class a Spexis scheduler builds in ``init_tp_model_worker``."""
    return SpexisTpModelWorker


def install_worker_class() -> None:
    """Make the *stock* ``Scheduler.init_tp_model_worker`` build :class:`SpexisTpModelWorker`.

    It imports ``TpModelWorker`` from ``sglang.srt.managers.tp_worker`` at call time, so
    rebinding the module attribute is enough (only this process is affected).
    """
    import sglang.srt.managers.tp_worker as tp_worker

    tp_worker.TpModelWorker = SpexisTpModelWorker


def run_draft_head_scheduler_process(*args, **kwargs):
    """SGLang's ``run_scheduler_process`` with the draft head installed (stock scheduling)."""
    from spexis_sglang.cpu_support import install_startup_hooks

    install_startup_hooks()
    install_model_classes()
    install_worker_class()
    from sglang.srt.managers import scheduler

    return scheduler.run_scheduler_process(*args, **kwargs)
