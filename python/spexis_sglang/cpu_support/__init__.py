"""Make SGLang 0.5.17 serve on a CPU-only machine with the CPU build of torch.

What is needed there, and only there:

* ``SGLANG_USE_CPU_ENGINE=1`` (without it SGLang imports vllm for rotary embeddings);
* the ``sgl_kernel`` stand-in in ``shim/`` first on the path;
* no triton in the CPU torch: install the triton stub that the sglang wheel ships;
* PyPI's torchvision wheel is a CUDA build whose ops do not load beside the CPU torch:
  declare the ``torchvision::nms`` schemas before its first import (no torchvision op runs
  on SGLang's text path);
* constrained decoding: SGLang's xgrammar backend allocates its bitmask in pinned memory and
  applies it with GPU kernels only; :mod:`.grammar` uses xgrammar's CPU kernel instead;
* one OpenMP thread per process and passive waiting (PP ranks share the two cores);
* start-up output a user can read: SGLang's per-module import errors of models that cannot
  load here become one summary line; import-time warnings about CUDA-only features, lines about
  the CUDA graphs the CPU defaults turn off, and the weight-loading progress bar are dropped
  (:mod:`.quiet`).

:func:`activate` applies all of this to the current process and to the environment that
spawned children inherit; ``shim/sitecustomize.py`` re-applies the start-up hooks in every
child. Nothing here is applied when a CUDA device is present.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import logging
import os
import sys

logger = logging.getLogger(__name__)

# srt.config's ENV_CPU_SUPPORT (this module runs before numpy or torch may be imported: it
# sets their thread counts; tests/test_env_names.py checks the copy)
ENV_CPU_SUPPORT = "SPEXIS_CPU_SUPPORT"

SHIM_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "shim")
_PYTHON_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CPU_ENV = {
    "SGLANG_USE_CPU_ENGINE": "1",
    "TORCHDYNAMO_DISABLE": "1",
    "OMP_NUM_THREADS": "1",
    "OMP_WAIT_POLICY": "PASSIVE",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
}


def cuda_available() -> bool:
    """True when a CUDA device is usable; the CPU support must then stay out of the way."""
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:  # pragma: no cover - torch missing or broken
        return False


def _install_triton_stub() -> None:
    if importlib.util.find_spec("triton") is not None or "triton" in sys.modules:
        return
    # Load the stub by path: importing the ``sglang`` package itself would need triton first.
    sglang_dir = importlib.util.find_spec("sglang").submodule_search_locations[0]
    spec = importlib.util.spec_from_file_location(
        "_spexis_triton_stub", os.path.join(sglang_dir, "_triton_stub.py")
    )
    stub = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(stub)
    stub.install()


def _declare_torchvision_schemas() -> None:
    """Let the CUDA torchvision wheel import beside the CPU torch (its C ops fail to load)."""
    if "torchvision" in sys.modules or importlib.util.find_spec("torchvision") is None:
        return
    import torch

    try:
        torch.library.define(
            "torchvision::nms", "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor"
        )
        torch.library.define(
            "torchvision::qnms",
            "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
        )
    except RuntimeError:
        pass  # already defined (real ops loaded, or defined earlier in this process)


def single_threaded_torch() -> None:
    """One intra-op thread in this process (and the processes it forks): the launcher's, whose
    pipeline stages share the CPU's cores.

    ``OMP_NUM_THREADS=1`` reaches only processes that import torch after it is set: finding
    out whether a GPU is there imported torch already, with an OpenMP pool of one thread per
    core whose idle threads spin. On the shared cores that made every small operator of a
    server cost ~10x its CPU time (a 32-token request of the default model under SP: 32.7 s
    before, 3.2 s after, on a busy 2-core box). Other programs (tests, training) keep torch's
    own thread count."""
    import torch

    if torch.get_num_threads() != 1:
        torch.set_num_threads(1)


def install_startup_hooks() -> None:
    """Hooks that must run before SGLang, transformers or torchvision are imported."""
    if os.environ.get(ENV_CPU_SUPPORT) != "1":
        return
    for key, value in CPU_ENV.items():
        os.environ.setdefault(key, value)
    if SHIM_DIR not in sys.path:
        sys.path.insert(0, SHIM_DIR)
    _install_triton_stub()
    _declare_torchvision_schemas()
    from spexis_sglang.cpu_support import grammar
    from spexis_sglang.cpu_support.quiet import (
        install_log_filters,
        quiet_startup,
        quiet_weight_loading,
    )

    quiet_startup()
    install_log_filters(cpu=True)
    quiet_weight_loading()
    grammar.install()


def activate() -> bool:
    """Enable CPU support for this process and its children. Returns False on a GPU machine."""
    if cuda_available():
        return False
    os.environ[ENV_CPU_SUPPORT] = "1"
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    for p in (_PYTHON_DIR, SHIM_DIR):
        if p not in paths:
            paths.insert(0, p)
    os.environ["PYTHONPATH"] = os.pathsep.join(paths)
    install_startup_hooks()
    return True
