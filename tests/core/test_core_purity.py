"""core/ is pure Python + numpy: no torch, no sglang (docs/design.md §1)."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import spexis_sglang.core as core

CORE = Path(core.__file__).parent
ALLOWED_THIRD_PARTY = {"numpy"}


def test_core_sources_import_only_stdlib_and_numpy() -> None:
    for path in sorted(CORE.glob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:  # relative: inside core
                    continue
                names = [node.module or ""]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                ok = top in sys.stdlib_module_names or top in ALLOWED_THIRD_PARTY
                assert ok, f"{path.name} imports {name}"


def _assert_fresh_import_loads_none(imports: str, condition: str) -> None:
    """In a fresh interpreter, after ``import <imports>``, no loaded module ``m`` satisfies
    ``condition``."""
    code = (
        f"import sys, {imports}; "
        f"bad = sorted(m for m in sys.modules if {condition}); print(bad); assert not bad"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    res = subprocess.run(
        [sys.executable, "-I", "-c", code], capture_output=True, text=True, env=env, timeout=60
    )
    assert res.returncode == 0, res.stdout + res.stderr


def test_importing_core_loads_neither_torch_nor_sglang() -> None:
    _assert_fresh_import_loads_none(
        "spexis_sglang.core, spexis_sglang.plan",
        "m.split('.')[0] in ('torch', 'sglang', 'transformers', 'triton')",
    )


def test_the_server_imports_neither_the_oracle_nor_the_simulations() -> None:
    """``sp_state`` (slot_state's test oracle) and ``simulation`` stay out of the import path
    of everything the server imports from core."""
    _assert_fresh_import_loads_none(
        "spexis_sglang.core, spexis_sglang.core.slot_state",
        "m.rsplit('.', 1)[-1] in ('sp_state', 'simulation')",
    )
