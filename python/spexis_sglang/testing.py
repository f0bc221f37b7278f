"""Start and stop real servers of ``python -m spexis_sglang.launch_server`` (tests, benchmarks).

The server is a real process tree; :class:`ServerProcess` waits for SGLang's "ready" log line
(its warm-up request answered) while checking that the process is still alive, so a crash at
start-up fails at once with the end of its log instead of costing the whole timeout.
"""

from __future__ import annotations

import atexit
import os
import random
import re
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from typing import Dict, List, Optional

import requests

from spexis_sglang.preloaded_launcher import PreloadedLauncher, terminate_with_parent
from spexis_sglang.srt.config import ENV_TEST_SERVER_ARGS

# HTTP ports are picked below Linux's ephemeral range (32768+): while a server loads, SGLang's
# processes bind ephemeral ports of their own (NCCL / gloo, port 0), and a port picked there can
# be taken by the time uvicorn binds it (seen in CI: Errno 98, then a 600 s wait).
PORT_RANGE = (20000, 32000)
# a port taken during start-up: uvicorn's HTTP port, or the torch.distributed rendezvous port
# SGLang picks itself (``nccl_port``: an ephemeral port found free, closed, and bound again
# later, which a process starting beside it can take meanwhile; seen in CI). The server then
# restarts on another HTTP port, and SGLang picks its rendezvous port anew.
_BIND_FAILED = ("error while attempting to bind on address", "EADDRINUSE")
# SGLang logs this once its own warm-up request has been answered (server status Up)
_READY_LINE = "The server is fired up and ready to roll!"
# seconds between readiness checks (each reads the log; a check that finds the server up costs
# nothing more, so a short interval only trims the wait after the warm-up)
READY_POLL_S = 0.25
# /health_generate is asked only this often: once the server is up it takes a second or more
# (SGLang generates a token and polls for it every second)
_HEALTH_GENERATE_EVERY_S = 2.0

# SGLang's defaults that cost a stop 5 s: stopping the process group ends the schedulers and
# the detokenizer, the HTTP process takes that for a crash and sleeps 5 s before py-spy / CUDA
# core dumps of schedulers that are already gone. A caller's environment still wins.
QUIET_SHUTDOWN_ENV = {
    "SGLANG_PYSPY_DUMP_BEFORE_CRASH": "0",
    "SGLANG_CUDA_COREDUMP_BEFORE_CRASH": "0",
}

# a retraction as a server's log reports it: Spexis logs one line per retracted request, stock
# SGLang one line per event with the count ("KV cache pool is full. Retract requests.
# #retracted_reqs: N, ..."); a side-by-side must count both, or stock reads 0
SPEXIS_RETRACT_LINE = "KV cache pool is full, retracting request"
_STOCK_RETRACT = re.compile(r"KV cache pool is full\. Retract requests\. #retracted_reqs: (\d+)")


# a log line of a scheduler other than its replica's first stage and first TP rank (SGLang's
# prefix, e.g. "[2026-12-02 14:43:21 PP1 TP0] "): every rank of a pipeline logs the same
# retraction, so only the first counts
_OTHER_RANK = re.compile(r"^\[[^\]]*\b(?:PP|TP)[1-9]\d*\b[^\]]*\]")


def count_retractions(log_text: str) -> int:
    """Requests retracted (evicted, to be recomputed) according to a server log: each once,
    from its replica's first stage and first TP rank (the other ranks log the same event)."""
    lines = [ln for ln in log_text.splitlines() if not _OTHER_RANK.match(ln)]
    text = "\n".join(lines)
    stock = sum(int(n) for n in _STOCK_RETRACT.findall(text))
    return text.count(SPEXIS_RETRACT_LINE) + stock


def repo_relative(path: str) -> str:
    """``path`` as a benchmark result records it: relative to the repository (the working
    directory benchmarks run from) when inside it, else its file name. Results never record a
    machine's paths."""
    here = os.path.abspath(".")
    path = os.path.abspath(path)
    return os.path.relpath(path, here) if path.startswith(here + os.sep) else os.path.basename(path)


