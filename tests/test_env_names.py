"""Every environment variable of the package is named in ``srt/config.py``.

The start-up modules (``cpu_import_hook``, ``cpu_support`` and ``cpu_support.quiet``) run before
numpy or torch may be imported and so import nothing of the package: they keep copies of their
names, which must equal config's. Anywhere else a ``SPEXIS_*`` string is a defect: it would be
a second name for a setting, or one no document lists.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Dict, List, Tuple

from spexis_sglang.srt import config

PACKAGE = Path(__file__).resolve().parents[1] / "python" / "spexis_sglang"
START_UP_MODULES = {"cpu_import_hook.py", "cpu_support/__init__.py", "cpu_support/quiet.py"}
ENV_NAME = re.compile(r"SPEXIS_[A-Z0-9_]+")


def env_literals() -> Dict[str, List[Tuple[str, int]]]:
    """``SPEXIS_*`` string constants in the package's code, by file (``__all__`` lists of
    Python names left out)."""
    found: Dict[str, List[Tuple[str, int]]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        tree = ast.parse(path.read_text())
        exported = {
            id(const)
            for node in ast.walk(tree)
            if isinstance(node, ast.Assign)
            and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets)
            for const in ast.walk(node.value)
        }
        for node in ast.walk(tree):
            if id(node) in exported:
                continue
            if (
                isinstance(node, ast.Constant)
                and isinstance(node.value, str)
                and ENV_NAME.fullmatch(node.value)
            ):
                found.setdefault(rel, []).append((node.value, node.lineno))
    return found


def config_names() -> Dict[str, str]:
    return {
        value: name
        for name, value in vars(config).items()
        if name.startswith("ENV_") and isinstance(value, str)
    }


def test_only_config_and_the_start_up_modules_name_environment_variables():
    found = env_literals()
    assert "srt/config.py" in found
    stray = {f: v for f, v in found.items() if f != "srt/config.py" and f not in START_UP_MODULES}
    assert not stray, f"environment names outside srt/config.py: {stray}"


def test_the_start_up_modules_copies_equal_config():
    names = config_names()
    for rel in START_UP_MODULES:
        for value, line in env_literals().get(rel, []):
            assert value in names, f"{rel}:{line}: {value} is not defined in srt/config.py"
    assert len(names) >= 15  # the scan finds them (a renamed prefix would empty it)
