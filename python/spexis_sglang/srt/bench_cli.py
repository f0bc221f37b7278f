"""SGLang's ``bench_serving`` CLI, run by ``python -m spexis_sglang.bench_serving``.

The only difference from ``python -m sglang.benchmark.serving``: on a machine without CUDA it
first applies the CPU start-up hooks of :mod:`spexis_sglang.cpu_support` (the triton stub, the
``sgl_kernel`` stand-in, offline hub mode), without which importing the benchmark fails there
with ``No module named 'triton'``. On a GPU machine nothing is changed.
"""

from __future__ import annotations

import importlib.util
import logging
import sys
import types
from typing import List, Optional

logger = logging.getLogger(__name__)

PROG = "python -m spexis_sglang.bench_serving"
MMMU_MODULE = "sglang.benchmark.datasets.mmmu"


def _stub_missing_datasets() -> None:
    """Let the benchmark import where ``datasets`` is not installed (the GPU machines' site).

    ``sglang.benchmark.datasets`` imports its MMMU loader at start-up, and only that module
    needs ``datasets`` at import time (``longbench_v2`` imports it when used). Where the
    package is missing, a stand-in for that one module takes its place: choosing
    ``--dataset-name mmmu`` then fails with an error that says what is missing; every other
    dataset is unaffected. The CPU environment installs the real package
    (``requirements/cpu.txt``).
    """
    if importlib.util.find_spec("datasets") is not None or MMMU_MODULE in sys.modules:
        return

    class MMMUDataset:
        @classmethod
        def from_args(cls, args):
            raise ImportError(
                "the mmmu dataset needs the `datasets` package, which is not installed "
                "here: pip install datasets"
            )

    stub = types.ModuleType(MMMU_MODULE)
    stub.MMMUDataset = MMMUDataset  # type: ignore[attr-defined]
    sys.modules[MMMU_MODULE] = stub
    logger.info("`datasets` is not installed: the mmmu and longbench_v2 datasets are unavailable")


def main(argv: Optional[List[str]] = None) -> None:
    from spexis_sglang.cpu_support import activate

    activate()
    _stub_missing_datasets()
    from sglang.benchmark.serving import cli_main

    sys.argv = [PROG, *(sys.argv[1:] if argv is None else argv)]
    cli_main()
