"""Test-wide set-up: the CPU environment must be active before torch/transformers/sglang load."""

import os

import pytest

from spexis_sglang.cpu_support import activate

# the environment as the user's shell gave it, before activate() changes it for this process
# and its children (a test that runs a program the way a user would starts it with this)
_USER_ENV = dict(os.environ)
activate()

# Property tests draw the same examples on every run (a test that fails on noise blocks
# everyone): hypothesis derives each test's seed from the test itself.
from hypothesis import settings  # noqa: E402

settings.register_profile("spexis", derandomize=True, print_blob=True)
settings.load_profile("spexis")


@pytest.fixture(scope="session", autouse=True)
def tokenizer_cache(tmp_path_factory):
    """Every server the suite starts unpickles its tokenizer from one directory after the
    first load (``srt/tokenizer_cache.py``: ~1 s of CPU saved per process of each server);
    pytest-xdist's workers share it."""
    from spexis_sglang.srt.config import ENV_TOKENIZER_CACHE

    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    path = shared / "tokenizer-cache"
    path.mkdir(exist_ok=True)
    os.environ[ENV_TOKENIZER_CACHE] = str(path)
    yield str(path)


@pytest.fixture(scope="session")
def user_env() -> dict:
    """The environment the test run started with, before the CPU support was activated."""
    return dict(_USER_ENV)


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups
def pytest_collection_modifyitems(session, config, items):
    """Under pytest-xdist (``--dist loadgroup``) a test file runs on one worker: module-wide
    fixtures (a server, a trained model) are made once. The end-to-end files are grouped by
    the servers they share (``tests/e2e/conftest.py``)."""
    e2e = os.path.join(os.path.dirname(os.path.abspath(__file__)), "e2e")
    for item in items:
        if os.path.dirname(str(item.path)) != e2e:
            item.add_marker(pytest.mark.xdist_group(os.path.relpath(str(item.path), e2e + "/..")))


# ----------------------------------------------------------------------------- server launches
# test file -> server processes started while its tests ran (tests/e2e/conftest.py counts them
# into config.spexis_launches); under pytest-xdist each worker hands its counts to the
# controller, which prints the summary


def pytest_configure(config):
    config.spexis_launches = {}


def add_launches(config, counts: dict) -> None:
    for name, n in counts.items():
        config.spexis_launches[name] = config.spexis_launches.get(name, 0) + n


def pytest_sessionfinish(session, exitstatus):
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:  # a pytest-xdist worker
        workeroutput["spexis_launches"] = dict(session.config.spexis_launches)


def pytest_testnodedown(node, error):
    """(pytest-xdist, on the controller) a worker's launch counts."""
    add_launches(node.config, getattr(node, "workeroutput", {}).get("spexis_launches", {}))


# worker -> group -> seconds of test phases (setup, call, teardown) it ran: what balancing the
# end-to-end groups over the workers needs to know (the slowest worker is the suite's time)
_worker_seconds: dict = {}


def pytest_runtest_logreport(report):
    """(pytest-xdist, on the controller) a test phase's time, by worker and group."""
    node = getattr(report, "node", None)
    gateway = getattr(node, "gateway", None)
    if gateway is None:
        return
    group = report.nodeid.rpartition("@")[2] if "@e2e-" in report.nodeid else "unit"
    by_group = _worker_seconds.setdefault(gateway.id, {})
    by_group[group] = by_group.get(group, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter):
    launches = terminalreporter.config.spexis_launches
    if launches:
        terminalreporter.write_sep("-", f"{sum(launches.values())} server launches")
        for name, n in sorted(launches.items(), key=lambda kv: -kv[1]):
            terminalreporter.write_line(f"{n:3d}  {name}")
    if _worker_seconds:
        terminalreporter.write_sep("-", "test time by worker")
        for worker, groups in sorted(_worker_seconds.items()):
            parts = ", ".join(f"{g} {t:.0f} s" for g, t in sorted(groups.items()))
            terminalreporter.write_line(f"{worker}: {sum(groups.values()):.0f} s ({parts})")
