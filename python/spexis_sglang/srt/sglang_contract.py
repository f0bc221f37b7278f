"""Every SGLang 0.5.17 internal that Spexis overrides, calls, reads or rebinds, in one table.

Spexis extends SGLang through its own extension points (a ``Scheduler`` subclass, the model
registry, the launcher's process function) but also through names SGLang does not promise to
keep: underscore methods of its scheduler's PP mixin, module attributes it looks up at call
time, attributes its scheduler sets in ``__init__``. Moving to another SGLang release means
checking exactly these. ``tests/srt/test_sglang_contract.py`` checks every entry against the
installed SGLang, so an upgrade that renames, drops or re-signs one fails with the entry's
name and where Spexis uses it, instead of breaking a server at run time.

Each entry: the module, the dotted name in it, what Spexis does with it, the parameter names
it relies on (for a callable; ``None``: not checked), and the Spexis modules that use it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

__all__ = ["Internal", "INTERNALS", "SCHEDULER_STATE"]

SCHEDULER = "sglang.srt.managers.scheduler"


@dataclass(frozen=True)
class Internal:
    module: str
    name: str  # dotted: "Scheduler._pp_launch_batch"
    use: str  # "override", "call", "rebind", "read"
    params: Optional[Tuple[str, ...]]  # parameter names after self, in order
    where: str


INTERNALS: Tuple[Internal, ...] = (
    # -- the scheduler: methods SpexisScheduler overrides (same parameters as SGLang's)
    Internal(SCHEDULER, "Scheduler.init_tp_model_worker", "override", (), "sp_scheduler"),
    Internal(
        SCHEDULER, "Scheduler.get_num_allocatable_reqs", "override", ("running_bs",), "sp_scheduler"
    ),
    Internal(SCHEDULER, "Scheduler.event_loop_pp", "override", (), "sp_scheduler"),
    Internal(
        SCHEDULER,
        "Scheduler._pp_send_dict_to_next_stage",
        "override",
        ("tensor_dict", "async_send", "msg_type"),
        "sp_scheduler (same-GPU link), sp_loop",
    ),
    Internal(
        SCHEDULER,
        "Scheduler._pp_recv_typed_dict",
        "override",
        ("expected_kind", "all_gather_group"),
        "sp_scheduler (same-GPU link)",
    ),
    Internal(
        SCHEDULER,
        "Scheduler._pp_prepare_tensor_dict",
        "override",
        ("result", "batch"),
        "sp_scheduler",
    ),
    Internal(
        SCHEDULER, "Scheduler.run_batch", "override", ("batch", "pp_proxy_tensors"), "sp_scheduler"
    ),
    Internal(
        SCHEDULER,
        "Scheduler._add_request_to_queue",
        "override",
        ("req", "is_retracted"),
        "sp_scheduler (request checks)",
    ),
    Internal(SCHEDULER, "Scheduler.abort_request", "override", ("recv_req",), "sp_scheduler"),
    Internal(SCHEDULER, "Scheduler.get_internal_state", "override", ("recv_req",), "sp_scheduler"),
    # -- the scheduler: methods the SP loop calls
    Internal(SCHEDULER, "Scheduler.init_pp_loop_state", "call", (), "sp_setup"),
    Internal(SCHEDULER, "Scheduler.process_input_requests", "call", ("recv_reqs",), "sp_loop"),
    Internal(SCHEDULER, "Scheduler.is_fully_idle", "call", ("for_health_check",), "sp_loop"),
    Internal(SCHEDULER, "Scheduler.get_new_batch_prefill", "call", None, "sp_batch"),
    Internal(SCHEDULER, "Scheduler.process_pending_chunked_abort", "call", (), "sp_batch"),
    Internal(SCHEDULER, "Scheduler._abort_on_waiting_timeout", "call", (), "sp_batch"),
    Internal(SCHEDULER, "Scheduler.stash_chunked_request", "call", ("req",), "sp_batch"),
    Internal(SCHEDULER, "Scheduler.process_batch_result", "call", None, "sp_verify"),
    Internal(SCHEDULER, "Scheduler.on_idle", "call", (), "sp_loop"),
    Internal(SCHEDULER, "Scheduler._pp_recv_proxy_tensors", "call", (), "sp_loop"),
    Internal(SCHEDULER, "Scheduler._pp_recv_dict_from_prev_stage", "call", (), "sp_loop"),
    Internal(SCHEDULER, "Scheduler._pp_commit_comm_work", "call", ("work",), "sp_loop"),
    Internal(
        SCHEDULER,
        "Scheduler._pp_launch_batch",
        "call",
        ("mb_id", "cur_batch", "pp_proxy_tensors", "mb_metadata", "last_rank_comm_queue"),
        "sp_loop",
    ),
    Internal(
        SCHEDULER,
        "Scheduler._pp_prep_batch_result",
        "call",
        ("batch", "mb_metadata", "pp_outputs"),
        "sp_loop",
    ),
    Internal(
        SCHEDULER,
        "Scheduler._pp_send_pyobj_to_next_stage",
        "call",
        ("data", "async_send"),
        "sp_loop",
    ),
    # -- the scheduler: methods stats.StockPPPhaseTimers wraps on the instance
    Internal(SCHEDULER, "Scheduler.get_next_batch_to_run", "rebind", None, "stats"),
    Internal(
        SCHEDULER,
        "Scheduler._pp_commit_send_output_work_and_preprocess_output_tensors",
        "rebind",
        ("next_first_rank_mb_id", "next_mb_id"),
        "stats",
    ),
    Internal(SCHEDULER, "Scheduler._pp_process_batch_result", "rebind", None, "stats"),
    # -- module attributes looked up at call time (rebound by hooks)
    Internal(SCHEDULER, "Scheduler", "rebind", None, "hooks (the scheduler class)"),
    Internal(SCHEDULER, "PrefillAdder", "rebind", None, "hooks (look-ahead admission)"),
    Internal(SCHEDULER, "run_scheduler_process", "call", None, "hooks"),
    Internal(
        "sglang.srt.managers.schedule_policy",
        "PrefillAdder.add_one_req",
        "override",
        ("req", "has_chunked_req", "truncation_align_size"),
        "prefill_adder",
    ),
    Internal(
        "sglang.srt.managers.schedule_policy",
        "PrefillAdder.rem_total_tokens",
        "override",
        None,
        "prefill_adder",
    ),
    Internal(
        "sglang.srt.managers.schedule_policy",
        "PrefillAdder.__init__",
        "override",
        (
            "page_size",
            "tree_cache",
            "token_to_kv_pool_allocator",
            "running_batch",
            "new_token_ratio",
            "rem_input_tokens",
            "rem_chunk_tokens",
            "num_mixed_decode_tokens",
        ),
        "prefill_adder (the chunk's share of mixed SP rows)",
    ),
    Internal(
        "sglang.srt.sampling.sampling_batch_info",
        "SamplingBatchInfo.update_regex_vocab_mask",
        "override",
        (),
        "sp_sampling (SP rows' own grammar masks)",
    ),
    # -- ScheduleBatch fields a mixed batch sets or hands over (sp_mixed)
    *(
        Internal(
            "sglang.srt.managers.schedule_batch", f"ScheduleBatch.{field}", "read", None, "sp_mixed"
        )
        for field in (
            "prefill_input_ids_cpu",
            "mix_running_indices",
            "decoding_reqs",
            "launch_ts",
            "forward_iter",
            "prefix_lens",
            "extend_lens",
            "extend_num_tokens",
            "extend_logprob_start_lens",
        )
    ),
    Internal(
        "sglang.srt.sampling.sampling_batch_info",
        "SamplingBatchInfo.from_schedule_batch",
        "call",
        ("batch", "vocab_size"),
        "sp_sampling, sp_mixed",
    ),
    Internal(
        "sglang.srt.entrypoints.engine",
        "_set_envs_and_config",
        "rebind",
        ("server_args",),
        "hooks (forked schedulers on CPU)",
    ),
    Internal(
        "sglang.srt.mem_cache.allocator.paged",
        "alloc_extend_kernel",
        "rebind",
        None,
        "hooks (CPU paged KV)",
    ),
    Internal(
        "sglang.srt.mem_cache.allocator.paged",
        "alloc_decode_kernel",
        "rebind",
        None,
        "hooks (CPU paged KV)",
    ),
    Internal(
        "sglang.srt.configs.model_config",
        "_STR_DTYPE_TO_TORCH_DTYPE",
        "rebind",
        None,
        "hooks (--spexis-float64)",
    ),
    Internal("sglang.srt.models.registry", "ModelRegistry", "rebind", None, "model_registry"),
    # -- workers, model runner, receiver, tokenizer manager
    Internal(
        "sglang.srt.managers.tp_worker",
        "TpModelWorker._init_model_runner",
        "override",
        (),
        "draft_runner",
    ),
    Internal(
        "sglang.srt.model_executor.model_runner",
        "ModelRunner.alloc_memory_pool",
        "override",
        ("memory_pool_config",),
        "draft_runner",
    ),
    Internal(
        "sglang.srt.managers.scheduler_components.request_receiver",
        "SchedulerRequestReceiver._pull_raw_reqs",
        "override",
        (),
        "relay",
    ),
    Internal(
        "sglang.srt.managers.tokenizer_manager",
        "TokenizerManager._validate_one_request",
        "override",
        ("obj", "input_ids"),
        "tokenizer_manager",
    ),
    Internal(
        "sglang.srt.managers.tokenizer_manager",
        "TokenizerManager.generate_request",
        "override",
        ("obj", "request"),
        "tokenizer_manager",
    ),
)

#: attributes SGLang's ``Scheduler`` sets on itself that the SP loop reads or replaces
SCHEDULER_STATE: Tuple[str, ...] = (
    "pp_loop_size",
    "mbs",
    "last_mbs",
    "running_mbs",
    "mb_metadata",
    "last_rank_comm_queue",
    "send_proxy_work",
    "send_output_work",
    "send_req_work",
    "launch_event",
    "_pp_tensor_dict_inbox",
    "running_batch",
    "cur_batch_for_debug",
    "chunked_req",
    "is_mixed_chunk",
    "waiting_queue",
    "max_running_requests",
    "request_receiver",
    "new_token_ratio_tracker",
    "output_streamer",
    "metrics_reporter",
    "tree_cache",
    "token_to_kv_pool_allocator",
    "req_to_token_pool",
    "copy_stream",
    "copy_stream_ctx",
    "forward_stream_ctx",
    "forward_stream",
    "enable_overlap",
    "schedule_stream",
    "device_module",
    "pp_group",
    "world_group",
    "tp_worker",
)
