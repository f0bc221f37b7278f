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


def _filtered(name: str, message: str, cpu: bool = True):
    """What the filters ``install_log_filters`` puts on logger ``name`` make of ``message``."""
    record = logging.LogRecord(name, logging.WARNING, __file__, 1, message, (), None)
    for pattern_logger, rewrite in (*quiet.EVERYWHERE, *(quiet.ON_CPU if cpu else ())):
        if pattern_logger == name and not quiet.RewriteFilter(rewrite).filter(record):
            return None
    return record.getMessage()


def test_expected_startup_lines_are_silenced_and_others_kept():
    llama = "sglang.srt.models.llama"
    assert _filtered(llama, "Parameter model.embed_tokens.weight not found in params_dict") is None
    assert _filtered(llama, "Parameter model.norm.weight not found in params_dict") is None
    # a parameter that is really missing still shows
    lost = "Parameter model.layers.3.mlp.up_proj.weight not found in params_dict"
    assert _filtered(llama, lost) == lost
    engine = "sglang.srt.entrypoints.engine"
    assert _filtered(engine, "server_args=ServerArgs(model_path='m', " + "x=1, " * 500 + ")") == (
        quiet.SERVER_ARGS_LINE
    )
    assert _filtered(engine, "other line") == "other line"
    runner = "sglang.srt.model_executor.model_runner"
    line = "Load weight end. elapsed=7.02 s, avail mem=8.44 GB, mem usage=-0.01 GB."
    assert _filtered(runner, line) == line.replace("-0.01", "0.00")
    assert _filtered(runner, line, cpu=False) == line  # a GPU's numbers are left alone
    keep = "Load weight end. elapsed=7.02 s, avail mem=8.44 GB, mem usage=0.32 GB."
    assert _filtered(runner, keep) == keep
    assert (
        _filtered(
            "sglang.srt.server_args",
            "Cuda graph is disabled because of using torch native attention backend",
        )
        is None
    )
    assert len(quiet.SERVER_ARGS_LINE) < 200 and quiet.SHOW_ALL_ENV in quiet.SERVER_ARGS_LINE


def test_install_log_filters_is_idempotent_and_can_be_turned_off(monkeypatch):
    name = "sglang.srt.models.qwen3"
    before = len(logging.getLogger(name).filters)
    monkeypatch.setenv(quiet.SHOW_ALL_ENV, "1")
    quiet.install_log_filters(cpu=True)
    assert len(logging.getLogger(name).filters) == before
    monkeypatch.delenv(quiet.SHOW_ALL_ENV)
    quiet.install_log_filters(cpu=True)
    quiet.install_log_filters(cpu=True)
    added = [f for f in logging.getLogger(name).filters if isinstance(f, quiet.RewriteFilter)]
    assert len(added) == 1
