"""``python -m spexis_sglang.bench_serving`` where ``datasets`` is missing (the GPU site)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

# Hide `datasets`, then import SGLang's benchmark the way the command does.
_CODE = textwrap.dedent("""
    import sys

    sys.modules["datasets"] = None  # "import datasets" now fails as if it were not installed
    from spexis_sglang.cpu_support import activate
    from spexis_sglang.srt import bench_cli

    activate()
    bench_cli._stub_missing_datasets()
    from sglang.benchmark.datasets import DATASET_MAPPING
    from sglang.benchmark.serving import cli_main  # imports as on a machine without datasets

    try:
        DATASET_MAPPING["mmmu"].from_args(None)
    except ImportError as e:
        print("mmmu:", e)
    print("random-ids:", DATASET_MAPPING["random-ids"].__name__)
    """)


def test_benchmark_imports_without_datasets():
    proc = subprocess.run(
        [sys.executable, "-c", _CODE], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "mmmu: the mmmu dataset needs the `datasets` package" in proc.stdout
    assert "random-ids: RandomDataset" in proc.stdout
