"""Session-wide real servers for the end-to-end tests (each started once, on first use).

Servers stay up for the session while memory allows: in the exact mode (float64) the suite's
dozen servers do not fit in the machine's 24 GiB at once, so before a server starts, the least
recently used ones are stopped until ``MIN_AVAILABLE_BYTES`` are free (a stopped server starts
again if a later test asks for it).
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import importlib.util
import os
import tempfile
from typing import Callable, Dict, List, Optional, Tuple

import psutil
import pytest

from spexis_sglang.default_model import ensure_default_model
from spexis_sglang.testing import ServerProcess, exact_test_args

from .tiny_model import make_tiny_llama

# least recently used first (a used server moves to the end)
_servers: Dict[Tuple[str, ...], ServerProcess] = {}
# what a starting float64 server needs with room to spare (the default model's PP=2 server
# peaks near 4 GiB across its processes)
MIN_AVAILABLE_BYTES = 7 * 2**30
# SPEXIS_TEST_MAX_SERVERS=N: keep at most N session servers alive (a shared, busy machine);
# unset or 0: as many as memory allows. The servers the running test holds are never stopped
# (a test comparing a baseline with an SP server keeps both, whatever N says).
MAX_SERVERS = int(os.environ.get("SPEXIS_TEST_MAX_SERVERS") or 0)


def exact(args: List[str]) -> List[str]:
    """Every test server runs in the exact mode: equality tests demand identical tokens."""
    return [*args, *exact_test_args()]


# SGLang's model modules the test servers need: nearly every model they serve is a Llama (the
# default SmolLM2, the tiny model); the files that serve other architectures add their module.
MODEL_MODULES = ("llama",)


@functools.lru_cache(maxsize=None)
def _other_model_modules() -> str:
    """The rest of ``sglang.srt.models``, for SGLang's ``SGLANG_DISABLED_MODEL_ARCHS``: its
    registry otherwise imports all ~200 model modules in every server process (~0.8 s of CPU
    each, three or four processes per launch)."""
    sglang_dir = importlib.util.find_spec("sglang").submodule_search_locations[0]
    names = os.listdir(os.path.join(sglang_dir, "srt", "models"))
    modules = (n[: -len(".py")] for n in names if n.endswith(".py") and n != "__init__.py")
    return ",".join(sorted(m for m in modules if m not in MODEL_MODULES))


def model_modules_env(*modules: str) -> Dict[str, str]:
    """The environment of a test server that serves an architecture from SGLang's ``modules``
    besides the Llama ones (every other module stays unloaded)."""
    keep = set(MODEL_MODULES) | set(modules)
    disabled = [m for m in _other_model_modules().split(",") if m not in keep]
    return {"SGLANG_DISABLED_MODEL_ARCHS": ",".join(disabled)}


def server_env(env: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    """The environment of every test server: ``env`` over the suite's own settings."""
    return {"SGLANG_DISABLED_MODEL_ARCHS": _other_model_modules(), **(env or {})}


# servers handed to the running test: never stopped to make room for another of its servers
_in_use: set = set()


def make_room(min_available: int = MIN_AVAILABLE_BYTES) -> None:
    """Stop the least recently used session servers while less than ``min_available`` is free
    (never one the running test holds: it is about to be used)."""
    for key in list(_servers):
        too_many = MAX_SERVERS and len(_servers) >= MAX_SERVERS
        if not too_many and psutil.virtual_memory().available >= min_available:
            return
        if key not in _in_use:
            _servers.pop(key).stop()


# what a server that is still starting may yet take (the default model's PP=2 float64 server
# peaks near 4 GiB across its processes; MIN_AVAILABLE_BYTES keeps room for one more)
STARTING_SERVER_BYTES = 4 * 2**30


def _reservations_dir() -> Optional[str]:
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    return os.path.join(tempfile.gettempdir(), f"spexis-test-server-starts-{run}") if run else None


def _live_reservations(folder: str) -> List[str]:
    """Reservations of servers other workers are starting (a dead worker's are ignored)."""
    names = [n for n in os.listdir(folder) if n.isdigit() and int(n) != os.getpid()]
    return [n for n in names if psutil.pid_exists(int(n))]


