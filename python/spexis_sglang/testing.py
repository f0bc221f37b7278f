"""Start and stop real servers of ``python -m spexis_sglang.launch_server`` (tests, benchmarks).

The server is a real process tree; :class:`ServerProcess` waits for ``/health_generate``
while checking that the process is still alive, so a crash at start-up fails at once with the
end of its log instead of costing the whole timeout.
"""

from __future__ import annotations

import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Optional

import requests


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerDied(RuntimeError):
    pass


class ServerProcess:
    """One ``spexis_sglang.launch_server`` process on ``127.0.0.1:port``."""

    def __init__(
        self,
        args: List[str],
        port: Optional[int] = None,
        env: Optional[Dict[str, str]] = None,
        log_path: Optional[str] = None,
        module: str = "spexis_sglang.launch_server",
    ):
        self.port = port or free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        # SPEXIS_TEST_SERVER_ARGS: appended to every server, e.g. the GPU machine's required
        # flags when the end-to-end suite runs there (benchmark/gpu/README.md).
        self.args = list(args) + shlex.split(os.environ.get("SPEXIS_TEST_SERVER_ARGS", ""))
        self.log_path = log_path or tempfile.mktemp(
            prefix=f"spexis-server-{self.port}-", suffix=".log"
        )
        cmd = [
            sys.executable,
            "-m",
            module,
            *self.args,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
        ]
        self._log = open(self.log_path, "w")
        self.started_at = time.time()
        self.proc = subprocess.Popen(
            cmd,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
            start_new_session=True,
        )
        self.ready_after: Optional[float] = None

    def log_tail(self, n: int = 40) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return "".join(f.readlines()[-n:])
        except OSError:
            return ""

    def wait_ready(self, timeout: float = 600.0) -> "ServerProcess":
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise ServerDied(
                    f"server exited with {self.proc.returncode} during start-up; log {self.log_path}:\n"
                    + self.log_tail()
                )
            try:
                r = requests.get(self.base_url + "/health_generate", timeout=30)
                if r.status_code == 200:
                    self.ready_after = time.time() - self.started_at
                    return self
            except requests.RequestException:
                pass
            time.sleep(2)
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

    def generate(self, payload: dict, timeout: float = 600.0) -> dict:
        r = requests.post(self.base_url + "/generate", json=payload, timeout=timeout)
        r.raise_for_status()
        return r.json()

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