def recorded_args(args: List[str]) -> List[str]:
    """A command line as a result records it: every absolute path through :func:`repo_relative`."""
    return [repo_relative(a) if os.path.isabs(a) else a for a in args]


def free_port() -> int:
    rng = random.SystemRandom()
    for _ in range(100):
        port = rng.randrange(*PORT_RANGE)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def exact_test_args() -> List[str]:
    """Server arguments under which greedy outputs do not depend on how requests are batched.

    On CPU, ``--spexis-float64``: a row's logits then move by ~1e-16 (not ~1e-7) when the batch
    around it changes, so plain SGLang and Spexis agree token for token (docs/losslessness.md,
    ``benchmark/correctness/batch_noise.py``). On a GPU the caller's ``SPEXIS_TEST_SERVER_ARGS``
    bring ``--enable-deterministic-inference`` (batch-invariant kernels) instead.
    """
    from spexis_sglang.cpu_support import cuda_available

    return [] if cuda_available() else ["--spexis-float64"]


# this process's preloaded launcher: made for the environment of the first server that asks
# for one (a test suite's servers nearly all share theirs), kept until the process exits
_launcher = None
_launcher_lock = threading.Lock()


def _preloaded_launcher(env: Dict[str, str]):
    """The preloaded launcher that can fork a server with ``env`` here, or None."""
    global _launcher
    with _launcher_lock:
        if _launcher is None:
            stderr = tempfile.mktemp(prefix=f"spexis-preloaded-{os.getpid()}-", suffix=".log")
            _launcher = PreloadedLauncher(env, stderr_path=stderr)
            atexit.register(_launcher.close)
        return _launcher if _launcher.serves(env, os.getcwd()) else None


class ServerDied(RuntimeError):
    pass


