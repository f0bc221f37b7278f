"""Start-up output a Spexis user on CPU can read.

A CPU start of SGLang 0.5.17 prints, in the server process and again in every scheduler, one
``Ignore import error when loading sglang.srt.models.X: ...`` line per model module that
cannot be imported here (CUDA-only kernels, vllm, torchaudio, ...): 10 modules, 30 lines. It
also repeats a few import-time ``UserWarning``s about CUDA-only features. None of it concerns
the model being served. This module replaces the import errors by one summary line (in the
server process only: the schedulers import the same modules) that names the skipped modules,
and drops those warnings. ``SPEXIS_SHOW_SKIPPED_MODELS=1`` turns it off.

Everything else SGLang logs is left alone.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import logging
import multiprocessing
import os
import sys
import warnings
from typing import Callable, Dict, Optional, Sequence

logger = logging.getLogger(__name__)

REGISTRY_MODULE = "sglang.srt.models.registry"
SKIP_PREFIX = "Ignore import error when loading sglang.srt.models."
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
