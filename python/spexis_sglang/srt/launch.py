"""The launcher behind ``python -m spexis_sglang.launch_server``: SGLang's server with Spexis'
scheduler hooks.

Accepts every SGLang server argument. Without ``--model-path`` it serves the bundled default
model (converted on first use) under the name ``smollm2-135m-instruct``. On a machine without
CUDA it turns on SGLang's CPU engine and picks defaults that work there (CPU device,
torch-native attention, PyTorch sampling, no CUDA graphs, a bounded KV pool, sleeping when
idle); any of them can be overridden on the command line. Every server it starts bounds what
one request may ask (``--spexis-max-n``, ``--spexis-max-request-sequences``) and how many
requests may wait (``--max-queued-requests``, default 1024), and answers an unknown model name
with 404 (see ``docs/limits-and-errors.md``). :func:`draft_head_main` is
``python -m spexis_sglang.draft_head_server``'s. The flags are :mod:`.launch_flags`'s; the
``--spexis-*`` values become a checked configuration in :mod:`.launch_config`.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from typing import List, Optional

from spexis_sglang.srt.launch_config import is_default_model, spexis_config_from_args
from spexis_sglang.srt.launch_flags import (
    CPU_DEFAULTS,
    GRAPH_OFF_FLAGS,
    GRAPH_SIZE_FLAGS,
    MODEL_FLAGS,
    PROG,
    SERVER_DEFAULTS,
    LaunchError,
    add_spexis_args,
    build_parser,
    check_model_path,
    flag_value,
    has_flag,
)

logger = logging.getLogger(__name__)

# SP decode graphs are captured up to pp_size x SGLang's default, at most this many rows
SP_GRAPH_MAX_BS_CAP = 1024


def prepare_argv(argv: List[str], on_cpu: bool) -> List[str]:
    """Fill in the model path (the bundled model's under its clean name), the defaults every
    server gets and, on CPU, the defaults SGLang needs there."""
    argv = list(argv)
    has_model, model = flag_value(argv, MODEL_FLAGS)
    if has_model:
        check_model_path(model)
    else:
        from spexis_sglang.default_model import ensure_default_model

        model = ensure_default_model()
        argv = ["--model-path", model] + argv
    if is_default_model(model) and not has_flag(argv, "--served-model-name"):
        from spexis_sglang.default_model import SERVED_MODEL_NAME

        # not the cache directory: /v1/models and every response name the model
        argv += ["--served-model-name", SERVED_MODEL_NAME]
    for flag, value in SERVER_DEFAULTS:
        if not has_flag(argv, flag):
            argv += [flag] if value is None else [flag, value]
    if on_cpu:
        graphs_set = any(has_flag(argv, f) for f in GRAPH_OFF_FLAGS)
        for flag, value in CPU_DEFAULTS:
            if flag in GRAPH_OFF_FLAGS and graphs_set:
                continue
            if not has_flag(argv, flag):
                argv += [flag] if value is None else [flag, value]
    return argv


def prepare_server_args(argv: List[str]):
    """Parse a full command line into SGLang's ``ServerArgs`` and our ``SpexisConfig``."""
    from sglang.srt.server_args import prepare_server_args as sglang_prepare_server_args

    spexis_parser = argparse.ArgumentParser(prog=PROG, add_help=False)
    add_spexis_args(spexis_parser)
    spexis_args, rest = spexis_parser.parse_known_args(argv)
    server_args = sglang_prepare_server_args(rest)
    config = spexis_config_from_args(spexis_args, server_args)
    graph_bs = sp_graph_max_bs(rest, server_args, config)
    if graph_bs is not None:
        server_args = sglang_prepare_server_args(
            rest + ["--cuda-graph-max-bs-decode", str(graph_bs)]
        )
    if config.float64:
        from spexis_sglang.srt.hooks import FLOAT64_DTYPE

        # SGLang's --dtype choices stop at float32; every process registers the name (hooks)
        server_args.override("spexis --spexis-float64", dtype=FLOAT64_DTYPE)
    return server_args, config


def sp_graph_max_bs(argv: List[str], server_args, config) -> Optional[int]:
    """The decode CUDA-graph limit SP needs, where the user did not size the graphs.

    A stock PP step runs B/N of the running requests, SP runs all B of them every iteration:
    SGLang's default limit (256 on an H200 with TP < 4) would send SP's larger batches to eager
    execution. None: leave SGLang's sizing (no SP, no graphs, or the user chose).
    """
    graphs = server_args.cuda_graph_config.decode
    if not config.enabled or server_args.device == "cpu" or graphs.backend == "disabled":
        return None
    if any(has_flag(argv, flag) for flag in GRAPH_SIZE_FLAGS) or not graphs.max_bs:
        return None
    limit = min(SP_GRAPH_MAX_BS_CAP, graphs.max_bs * server_args.pp_size)
    if server_args.max_running_requests:
        limit = min(limit, server_args.max_running_requests)
    return limit if limit > graphs.max_bs else None


def install_http_guard(config) -> None:
    """Request limits, scrubbed errors and model-name checks on SGLang's HTTP app."""
    from sglang.srt.entrypoints import http_server

    from spexis_sglang.srt import http_guard
    from spexis_sglang.srt.request_checks import accepted_model_names
    from spexis_sglang.srt.tokenizer_manager import request_limits

    def accepted_models():
        if config.accept_any_model:
            return None
        manager = http_server.get_global_state().tokenizer_manager
        # read per request: SGLang renames the served model when it loads new weights
        return accepted_model_names(manager.served_model_name, manager.server_args.model_path)

    http_guard.install(http_server.app, request_limits, accepted_models)


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    on_cpu = _activate()
    if "-h" in argv or "--help" in argv:
        build_parser().print_help()
        return 0
    try:
        argv = prepare_argv(argv, on_cpu)
    except Exception as e:  # a LaunchError, or the default model could not be built
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    try:
        server_args, spexis_config = prepare_server_args(argv)
    except LaunchError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    spexis_config.to_env()  # inherited by every scheduler process
    logger.info(
        "spexis launch: %s",
        json.dumps({"cpu": on_cpu, "argv": argv, "spexis": spexis_config.__dict__}),
    )

    from spexis_sglang.srt.hooks import install, run_spexis_scheduler_process
    from spexis_sglang.srt.tokenizer_manager import init_spexis_tokenizer_manager

    install()
    install_http_guard(spexis_config)
    return _serve(
        server_args,
        on_cpu,
        # refuses out-of-vocabulary token ids with a 400 before they reach a scheduler
        init_tokenizer_manager_func=init_spexis_tokenizer_manager,
        run_scheduler_process_func=run_spexis_scheduler_process,
    )


def _activate() -> bool:
    """The CPU support, before any sglang/transformers import; on a CPU, torch with one
    intra-op thread (the stages share the cores, the schedulers are forked). True on a CPU."""
    from spexis_sglang.cpu_support import activate, single_threaded_torch

    on_cpu = activate()
    if on_cpu:
        single_threaded_torch()
    return on_cpu


def _serve(server_args, on_cpu: bool, **process_funcs) -> int:
    """SGLang's HTTP server with our process functions; its child processes end with it. On a
    CPU they fork from this process; with ``SPEXIS_TOKENIZER_CACHE`` they unpickle their
    tokenizer (``srt/tokenizer_cache.py``)."""
    from sglang.srt.entrypoints.http_server import launch_server
    from sglang.srt.utils import kill_process_tree

    from spexis_sglang.srt.hooks import fork_subprocesses_on_cpu
    from spexis_sglang.srt.tokenizer_cache import install_tokenizer_cache

    install_tokenizer_cache()
    if on_cpu:
        fork_subprocesses_on_cpu()
    try:
        launch_server(server_args, **process_funcs)
    finally:
        kill_process_tree(os.getpid(), include_parent=False)
    return 0


DRAFT_HEAD_PROG = "python -m spexis_sglang.draft_head_server"


def draft_head_main(argv: Optional[List[str]] = None) -> int:
    """Stock SGLang scheduling with the draft head on stage 0 (``srt/draft_runner.py``)."""
    from spexis_sglang.srt.config import ENV_DRAFT_HEAD

    argv = sys.argv[1:] if argv is None else list(argv)
    on_cpu = _activate()
    if not os.environ.get(ENV_DRAFT_HEAD):
        print(
            f"{DRAFT_HEAD_PROG}: error: set {ENV_DRAFT_HEAD} (artifact dir or random:<seed>)",
            file=sys.stderr,
        )
        return 2
    try:
        argv = prepare_argv(argv, on_cpu)
    except Exception as e:
        print(f"{DRAFT_HEAD_PROG}: error: {e}", file=sys.stderr)
        return 2
    from sglang.srt.server_args import prepare_server_args as sglang_prepare_server_args

    from spexis_sglang.srt.draft_runner import run_draft_head_scheduler_process

    server_args = sglang_prepare_server_args(argv)
    return _serve(server_args, on_cpu, run_scheduler_process_func=run_draft_head_scheduler_process)