class ServerProcess:
    """One ``spexis_sglang.launch_server`` process on ``127.0.0.1:port``."""

    # every process started, as its arguments (the test suite reports launches per file)
    launches: List[List[str]] = []

    def __init__(
        self,
        args: List[str],
        port: Optional[int] = None,
        env: Optional[Dict[str, str]] = None,
        log_path: Optional[str] = None,
        module: str = "spexis_sglang.launch_server",
        new_session: bool = True,
        die_with_parent: bool = False,
        preloaded: bool = False,
    ):
        """``new_session``: the server in a session of its own; False keeps it in the caller's
        session, so it ends with the caller's command (the GPU machines' benchmarks). Either
        way it leads its own process group, which :meth:`stop` ends. ``die_with_parent``
        (Linux): the server is sent SIGTERM, which stops its whole tree, when the process that
        started it dies, even by SIGKILL (a test run killed by a timeout leaves no server
        behind); the starting thread must live as long as the server. ``preloaded`` (with
        ``die_with_parent``): forked from this process's preloaded launcher
        (:mod:`spexis_sglang.preloaded_launcher`, started by the first such server; ~8 s of
        CPU less per start) when the server's environment and working directory are the
        launcher's; a new process otherwise."""
        # SPEXIS_TEST_SERVER_ARGS: appended to every server, e.g. the GPU machine's required
        # flags when the end-to-end suite runs there (benchmark/gpu/README.md).
        self.args = list(args) + shlex.split(os.environ.get(ENV_TEST_SERVER_ARGS, ""))
        self._fixed_port, self._fixed_log = port, log_path
        self._env, self._module = env, module
        self._new_session = new_session
        self._die_with_parent = die_with_parent
        self._preloaded = preloaded and die_with_parent
        self._launch(port or free_port(), log_path)

    def _launch(self, port: int, log_path: Optional[str]) -> None:
        self.port = port
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path or tempfile.mktemp(
            prefix=f"spexis-server-{self.port}-", suffix=".log"
        )
        self.cmd = [
            sys.executable,
            "-m",
            self._module,
            *self.args,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
        ]
        self._log = open(self.log_path, "w")
        self._log.write("+ " + " ".join(self.cmd) + "\n")
        self._log.flush()
        ServerProcess.launches.append(list(self.args))
        self.started_at = time.time()
        env = {**QUIET_SHUTDOWN_ENV, **os.environ, **(self._env or {})}
        launcher = _preloaded_launcher(env) if self._preloaded else None
        if launcher is not None:
            self._log.write("+ (forked from preloaded launcher %d)\n" % launcher.pid)
            self._log.flush()
            self.proc = launcher.start(
                self._module, self.cmd[3:], self.log_path, self._new_session, env
            )
            self.ready_after = None
            return
        session = {"start_new_session": True} if self._new_session else {"process_group": 0}
        if self._die_with_parent and sys.platform.startswith("linux"):
            session["preexec_fn"] = terminate_with_parent  # before exec
        self.proc = subprocess.Popen(
            self.cmd,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=env,
            **session,
        )
        self.ready_after: Optional[float] = None

    def log_tail(self, n: int = 40) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return "".join(f.readlines()[-n:])
        except OSError:
            return ""

    def _log_text(self) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return f.read()
        except OSError:
            return ""

    def _health_generate_ok(self) -> bool:
        try:
            r = requests.get(self.base_url + "/health_generate", timeout=30)
            return r.status_code == 200
        except requests.RequestException:
            return False

    def wait_ready(self, timeout: float = 600.0, bind_retries: int = 2) -> "ServerProcess":
        """Wait until SGLang reports its warm-up request answered (its log line, read every
        ``READY_POLL_S``; ``/health_generate`` for a server that logs no such line)."""
        deadline = time.time() + timeout
        next_health = time.time()
        while time.time() < deadline:
            log = self._log_text()
            if any(m in log for m in _BIND_FAILED):
                self.stop()
                if bind_retries <= 0 or self._fixed_port is not None:
                    raise ServerDied(
                        f"port {self.port} was taken during start-up; log {self.log_path}:\n"
                        + self.log_tail()
                    )
                # another process took the port while the model loaded: start again elsewhere
                self._launch(free_port(), self._fixed_log)
                return self.wait_ready(max(60.0, deadline - time.time()), bind_retries - 1)
            if self.proc.poll() is not None:
                raise ServerDied(
                    f"server exited with {self.proc.returncode} during start-up; "
                    f"log {self.log_path}:\n" + self.log_tail()
                )
            ready = _READY_LINE in log
            if not ready and time.time() >= next_health:
                ready = self._health_generate_ok()
                next_health = time.time() + _HEALTH_GENERATE_EVERY_S
            if ready:
                self.ready_after = time.time() - self.started_at
                return self
            time.sleep(READY_POLL_S)
        self.stop()
        raise TimeoutError(
            f"server not ready after {timeout:.0f} s; log {self.log_path}:\n" + self.log_tail()
        )

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout=30)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                pass
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait()
        self._log.close()

    # -- requests ---------------------------------------------------------------------------

    def get_json(self, path: str, timeout: float = 60.0):
        r = requests.get(self.base_url + path, timeout=timeout)
        r.raise_for_status()
        return r.json()

    def post_json(self, path: str, payload, timeout: float = 600.0):
        r = requests.post(self.base_url + path, json=payload, timeout=timeout)
        r.raise_for_status()
        return r.json()

    def server_info(self, timeout: float = 60.0) -> dict:
        """SGLang's ``/server_info`` (Spexis' counters: ``internal_states[0]["spexis"]``)."""
        return self.get_json("/server_info", timeout)

    def generate(self, payload: dict, timeout: float = 600.0) -> dict:
        return self.post_json("/generate", payload, timeout)

    def greedy_ids(
        self, prompts_ids: List[List[int]], max_new_tokens: int, **params
    ) -> List[List[int]]:
        """Output token ids of a batch of token-id prompts under greedy decoding."""
        sampling = {
            "temperature": 0.0,
            "max_new_tokens": max_new_tokens,
            "ignore_eos": True,
            **params,
        }
        out = self.generate({"input_ids": prompts_ids, "sampling_params": sampling})
        return [o["output_ids"] for o in out]
