"""The CPU start-up filter: SGLang's per-module model import errors become one summary line."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
import warnings

from spexis_sglang.cpu_support import quiet
from spexis_sglang.cpu_support.quiet import SKIP_PREFIX, SkippedModelImportsFilter


def _record(name: str, msg: str, *args) -> logging.LogRecord:
    return logging.LogRecord(name, logging.WARNING, __file__, 1, msg, args, None)


def test_filter_drops_exactly_the_model_import_errors():
    f = SkippedModelImportsFilter()
    registry = quiet.REGISTRY_MODULE
    assert not f.filter(
        _record(registry, f"{SKIP_PREFIX}qwen3_5: No module named 'x'"),
    )
    assert not f.filter(
        _record(
            registry,
            "Ignore import error when loading %s: %s",
            "sglang.srt.models.inkling",
            "no helion",
        )
    )
    # the same module reported again (another process, a second registration) counts once
    assert not f.filter(_record(registry, f"{SKIP_PREFIX}qwen3_5: No module named 'x'"))
    # everything else passes, including import errors of other packages and other messages
    for msg in (
        "Ignore import error when loading my_pkg.models.foo: boom",
        "Skip loading sglang.srt.models.bar due to SGLANG_DISABLED_MODEL_ARCHS",
        "Unsupported architectures: ['Foo']",
    ):
        assert f.filter(_record(registry, msg)), msg
    assert f.skipped == {"qwen3_5": "No module named 'x'", "inkling": "no helion"}
    summary = f.summary()
    assert summary.startswith("2 SGLang model modules skipped")
    assert "inkling, qwen3_5" in summary and quiet.SHOW_ENV in summary


def test_no_summary_when_nothing_was_skipped():
    assert SkippedModelImportsFilter().summary() is None


def _run(code: str, env_extra: dict) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != quiet.SHOW_ENV}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**env, **env_extra},
    )


# A stand-in for sglang.srt.models.registry: a package whose registry module logs SGLang's
# message at import time, the way the real one does while registering its models.
_FAKE_REGISTRY = """
    import logging, sys
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    from spexis_sglang.cpu_support import quiet
    quiet.REGISTRY_MODULE = "fake_sglang_registry"
    quiet.quiet_startup()
    sys.path.insert(0, FAKE_DIR)
    import fake_sglang_registry
    print("imported", fake_sglang_registry.DONE)
"""


def test_summary_line_after_the_registry_import(tmp_path):
    (tmp_path / "fake_sglang_registry.py").write_text(textwrap.dedent("""
            import logging
            logger = logging.getLogger(__name__)
            for name, err in [("a", "no vllm"), ("b", "no kernel"), ("c", "no torchaudio")]:
                logger.warning(f"Ignore import error when loading sglang.srt.models.{name}: {err}")
            logger.warning("something SGLang users rely on")
            DONE = True
            """))
    code = _FAKE_REGISTRY.replace("FAKE_DIR", repr(str(tmp_path)))
    proc = _run(code, {})
    assert proc.returncode == 0, proc.stderr
    assert "imported True" in proc.stdout
    err = proc.stderr
    assert "Ignore import error" not in err
    assert "fake_sglang_registry: something SGLang users rely on" in err
    summary = [line for line in err.splitlines() if "model modules skipped" in line]
    assert len(summary) == 1 and "3 SGLang model modules skipped" in summary[0]
    assert ": a, b, c;" in summary[0]

    shown = _run(code, {quiet.SHOW_ENV: "1"})
    assert shown.returncode == 0, shown.stderr
    assert shown.stderr.count("Ignore import error") == 3
    assert "model modules skipped" not in shown.stderr


def test_cuda_only_warnings_are_dropped():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quiet.quiet_startup()
        warnings.warn("Only CUDA, HIP and XPU support AWQ currently.", UserWarning)
        warnings.warn("Triton is not supported on current platform, roll back to CPU.")
        warnings.warn("a warning that stays", UserWarning)
    assert [str(w.message) for w in caught] == ["a warning that stays"]
