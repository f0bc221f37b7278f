"""``python -m spexis_sglang.bench_serving``: SGLang's own ``bench_serving`` from this project.

It takes exactly the arguments of SGLang 0.5.17's ``python -m sglang.benchmark.serving`` (the
old path ``sglang.bench_serving`` is a deprecated alias of it) and runs its ``cli_main``
unchanged. The only difference: on a machine without CUDA it first applies the CPU start-up
hooks of :mod:`spexis_sglang.cpu_support` (the triton stub, the ``sgl_kernel`` stand-in,
offline hub mode), without which importing the benchmark fails there with
``No module named 'triton'``. On a GPU machine nothing is changed.

Example, against a server of ``make serve`` (SP) or ``make serve-plain`` (plain PP) on :30000::

    .venv/bin/python -m spexis_sglang.bench_serving --backend sglang --port 30000 \\
        --dataset-name random-ids --random-input-len 64 --random-output-len 32 \\
        --num-prompts 40 --request-rate 2 --output-file result.jsonl

``random-ids`` needs no download (random token ids, the tokenizer is the one of the served
model, read from its local directory); ``sharegpt`` and ``random`` need
``--dataset-path`` to a local ShareGPT JSON on machines without internet.
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


if __name__ == "__main__":
    main()
