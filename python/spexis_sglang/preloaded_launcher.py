"""Faster server starts for a test suite: import the launcher's modules once, fork each server.

A server started as ``python -m spexis_sglang.launch_server`` spends ~8 s of CPU importing
SGLang, torch and transformers before it reads its arguments: on a 2-core CPU machine that is
a third of a test server's start-up, and the end-to-end suite starts about 45. A *preloaded
launcher* is one process that has made those imports; each server is then a fork of it that
runs the module as ``python -m`` would (``runpy``, ``__main__``), with the environment,
working directory, arguments, session and log the command line would have had.
:class:`~spexis_sglang.testing.ServerProcess` uses one (``preloaded=True``) only for a server
whose environment and working directory equal the launcher's (but for variables that only
modules the launcher has not imported read, :data:`LATE_READ_ENV`); any other starts as a new
process. Nothing an import reads from the environment can differ, so a forked server behaves
as a started one; what a fresh interpreter would draw anew (Python's and numpy's random
state) is drawn anew in the fork.

The launcher reads one JSON request per line on its stdin and answers one JSON line on its
stdout: ``{"op": "start", "module", "args", "log_path", "new_session", "late_env"}`` ->
``{"pid"}``;
``{"op": "poll", "pid"}`` -> ``{"returncode"}`` (None while it runs; ``-N`` for signal N, as
``subprocess`` reports it). It has no thread of its own to fork beside, and each server it
forks receives SIGTERM if it ends (Linux). When its stdin closes (the test process ended,
however it ended) it stops every server it started and exits.

    python -m spexis_sglang.preloaded_launcher MODULE [MODULE ...]   # the modules to preload
"""

from __future__ import annotations

import atexit
import importlib
import json
import os
import random
import runpy
import signal
import subprocess
import sys
import threading
import time
import traceback
from typing import Dict, List, Optional

import psutil

# what ``python -m spexis_sglang.launch_server`` imports before it reads its arguments
SERVER_MODULES = ("sglang.srt.entrypoints.http_server", "spexis_sglang.srt.launch")
# environment variables a forked server may have of its own: read only by modules the launcher
# has not imported (it checks), so the fork reads its own value as a new process would.
# SGLANG_DISABLED_MODEL_ARCHS: read when SGLang's model registry is imported, at model load.
# PYTEST_CURRENT_TEST (None: no module reads it): pytest sets it to each test's name, so
# compared, it kept every server of a test suite but those of the launcher's first test from
# being forked.
LATE_READ_ENV = {
    "SGLANG_DISABLED_MODEL_ARCHS": "sglang.srt.models.registry",
    "PYTEST_CURRENT_TEST": None,
}
# how long the launcher waits for its servers to end on SIGTERM before it kills them
STOP_WAIT_S = 30.0


class LauncherGone(RuntimeError):
    pass


