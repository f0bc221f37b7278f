"""Hooks installed in every SGLang scheduler process.

SGLang's launcher spawns one scheduler process per (PP rank, TP rank) with
``run_scheduler_process_func``; we pass :func:`run_spexis_scheduler_process`, which installs
our hooks in that fresh process and then runs SGLang's own ``run_scheduler_process``.
It is a module-level function so that ``spawn`` pickles it by reference.

What is installed (SGLang's own extension points, no patches):

* ``sglang.srt.managers.scheduler.Scheduler`` -> :class:`SpexisScheduler` (``run_scheduler_process``
  looks the class up at call time);
* ``sglang.srt.managers.scheduler.PrefillAdder`` -> :class:`~.prefill_adder.SpexisPrefillAdder`
  under ``--spexis-lookahead-admission`` (``_get_new_batch_prefill_raw`` looks it up at call
  time; it is SGLang's adder unless the scheduler admits by the gate's count);
* with a draft head configured, the Spexis model classes in SGLang's ``ModelRegistry``
  (the stage-0 model runs the draft head inside its forward);
* on CPU, torch stand-ins for the paged KV allocator's two triton kernels
  (``cpu_support/paged_kernels.py``), so that ``--page-size > 1`` serves here at all.

In the launcher's process on CPU, :func:`fork_subprocesses_on_cpu` has SGLang's subprocesses
fork from it instead of spawning fresh interpreters.

In the HTTP server's process, ``launch_server`` passes SGLang's ``init_tokenizer_manager_func``
the :class:`spexis_sglang.srt.tokenizer_manager.SpexisTokenizerManager` (token ids outside the
vocabulary answer 400 instead of crashing stage 0).
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

_installed = False

# ServerArgs.dtype under --spexis-float64 (SGLang's own names stop at float32)
FLOAT64_DTYPE = "float64"


def install() -> None:
    """Install Spexis' hooks into the SGLang modules of this process (idempotent)."""
    global _installed
    if _installed:
        return
    from sglang.srt.managers import scheduler as scheduler_module

    from spexis_sglang.cpu_support import cuda_available
    from spexis_sglang.cpu_support.quiet import install_log_filters
    from spexis_sglang.srt.config import get_config
    from spexis_sglang.srt.sp_scheduler import SpexisScheduler

    # SGLang's expected start-up lines that read as errors (quiet.py)
    install_log_filters(cpu=not cuda_available())
    scheduler_module.Scheduler = SpexisScheduler
    if not cuda_available():
        install_cpu_paged_kernels()
    if get_config().float64:
        register_float64_dtype()
    if get_config().lookahead_admission:
        from spexis_sglang.srt.prefill_adder import SpexisPrefillAdder

        scheduler_module.PrefillAdder = SpexisPrefillAdder
    if get_config().enabled:
        from spexis_sglang.srt.model_registry import install_model_classes

        install_model_classes()
    _installed = True
    logger.debug("spexis hooks installed")


def fork_subprocesses_on_cpu() -> None:
    """SGLang's schedulers and detokenizer fork from the launcher instead of spawning (CPU only).

    SGLang sets the ``spawn`` start method (CUDA cannot be forked): each child then imports
    torch, transformers and SGLang afresh, ~6 s of CPU per process, most of a server's start on
    a small CPU machine. Without CUDA the launcher, which has imported all of it already, can
    fork: a PP=2 server starts with about half the CPU (21.7 s instead of 39-44 s). The launcher
    holds no ZMQ socket, tokenizer or thread pool yet when SGLang starts its children.
    """
    import multiprocessing as mp

    from sglang.srt.entrypoints import engine

    set_envs_and_config = engine._set_envs_and_config

    def set_envs_and_config_then_fork(server_args):
        set_envs_and_config(server_args)
        mp.set_start_method("fork", force=True)

    engine._set_envs_and_config = set_envs_and_config_then_fork


def register_float64_dtype() -> None:
    """Teach SGLang's model config the ``float64`` dtype name (``--spexis-float64``)."""
    import torch
    from sglang.srt.configs import model_config

    model_config._STR_DTYPE_TO_TORCH_DTYPE[FLOAT64_DTYPE] = torch.float64


def install_cpu_paged_kernels() -> None:
    """SGLang's paged KV allocator with torch stand-ins for its triton kernels (CPU only)."""
    from sglang.srt.mem_cache.allocator import paged

    from spexis_sglang.cpu_support.paged_kernels import TorchKernel, alloc_decode, alloc_extend

    paged.alloc_extend_kernel = TorchKernel(alloc_extend)
    paged.alloc_decode_kernel = TorchKernel(alloc_decode)


# positions of run_scheduler_process's arguments, as SGLang's launcher passes them
_SERVER_ARGS_ARG, _GPU_ID_ARG, _TP_RANK_ARG, _PP_RANK_ARG = 0, 2, 3, 7


def share_one_gpu(args: tuple, num_gpus: int, mode: str = "1") -> tuple:
    """``SPEXIS_SHARE_GPU``: the scheduler arguments with every rank on a GPU that exists.

    SGLang gives PP rank ``p`` GPU ``p`` (more with TP), and NCCL refuses two ranks on one GPU
    ("Duplicate GPU detected") when they share a host id. Each rank gets its own
    ``NCCL_HOSTID``, so NCCL takes the ranks for different hosts and sends over loopback
    sockets.

    ``mode`` ``"mps"``: an emulated multi-GPU box. Under an NVIDIA MPS daemon (the GPU scripts
    start it) every rank is a client with ``100 / ranks`` percent of the SMs
    (``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE``, read when the process creates its CUDA context),
    and the ranks' kernels run at once; the ranks still share the GPU's memory bandwidth and
    NCCL still goes over sockets, which real GPUs do not. ``"1"``: plain sharing, for tests of
    correctness only (without MPS the ranks' kernels only take turns: their timings say
    nothing about several GPUs).
    """
    import os

    if num_gpus < 1:
        raise RuntimeError("SPEXIS_SHARE_GPU needs a CUDA GPU")
    args = list(args)
    tp_rank, pp_rank = args[_TP_RANK_ARG], args[_PP_RANK_ARG]
    args[_GPU_ID_ARG] = args[_GPU_ID_ARG] % num_gpus
    os.environ["NCCL_HOSTID"] = f"spexis-shared-gpu-pp{pp_rank}-tp{tp_rank}"
    os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
    os.environ.setdefault("NCCL_IB_DISABLE", "1")
    os.environ.setdefault("NCCL_MNNVL_ENABLE", "0")
    # gloo (SGLang's CPU group: every PP tensor message's metadata) on the loopback interface
    # too: by default it takes the host name's interface, which on the GPU machines made a
    # small message cost ~0.8 ms
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    if mode == "mps":
        server_args = args[_SERVER_ARGS_ARG]
        ranks = max(1, int(server_args.pp_size) * int(server_args.tp_size))
        ranks = -(-ranks // num_gpus)  # ranks per GPU
        os.environ.setdefault("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", str(max(1, 100 // ranks)))
    return tuple(args)


def run_spexis_scheduler_process(*args, **kwargs):
    """SGLang's ``run_scheduler_process`` with Spexis' hooks installed first."""
    from spexis_sglang.cpu_support import install_startup_hooks
    from spexis_sglang.srt.config import share_gpu_mode

    install_startup_hooks()
    share = share_gpu_mode()
    if share:
        import torch

        args = share_one_gpu(args, torch.cuda.device_count(), share)
    install()
    from sglang.srt.managers import scheduler

    return scheduler.run_scheduler_process(*args, **kwargs)
