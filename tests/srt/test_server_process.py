"""spexis_sglang.testing.ServerProcess: ports and start-up failures (no SGLang involved)."""

from __future__ import annotations

import os
import signal

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


FORKED_SERVER = """
import os, random, sys
print("args", sys.argv[1:], "mode", os.environ.get("MODE"), "draw", random.random(), flush=True)
print("disabled", os.environ.get("SGLANG_DISABLED_MODEL_ARCHS"), flush=True)
print("[2026-01-01 00:00:00] The server is fired up and ready to roll!", flush=True)
if os.environ.get("MODE") == "exit":
    sys.exit(int(sys.argv[-1]))
if os.environ.get("MODE") == "message":
    sys.exit("refused: bad flag")
import time
time.sleep(60)
"""


def _stub_env(tmp_path, **extra) -> dict:
    (tmp_path / "forked_server.py").write_text(FORKED_SERVER)
    path = f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"
    return {**os.environ, "PYTHONPATH": path, **extra}


def test_a_preloaded_launcher_forks_servers_that_run_as_python_m(tmp_path):
    """Each server is a fork of the launcher running ``python -m module args``: its own
    arguments and log, exit status as subprocess reports it (an int, a message to stderr and
    1), Python's random state drawn anew (the launcher's copy would repeat in every fork), its
    own value of a variable no preloaded module reads (SGLang's model registry is not among
    them); any other variable must equal the launcher's."""
    from spexis_sglang.preloaded_launcher import PreloadedLauncher

    env = _stub_env(tmp_path, MODE="exit")
    launcher = PreloadedLauncher(env, modules=["json"])
    try:
        assert launcher.late_read == {"SGLANG_DISABLED_MODEL_ARCHS", "PYTEST_CURRENT_TEST"}
        own = {**env, "SGLANG_DISABLED_MODEL_ARCHS": "gemma3,qwen2"}
        assert launcher.serves(own, os.getcwd())
        # pytest names the running test in the environment: another test's server is served
        assert launcher.serves({**own, "PYTEST_CURRENT_TEST": "another (call)"}, os.getcwd())
        assert not launcher.serves(_stub_env(tmp_path, MODE="other"), os.getcwd())
        assert not launcher.serves(env, str(tmp_path))
        logs, procs = [], []
        for code in (3, 0):
            logs.append(tmp_path / f"server{code}.log")
            procs.append(
                launcher.start("forked_server", ["--x", str(code)], str(logs[-1]), env=own)
            )
        assert [p.wait(timeout=30) for p in procs] == [3, 0]
        texts = [log.read_text() for log in logs]
        assert "args ['--x', '3'] mode exit" in texts[0] and "args ['--x', '0']" in texts[1]
        assert "disabled gemma3,qwen2" in texts[0]
        draws = [t.split("draw ")[1].split()[0] for t in texts]
        assert draws[0] != draws[1]
    finally:
        launcher.close()
    message = PreloadedLauncher(_stub_env(tmp_path, MODE="message"), modules=[])
    try:
        log = tmp_path / "message.log"
        assert message.start("forked_server", [], str(log)).wait(timeout=30) == 1
        assert "refused: bad flag" in log.read_text()
    finally:
        message.close()


def test_server_process_forks_from_the_preloaded_launcher_when_its_environment_matches(
    tmp_path, monkeypatch
):
    """A ``preloaded`` server with the launcher's environment is its child and stops like a
    started one; one whose environment differs starts as a new process; closing the launcher
    (its test process ending) stops the servers it forked."""
    import psutil

    from spexis_sglang import testing
    from spexis_sglang.preloaded_launcher import PreloadedLauncher

    for key in ("PYTHONPATH", "MODE"):
        monkeypatch.setenv(key, _stub_env(tmp_path, MODE="serve")[key])
    launcher = PreloadedLauncher({**testing.QUIET_SHUTDOWN_ENV, **os.environ}, modules=[])
    monkeypatch.setattr(testing, "_launcher", launcher)
    try:
        forked = ServerProcess([], module="forked_server", die_with_parent=True, preloaded=True)
        other = ServerProcess(
            [], env={"MODE": "other"}, module="forked_server", die_with_parent=True, preloaded=True
        )
        for server in (forked, other):
            server.wait_ready(timeout=30)
        assert psutil.Process(forked.proc.pid).ppid() == launcher.pid
        assert psutil.Process(other.proc.pid).ppid() == os.getpid()
        other.stop()
        forked.stop()
        assert not forked.alive() and forked.proc.returncode == -signal.SIGTERM
        # a later test (pytest renames it in the environment) still forks its servers
        monkeypatch.setenv("PYTEST_CURRENT_TEST", "tests/another.py::test_next (call)")
        left = ServerProcess([], module="forked_server", die_with_parent=True, preloaded=True)
        left.wait_ready(timeout=30)
        assert psutil.Process(left.proc.pid).ppid() == launcher.pid
    finally:
        launcher.close()
    assert not psutil.pid_exists(left.proc.pid)