class PreloadedLauncher:
    """The test process's end of a preloaded launcher (a ``subprocess`` of it)."""

    def __init__(
        self,
        env: Dict[str, str],
        modules=SERVER_MODULES,
        cwd: Optional[str] = None,
        stderr_path: Optional[str] = None,
    ):
        self.env = dict(env)
        self.cwd = os.path.abspath(cwd or os.getcwd())
        self._lock = threading.Lock()
        self._stderr = open(stderr_path or os.devnull, "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", __name__, *modules],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            env=self.env,
            cwd=self.cwd,
            text=True,
            bufsize=1,
        )
        self.pid = self.proc.pid
        hello = self._ask(None)  # its modules are imported once it says so
        # the variables a fork may set to its own value (none the launcher's imports read)
        self.late_read = frozenset(hello["late_read"])

    def serves(self, env: Dict[str, str], cwd: str) -> bool:
        """Whether a server with this environment and working directory can be forked here:
        the launcher's, but for the variables in ``late_read``."""

        def fixed(e: Dict[str, str]) -> Dict[str, str]:
            return {k: v for k, v in e.items() if k not in self.late_read}

        same = fixed(env) == fixed(self.env) and os.path.abspath(cwd) == self.cwd
        return same and self.alive()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def _ask(self, request: Optional[dict]) -> dict:
        with self._lock:
            try:
                if request is not None:
                    self.proc.stdin.write(json.dumps(request) + "\n")
                    self.proc.stdin.flush()
                line = self.proc.stdout.readline()
            except (BrokenPipeError, ValueError) as e:
                raise LauncherGone(f"preloaded launcher {self.pid} is gone: {e}") from None
        if not line:
            raise LauncherGone(f"preloaded launcher {self.pid} exited ({self.proc.poll()})")
        return json.loads(line)

    def start(
        self,
        module: str,
        args: List[str],
        log_path: str,
        new_session: bool = True,
        env: Optional[Dict[str, str]] = None,
    ) -> "ForkedProcess":
        """A server forked from the launcher: ``python -m module args`` writing to ``log_path``
        (appended), in a session of its own or leading its own process group, with ``env``'s
        values of the ``late_read`` variables (``env`` must be one the launcher ``serves``)."""
        env = self.env if env is None else env
        reply = self._ask(
            {
                "op": "start",
                "module": module,
                "args": list(args),
                "log_path": log_path,
                "new_session": new_session,
                "late_env": {k: env.get(k) for k in self.late_read},
            }
        )
        return ForkedProcess(self, int(reply["pid"]))

    def returncode(self, pid: int) -> Optional[int]:
        return self._ask({"op": "poll", "pid": pid})["returncode"]

    def close(self) -> None:
        """End the launcher and every server it started."""
        if self.proc.stdin and not self.proc.stdin.closed:
            try:
                self.proc.stdin.close()
            except BrokenPipeError:
                pass
        try:
            self.proc.wait(timeout=STOP_WAIT_S + 10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._stderr.close()


class ForkedProcess:
    """What :class:`ServerProcess` needs of a ``subprocess.Popen``, for a forked server."""

    def __init__(self, launcher: PreloadedLauncher, pid: int):
        self.pid = pid
        self.returncode: Optional[int] = None
        self._launcher = launcher

    def poll(self) -> Optional[int]:
        if self.returncode is None:
            try:
                self.returncode = self._launcher.returncode(self.pid)
            except LauncherGone:  # its servers got SIGTERM with it
                self.returncode = -signal.SIGTERM if not psutil.pid_exists(self.pid) else None
        return self.returncode

    def wait(self, timeout: Optional[float] = None) -> int:
        deadline = None if timeout is None else time.time() + timeout
        while self.poll() is None:
            if deadline is not None and time.time() > deadline:
                raise subprocess.TimeoutExpired(f"forked server {self.pid}", timeout)
            time.sleep(0.05)
        return self.returncode


# ------------------------------------------------------------------------------ the launcher


def terminate_with_parent() -> None:
    """In a child process (Linux): SIGTERM when its parent dies (prctl PR_SET_PDEATHSIG)."""
    if sys.platform.startswith("linux"):
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def _run_server(request: dict, close_fds: List[int]) -> None:
    """In the fork: become ``python -m module args`` and never return."""
    code = 1
    try:
        for fd in close_fds:
            os.close(fd)
        if request["new_session"]:
            os.setsid()
        else:
            os.setpgid(0, 0)
        terminate_with_parent()
        null = os.open(os.devnull, os.O_RDONLY)
        log = os.open(request["log_path"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.dup2(null, 0)  # the launcher's stdin is the request pipe
        os.dup2(log, 1)
        os.dup2(log, 2)
        for fd in (null, log):
            if fd > 2:
                os.close(fd)
        for key, value in request["late_env"].items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        random.seed()  # a fresh interpreter's state, not the launcher's copy
        if "numpy" in sys.modules:
            sys.modules["numpy"].random.seed()
        sys.argv = [request["module"], *request["args"]]
        runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:  # as the interpreter does: the message to stderr, exit status 1
            print(e.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
    finally:
        try:
            atexit._run_exitfuncs()  # what the interpreter runs on its way out
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _reap(children: Dict[int, Optional[int]]) -> None:
    for pid, code in children.items():
        if code is None:
            try:
                done, status = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                children[pid] = -1
                continue
            if done:
                children[pid] = os.waitstatus_to_exitcode(status)


def _stop_all(children: Dict[int, Optional[int]]) -> None:
    _reap(children)
    running = [pid for pid, code in children.items() if code is None]
    for pid in running:
        try:
            os.killpg(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.time() + STOP_WAIT_S
    while time.time() < deadline:
        _reap(children)
        if all(children[pid] is not None for pid in running):
            return
        time.sleep(0.1)
    for pid in running:
        if children[pid] is None:
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def main(modules: List[str]) -> int:
    # replies go to the pipe the test process reads; anything else printed goes to stderr
    replies = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    from spexis_sglang.cpu_support import activate, single_threaded_torch

    if activate():  # as the launcher does first: before any sglang/transformers import
        single_threaded_torch()
    for name in modules:
        importlib.import_module(name)
    late_read = [
        k for k, reader in LATE_READ_ENV.items() if reader is None or reader not in sys.modules
    ]
    replies.write(json.dumps({"pid": os.getpid(), "late_read": late_read}) + "\n")
    children: Dict[int, Optional[int]] = {}
    for line in sys.stdin:
        request = json.loads(line)
        _reap(children)
        if request["op"] == "start":
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                _run_server(request, [replies.fileno()])
            children[pid] = None
            answer = {"pid": pid}
        elif request["op"] == "poll":
            answer = {"returncode": children.get(int(request["pid"]), -1)}
        else:
            answer = {"error": f"unknown op {request['op']!r}"}
        replies.write(json.dumps(answer) + "\n")
    _stop_all(children)  # the test process ended: its servers end with it
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
