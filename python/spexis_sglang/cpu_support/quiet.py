"""Start-up output a Spexis user on CPU can read.

A CPU start of SGLang 0.5.17 prints, in the server process and again in every scheduler, one
``Ignore import error when loading sglang.srt.models.X: ...`` line per model module that
cannot be imported here (CUDA-only kernels, vllm, torchaudio, ...): 10 modules, 30 lines. It
also repeats a few import-time ``UserWarning``s about CUDA-only features. None of it concerns
the model being served. This module replaces the import errors by one summary line (in the
server process only: the schedulers import the same modules) that names the skipped modules,
and drops those warnings. ``SPEXIS_SHOW_SKIPPED_MODELS=1`` turns it off.

On every machine (:func:`install_log_filters`, from ``srt/hooks.py`` in the server and
scheduler processes) a few more expected lines are silenced at their logger: the several
thousand characters of ``server_args=...`` (one line says how to print them), each PP stage's
``Parameter model.embed_tokens.weight / model.norm.weight not found in params_dict`` (a stage
holds no embedding or no final norm), and fastapi's deprecation warning about SGLang's
``ORJSONResponse``. On CPU also: a negative ``mem usage`` (the machine's free memory, moved by
other processes meanwhile) reads ``0.00``, SGLang's notes that CUDA graphs and the AMX
all-reduce are off are dropped, and the weight-loading progress bar (the default model loads in
seconds) is not drawn. ``SPEXIS_SHOW_ALL_STARTUP_LINES=1`` keeps every line.

Everything else SGLang logs is left alone.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import logging
import multiprocessing
import os
import re
import sys
import warnings
from typing import Callable, Dict, Optional, Sequence

logger = logging.getLogger(__name__)

REGISTRY_MODULE = "sglang.srt.models.registry"
SKIP_PREFIX = "Ignore import error when loading sglang.srt.models."
# copies of srt.config's ENV_SHOW_SKIPPED_MODELS and ENV_SHOW_ALL_STARTUP_LINES (this module is
# installed before numpy or torch may be imported; tests/test_env_names.py checks them)
SHOW_ENV = "SPEXIS_SHOW_SKIPPED_MODELS"

# Import-time warnings about CUDA-only features, printed once per process (regexes of
# ``warnings.filterwarnings``: matched at the start of the message).
NOISY_WARNINGS: Sequence[str] = (
    r"Triton is not supported on current platform, roll back to CPU",
    r"Only CUDA, .* support .* currently",
    r"The given buffer is not writable",  # torch.frombuffer in SGLang's gloo object broadcast
)


class SkippedModelImportsFilter(logging.Filter):
    """Drops SGLang's per-module import errors of its model registry and remembers them."""

    def __init__(self) -> None:
        super().__init__()
        self.skipped: Dict[str, str] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # a malformed record is not ours to judge
            return True
        if not message.startswith(SKIP_PREFIX):
            return True
        name, _, error = message[len(SKIP_PREFIX) :].partition(": ")
        self.skipped[name] = error
        return False

    def summary(self) -> Optional[str]:
        if not self.skipped:
            return None
        return (
            f"{len(self.skipped)} SGLang model modules skipped (they need CUDA kernels or "
            f"packages this CPU environment does not have): {', '.join(sorted(self.skipped))}; "
            f"{SHOW_ENV}=1 shows each import error"
        )


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs ``callback`` once, right after the module ``fullname`` has been executed."""

    def __init__(self, fullname: str, callback: Callable[[], None]) -> None:
        self.fullname = fullname
        self.callback = callback

    def find_spec(self, fullname, path, target=None):  # type: ignore[override]
        if fullname != self.fullname:
            return None
        sys.meta_path.remove(self)  # one shot; also keeps the lookup below from recursing
        spec = importlib.machinery.PathFinder.find_spec(fullname, path, target)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module
        callback = self.callback

        def exec_then_callback(module) -> None:
            try:
                exec_module(module)
            finally:
                callback()

        spec.loader.exec_module = exec_then_callback  # type: ignore[method-assign]
        return spec


def after_import(fullname: str, callback: Callable[[], None]) -> None:
    """Run ``callback`` once, right after the module ``fullname`` is first executed."""
    sys.meta_path.insert(0, _AfterImport(fullname, callback))


def _is_main_process() -> bool:
    return multiprocessing.parent_process() is None


def quiet_startup() -> Optional[SkippedModelImportsFilter]:
    """Install the filters in this process. Returns the import-error filter, if installed."""
    for pattern in NOISY_WARNINGS:
        warnings.filterwarnings("ignore", message=pattern, category=UserWarning)
    if os.environ.get(SHOW_ENV) == "1":
        return None
    registry_logger = logging.getLogger(REGISTRY_MODULE)
    for existing in registry_logger.filters:
        if isinstance(existing, SkippedModelImportsFilter):
            return existing
    skipped = SkippedModelImportsFilter()
    registry_logger.addFilter(skipped)

    def report() -> None:
        line = skipped.summary()
        if line and _is_main_process():
            logger.info(line)

    if REGISTRY_MODULE in sys.modules:
        return skipped  # already imported: its messages are out, nothing to summarize
    after_import(REGISTRY_MODULE, report)
    return skipped


# --------------------------------------------------------------------------- start-up lines
# Lines SGLang logs on every start that a user reads as errors although they are expected.
# Each is silenced (or rewritten) at its logger, so every other line of that logger stays.
SHOW_ALL_ENV = "SPEXIS_SHOW_ALL_STARTUP_LINES"
SERVER_ARGS_LINE = (
    "SGLang's resolved server arguments are not printed (several thousand characters; the "
    f"'spexis launch' line has the command line): {SHOW_ALL_ENV}=1 prints them"
)
# a PP stage holds no embedding (later stages), no final norm or LM head (earlier stages):
# SGLang's loader reports the checkpoint's copy as unused on each such stage
PP_STAGE_PARAMS = ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight")
_NEGATIVE_MEM = re.compile(r"mem usage=-\d+(\.\d+)? GB")


def _server_args(message: str) -> Optional[str]:
    return SERVER_ARGS_LINE if message.startswith("server_args=") else message


def _pp_stage_param(message: str) -> Optional[str]:
    for name in PP_STAGE_PARAMS:
        if message == f"Parameter {name} not found in params_dict":
            return None
    return message


def _negative_mem(message: str) -> Optional[str]:
    # on CPU "memory" is the machine's free memory, which other processes move meanwhile
    return _NEGATIVE_MEM.sub("mem usage=0.00 GB", message)


def _drop_prefixes(*prefixes: str) -> Callable[[str], Optional[str]]:
    return lambda message: None if message.startswith(prefixes) else message


class RewriteFilter(logging.Filter):
    """Applies ``rewrite`` to each record's message: ``None`` drops it, a new text replaces it."""

    def __init__(self, rewrite: Callable[[str], Optional[str]]) -> None:
        super().__init__()
        self.rewrite = rewrite

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:
            return True
        new = self.rewrite(message)
        if new is None:
            return False
        if new != message:
            record.msg, record.args = new, ()
        return True