@contextlib.contextmanager
def room_to_start():
    """Room for a server about to start, kept while it starts. Under pytest-xdist the workers
    start servers at the same time, but each one's memory check counts the servers the other
    workers are still starting (reserved in a shared folder under a brief file lock), so two
    float64 servers starting at once cannot exhaust memory; without xdist it makes room."""
    folder = _reservations_dir()
    if folder is None:
        make_room()
        yield
        return
    os.makedirs(folder, exist_ok=True)
    mine = os.path.join(folder, str(os.getpid()))
    with open(os.path.join(folder, "lock"), "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            starting = len(_live_reservations(folder))
            make_room(MIN_AVAILABLE_BYTES + starting * STARTING_SERVER_BYTES)
            open(mine, "w").close()
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
    try:
        yield
    finally:
        os.unlink(mine)


def start_server(args: List[str], env: Optional[Dict[str, str]] = None) -> ServerProcess:
    """A new test server (exact mode, the suite's environment), started once there is room."""
    with room_to_start():
        server = ServerProcess(
            exact(args), env=server_env(env), die_with_parent=True, preloaded=True
        )
        return server.wait_ready()


# With pytest-xdist (``make test``: two workers) the end-to-end files run in two groups, each on
# one worker, balanced by their time on the 2-core machine; both groups use the default model's
# two shared servers (each worker starts its own), the tiny model's files are all in the second.
# Unit tests are spread over both workers.
E2E_GROUP_A = {
    "test_bench_serving.py",
    "test_sp_grammar.py",
    "test_sp_admission.py",
    "test_sp_penalties.py",
    "test_sp_alpha_auto.py",
    "test_sp_multinode.py",
    "test_foundation.py",
    "test_gemma3.py",
    "test_architectures.py",
    "test_collect_backend.py",
    "test_frontend_dsl.py",
}


def e2e_group(file_name: str) -> str:
    """``e2e-a`` for the files of ``E2E_GROUP_A``, ``e2e-b`` for every other (the tiny
    model's files among them)."""
    return "e2e-a" if file_name in E2E_GROUP_A else "e2e-b"


# The order the end-to-end files run in (a server start costs tens of seconds on CI, and
# ``make_room`` may stop an idle server to start another): first the files served by the
# default model's two shared servers (plain PP=1, the SP PP=2 server with the shipped head),
# back to back; then those that pair the plain server with one more of their own; then the
# files with servers of their own only; the tiny model's tests come last, together (whatever
# their file: their servers are the tiny model's), so each server starts about once.
E2E_ORDER = [
    "test_bench_serving.py",
    "test_sp_bad_input.py",
    "test_sp_grammar.py",
    "test_sp_load.py",
    "test_frontend_dsl.py",
    "test_sp_logprobs.py",
    "test_sp_lossless.py",
    "test_collect_backend.py",
    "test_foundation.py",
    "test_sp_multinode.py",
    "test_sp_admission.py",
    "test_sp_alpha_auto.py",
    "test_sp_graphs.py",
    "test_sp_penalties.py",
    # the tiny model
    "test_sp_launch_options.py",
    "test_sp_forced.py",
    "test_sp_length_oracle.py",
]


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups
def pytest_collection_modifyitems(session, config, items):
    """Run the end-to-end tests in ``E2E_ORDER`` (unit tests keep their places), each in its
    group (``e2e_group``)."""
    here = os.path.dirname(os.path.abspath(__file__))
    slots = [i for i, item in enumerate(items) if os.path.dirname(str(item.path)) == here]

    def rank(i: int):
        item = items[i]
        name = os.path.basename(str(item.path))
        known = name in E2E_ORDER
        tiny = "tiny_model_dir" in getattr(item, "fixturenames", ())
        position = E2E_ORDER.index(name) if known else len(E2E_ORDER)
        return (tiny, not known, position, i)

    ordered = [items[i] for i in sorted(slots, key=rank)]
    for slot, item in zip(slots, ordered):
        items[slot] = item
        item.add_marker(pytest.mark.xdist_group(e2e_group(os.path.basename(str(item.path)))))


# servers asked for with keep=False: stopped when the test that asked ends
_transient: set = set()


@pytest.fixture(autouse=True)
def _release_servers_after_test():
    yield
    _in_use.clear()
    while _transient:
        server = _servers.pop(_transient.pop(), None)
        if server is not None:
            server.stop()


def get_server(
    args: List[str], env: Dict[str, str] | None = None, keep: bool = True
) -> ServerProcess:
    """A running server with ``args`` (started, or one of the session's).

    ``keep=False``: stopped when the calling test ends, for a server no other test asks for
    whose processes do not sleep when idle (SGLang's data-parallel controller polls its
    sockets: kept up, it would take a core for the rest of the suite)."""
    key = tuple(args) + tuple(sorted((env or {}).items()))
    server = _servers.pop(key, None)
    if server is None or not server.alive():
        server = start_server(args, env)
    _servers[key] = server  # most recently used
    _in_use.add(key)
    if not keep:
        _transient.add(key)
    return server


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Count the server processes each test file starts (set-up included); the summary is
    printed by tests/conftest.py."""
    before = len(ServerProcess.launches)
    yield
    started = len(ServerProcess.launches) - before
    if started:
        launches = item.config.spexis_launches
        name = item.nodeid.split("::")[0]
        launches[name] = launches.get(name, 0) + started


def pytest_sessionfinish(session, exitstatus):
    for server in _servers.values():
        server.stop()


@pytest.fixture(scope="session")
def model_dir() -> str:
    return ensure_default_model()


@pytest.fixture(scope="session")
def server_factory() -> Callable[..., ServerProcess]:
    return get_server


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    return make_tiny_llama(str(tmp_path_factory.mktemp("tiny-llama")), live_tokens=24)
