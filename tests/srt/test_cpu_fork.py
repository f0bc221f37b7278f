"""hooks.fork_subprocesses_on_cpu: SGLang's start method, then fork (no server started)."""

from __future__ import annotations

import multiprocessing as mp
import os

from spexis_sglang.srt import hooks


def test_fork_follows_the_spawn_sglang_sets(monkeypatch):
    from sglang.srt.entrypoints import engine

    methods = []
    monkeypatch.setattr(mp, "set_start_method", lambda method, force=False: methods.append(method))
    monkeypatch.setattr(
        engine, "_set_envs_and_config", lambda server_args: mp.set_start_method("spawn", True)
    )
    hooks.fork_subprocesses_on_cpu()
    engine._set_envs_and_config(None)
    assert methods == ["spawn", "fork"]


def test_the_cpu_launcher_runs_torch_in_one_thread():
    """The launcher finds out whether a GPU is there by importing torch, before the CPU
    environment's OMP_NUM_THREADS=1 could apply: it must still leave torch (and the schedulers
    it forks) with one intra-op thread, or idle OpenMP threads spin on the shared cores and
    every small operator costs several times its CPU time."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith("OMP_")}
    env.pop("SPEXIS_CPU_SUPPORT", None)
    code = (
        "import os, torch\n"
        "from spexis_sglang import launch_server\n"
        "torch.set_num_threads(2)\n"  # what importing torch gives on a 2-core box
        "assert launch_server.main(['--help']) == 0\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    os._exit(0 if torch.get_num_threads() == 1 else 3)\n"
        "_, status = os.waitpid(pid, 0)\n"
        "print(torch.get_num_threads(), os.waitstatus_to_exitcode(status))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[-2:] == ["1", "0"]  # after the --help text
