"""Session-wide real servers for the end-to-end tests (each started once, on first use)."""

from __future__ import annotations

import os
from typing import Callable, Dict, List, Tuple

import pytest

from spexis_sglang.default_model import ensure_default_model
from spexis_sglang.testing import ServerProcess, exact_test_args

from .tiny_model import make_tiny_llama

_servers: Dict[Tuple[str, ...], ServerProcess] = {}


def exact(args: List[str]) -> List[str]:
    """Every test server runs in the exact mode: equality tests demand identical tokens."""
    return [*args, *exact_test_args()]


def get_server(args: List[str], env: Dict[str, str] | None = None) -> ServerProcess:
    key = tuple(args) + tuple(sorted((env or {}).items()))
    server = _servers.get(key)
    if server is None or not server.alive():
        server = ServerProcess(exact(args), env=env)
        _servers[key] = server
        server.wait_ready()
    return server


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
