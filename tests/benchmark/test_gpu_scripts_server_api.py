"""The GPU scripts only run on the device machines, so a call to a server method that no longer
exists shows there, after minutes of start-up (it happened: ``srv.post`` / ``srv.tail`` in the
equality script). Every attribute they use on a server object must exist on the server class
(``decode_throughput.Server``, a ``spexis_sglang.testing.ServerProcess``)."""

import ast
import glob
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.join(HERE, "..", "..")
sys.path.insert(0, os.path.join(ROOT, "benchmark", "gpu"))

import decode_throughput  # noqa: E402

from spexis_sglang import testing  # noqa: E402

#: the names the GPU scripts give a server object
SERVER_NAMES = {"srv", "server", "sp_server", "baseline"}


def _instance_attributes(path: str, cls: str) -> set:
    """``self.X = ...`` anywhere in ``cls``'s methods."""
    with open(path) as f:
        tree = ast.parse(f.read())
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == cls:
            for sub in ast.walk(node):
                if (
                    isinstance(sub, ast.Attribute)
                    and isinstance(sub.value, ast.Name)
                    and sub.value.id == "self"
                    and isinstance(sub.ctx, ast.Store)
                ):
                    out.add(sub.attr)
    return out


def _server_attributes_used(path: str) -> list:
    with open(path) as f:
        tree = ast.parse(f.read())
    return [
        (node.attr, node.lineno)
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Name)
        and node.value.id in SERVER_NAMES
    ]


def test_gpu_scripts_use_only_what_the_server_class_has():
    known = set(dir(decode_throughput.Server))
    known |= _instance_attributes(testing.__file__, "ServerProcess")
    known |= _instance_attributes(decode_throughput.__file__, "Server")
    scripts = sorted(glob.glob(os.path.join(ROOT, "benchmark", "gpu", "*.py")))
    used = {s: _server_attributes_used(s) for s in scripts}
    assert any(used.values())  # the check sees the scripts' server calls
    missing = [
        f"{os.path.relpath(s, ROOT)}:{line}: .{attr}"
        for s, attrs in used.items()
        for attr, line in attrs
        if attr not in known
    ]
    assert not missing, missing
