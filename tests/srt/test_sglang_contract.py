"""The SGLang internals Spexis relies on exist in the installed SGLang, with the parameters
Spexis calls or overrides them with (``srt/sglang_contract.py``): an SGLang upgrade that moves
one fails here, naming it and where Spexis uses it."""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import re

import pytest

from spexis_sglang.cpu_support import activate

activate()

from spexis_sglang.srt.sglang_contract import INTERNALS, SCHEDULER_STATE  # noqa: E402


def _resolve(module: str, dotted: str):
    obj = importlib.import_module(module)
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


@pytest.mark.parametrize("entry", INTERNALS, ids=lambda e: f"{e.module}:{e.name}")
def test_internal_is_there_with_its_parameters(entry):
    try:
        obj = _resolve(entry.module, entry.name)
    except (ImportError, AttributeError) as e:
        pytest.fail(f"{entry.module}.{entry.name} ({entry.use} in {entry.where}) is gone: {e}")
    if entry.params is None:
        return
    fn = obj.fget if isinstance(obj, property) else obj
    params = [p for p in inspect.signature(fn).parameters if p != "self"]
    assert tuple(params[: len(entry.params)]) == entry.params, (
        f"{entry.module}.{entry.name} ({entry.use} in {entry.where}) now takes {params}, "
        f"Spexis expects {list(entry.params)}"
    )


def test_scheduler_still_sets_the_state_the_sp_loop_reads():
    """Attributes SGLang's scheduler sets on itself (``self.NAME =`` somewhere in its
    modules): a rename there would otherwise surface as an AttributeError in a server."""
    import sglang.srt.managers.scheduler as scheduler

    sources = []
    for cls in scheduler.Scheduler.__mro__:
        if cls.__module__.startswith("sglang."):
            sources.append(inspect.getsource(inspect.getmodule(cls)))
    text = "\n".join(sources)
    # assigned alone (``self.x = ...``, ``self.x: T = ...``) or in a tuple target
    tuples = " ".join(re.findall(r"\(\s*(?:(?:self\.\w+|_)\s*,?\s*)+\)\s*=", text))
    missing = [
        name
        for name in SCHEDULER_STATE
        if not re.search(r"self\.%s\s*(:[^=\n]*)?=[^=]" % re.escape(name), text)
        and not re.search(r"self\.%s\b" % re.escape(name), tuples)
    ]
    assert not missing, f"SGLang's Scheduler no longer sets {missing} (read by the SP loop)"


def test_the_table_covers_the_pp_methods_spexis_overrides():
    """Every SGLang method SpexisScheduler overrides is in the table (a new override must be
    added there, so the next upgrade checks it)."""
    from sglang.srt.managers.scheduler import Scheduler

    from spexis_sglang.srt.sp_scheduler import SpexisScheduler

    overridden = {
        name
        for klass in SpexisScheduler.__mro__
        if klass.__module__.startswith("spexis_sglang.")
        for name, value in vars(klass).items()
        if callable(value) and hasattr(Scheduler, name) and not name.startswith("__")
    }
    listed = {e.name.split(".", 1)[1] for e in INTERNALS if e.name.startswith("Scheduler.")}
    assert overridden <= listed, f"overridden but not in the contract: {overridden - listed}"


def test_the_table_covers_every_method_spexis_subclasses_override():
    """SGLang classes Spexis subclasses (the prefill adder, SP's running batch and sampling
    state): every SGLang method they override is in the table."""
    from sglang.srt.managers.schedule_batch import ScheduleBatch
    from sglang.srt.managers.schedule_policy import PrefillAdder
    from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo

    from spexis_sglang.srt.prefill_adder import SpexisPrefillAdder, SPRunningBatch
    from spexis_sglang.srt.sp_sampling import SPSamplingBatchInfo

    overridden = set()
    for ours, base in (
        (SpexisPrefillAdder, PrefillAdder),
        (SPRunningBatch, ScheduleBatch),
        (SPSamplingBatchInfo, SamplingBatchInfo),
    ):
        # a dataclass subclass's generated methods take the base's fields: nothing of ours
        generated = {"__init__", "__repr__", "__eq__"} if dataclasses.is_dataclass(ours) else ()
        for name, value in vars(ours).items():
            if name in generated:
                continue
            if hasattr(base, name) and (callable(value) or isinstance(value, property)):
                if not name.startswith("__") or name == "__init__":
                    overridden.add(f"{base.__name__}.{name}")
    listed = {e.name for e in INTERNALS if e.use == "override"}
    assert overridden, "no overrides found: the scan is broken"
    assert overridden <= listed, f"overridden but not in the contract: {overridden - listed}"


def test_only_srt_and_the_cpu_support_import_sglang():
    """SGLang is reached from ``srt/`` (and the CPU environment) only: an upgrade's changes
    stay in one package (the entry points outside it are thin wrappers of ``srt``)."""
    import ast
    from pathlib import Path

    import spexis_sglang

    root = Path(spexis_sglang.__file__).parent
    allowed = {root / "srt", root / "cpu_support"}
    offenders = []
    for path in sorted(root.rglob("*.py")):
        if any(folder in path.parents for folder in allowed):
            continue
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            else:
                continue
            offenders += [
                f"{path.relative_to(root)}:{node.lineno} imports {n}"
                for n in names
                if n.split(".")[0] == "sglang"
            ]
    assert not offenders, offenders
