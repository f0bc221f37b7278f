"""spexis_sglang.testing.ServerProcess: ports and start-up failures (no SGLang involved)."""

from __future__ import annotations

import os

import pytest

from spexis_sglang.testing import PORT_RANGE, ServerDied, ServerProcess, free_port

FAKE_SERVER = """
import os, sys, time
with open(os.environ["LAUNCHES"], "a") as f:
    f.write(sys.argv[sys.argv.index("--port") + 1] + "\\n")
print(os.environ["BIND_ERROR"], flush=True)
if os.environ.get("EXIT"):
    sys.exit(1)
time.sleep(60)
"""
# uvicorn's message (the process lives on), and the torch.distributed rendezvous's when the
# port SGLang picked for it was taken meanwhile (the scheduler dies, then the server)
UVICORN_BIND = (
    "ERROR:    [Errno 98] error while attempting to bind on address "
    "('127.0.0.1', 1): address already in use"
)
RENDEZVOUS_BIND = (
    "torch.distributed.DistNetworkError: The server socket has failed to listen on any local "
    "network address. port: 42325, useIpv6: false, code: -98, name: EADDRINUSE, message: "
    "address already in use"
)


def test_ports_are_picked_below_the_ephemeral_range():
    ports = {free_port() for _ in range(20)}
    assert all(PORT_RANGE[0] <= p < PORT_RANGE[1] for p in ports)
    assert len(ports) > 1


@pytest.mark.parametrize(
    "message, exits", [(UVICORN_BIND, False), (RENDEZVOUS_BIND, True)], ids=["http", "rendezvous"]
)
def test_a_port_taken_during_start_up_restarts_the_server_on_another(tmp_path, message, exits):
    """A taken port must not cost the whole start-up timeout (uvicorn reports it and lives on)
    nor fail the test (the rendezvous's kills the server): a fresh port is tried (twice)
    before giving up."""
    (tmp_path / "fake_server.py").write_text(FAKE_SERVER)
    launches = tmp_path / "launches"
    env = {
        "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
        "LAUNCHES": str(launches),
        "BIND_ERROR": message,
        "EXIT": "1" if exits else "",
    }
    server = ServerProcess([], env=env, module="fake_server")
    with pytest.raises(ServerDied, match="was taken during start-up"):
        server.wait_ready(timeout=60)
    ports = launches.read_text().split()
    assert len(ports) == 3 and len(set(ports)) == 3, ports
    assert not server.alive()


READY_SERVER = """
import os, sys, time
print("[2026-01-01 00:00:00] The server is fired up and ready to roll!", flush=True)
print("pyspy dump:", os.environ.get("SGLANG_PYSPY_DUMP_BEFORE_CRASH"), flush=True)
time.sleep(60)
"""


def test_ready_when_sglang_logs_its_warm_up_done_and_stops_skip_crash_dumps(tmp_path):
    """SGLang's "fired up" line (its warm-up request answered) is the readiness signal: no
    second generation through /health_generate (a second or more each). Test servers start
    without SGLang's crash diagnostics, whose 5 s sleep every stop would pay."""
    (tmp_path / "ready_server.py").write_text(READY_SERVER)
    env = {"PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    server = ServerProcess([], env=env, module="ready_server")
    try:
        server.wait_ready(timeout=30)
        assert server.ready_after < 10
        assert server.alive()
    finally:
        server.stop()
    assert not server.alive()
    assert "pyspy dump: 0" in server.log_tail()
