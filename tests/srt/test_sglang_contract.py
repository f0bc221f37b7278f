"""The SGLang internals Spexis relies on exist in the installed SGLang, with the parameters
Spexis calls or overrides them with (``srt/sglang_contract.py``): an SGLang upgrade that moves
one fails here, naming it and where Spexis uses it."""

from __future__ import annotations

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