# the architectures SP serves whose SGLang loaders log those parameters (Mistral's and Phi-3's
# are Llama's)
_MODELS = tuple(
    f"sglang.srt.models.{name}"
    for name in ("llama", "qwen2", "qwen3", "qwen3_moe", "mixtral", "glm4")
)
EVERYWHERE: Sequence = (
    ("sglang.srt.entrypoints.engine", _server_args),
    *((name, _pp_stage_param) for name in _MODELS),
)
ON_CPU: Sequence = (
    ("sglang.srt.model_executor.model_runner", _negative_mem),
    ("sglang.srt.distributed.bootstrap", _negative_mem),
    (
        "sglang.srt.distributed.bootstrap",
        _drop_prefixes("init_cpu_threads_env and shared memory based AllReduce is disabled"),
    ),
    # the CPU defaults turn CUDA graphs off; SGLang says so once per phase and process
    (
        "sglang.srt.server_args",
        _drop_prefixes("Cuda graph is disabled because of using torch native attention"),
    ),
    (
        "sglang.srt.model_executor.model_runner_components.cuda_graph_setup",
        _drop_prefixes("Disable prefill CUDA graph because cuda_graph_config resolved"),
    ),
)
# SGLang's HTTP server still answers with fastapi's deprecated ORJSONResponse; fastapi warns,
# with a source line, at the first such answer
FASTAPI_WARNINGS: Sequence[str] = (r"(ORJSONResponse|UJSONResponse) is deprecated",)


def install_log_filters(cpu: bool) -> None:
    """Silence the expected start-up lines in this process (idempotent)."""
    if os.environ.get(SHOW_ALL_ENV) == "1":
        return
    for pattern in FASTAPI_WARNINGS:
        warnings.filterwarnings("ignore", message=pattern, category=UserWarning)
    for name, rewrite in (*EVERYWHERE, *(ON_CPU if cpu else ())):
        logger_ = logging.getLogger(name)
        if not any(isinstance(f, RewriteFilter) and f.rewrite is rewrite for f in logger_.filters):
            logger_.addFilter(RewriteFilter(rewrite))


def quiet_weight_loading() -> None:
    """On CPU the default model loads in seconds, and SGLang's progress bar for it lands in the
    middle of the other processes' log lines: load without it."""
    if os.environ.get(SHOW_ALL_ENV) == "1":
        return

    def patch() -> None:
        module = sys.modules.get("sglang.srt.model_loader.weight_utils")
        base = getattr(module, "tqdm", None)
        if base is None or getattr(base, "_spexis_quiet", False):
            return

        class QuietTqdm(base):  # type: ignore[misc, valid-type]
            _spexis_quiet = True

            def __init__(self, *args, **kwargs):
                kwargs["disable"] = True
                super().__init__(*args, **kwargs)

        module.tqdm = QuietTqdm

    if "sglang.srt.model_loader.weight_utils" in sys.modules:
        patch()
    else:
        after_import("sglang.srt.model_loader.weight_utils", patch)
