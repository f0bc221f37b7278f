"""hooks.fork_subprocesses_on_cpu: SGLang's start method, then fork (no server started)."""

from __future__ import annotations

import multiprocessing as mp

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
