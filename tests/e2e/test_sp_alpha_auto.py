"""``--spexis-alpha auto`` on a real CPU server: greedy outputs stay plain SGLang's, and the
alpha the online chooser put in force is reported (``/server_info``, ``/metrics``) and lies on
the chooser's grid. Under the benchmarks' timers the later stage's state reaches the log (what
``benchmark/gpu/decode_throughput.py`` reads it from)."""

from __future__ import annotations

import os
import sys
import time

import pytest
import requests

from spexis_sglang.core.selection import ONLINE_ALPHA_GRID

from .compare import compare_outputs
from .prompts import lossless_prompts
from .test_sp_lossless import BASELINE, sp_args

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmark", "gpu"))
import decode_throughput  # noqa: E402

pytestmark = pytest.mark.e2e

AUTO = ["--spexis-alpha", "auto", "--spexis-alpha-interval", "10", "--enable-metrics"]


def test_alpha_auto_greedy_equals_plain_and_alpha_is_reported(server_factory, model_dir):
    prompts = lossless_prompts(model_dir, 8)
    expected = server_factory(BASELINE).greedy_ids(prompts, 40)
    # the benchmarks' timers: the later stage logs its state on each /server_info
    sp_server = server_factory(sp_args(2, "bundled", *AUTO), env={"SPEXIS_PHASE_TIMERS": "1"})
    got = sp_server.greedy_ids(prompts, 40)
    cmp = compare_outputs(model_dir, prompts, expected, got)
    print("default model, PP=2 SP alpha auto vs PP=1 plain:", cmp.summary())

    state = requests.get(sp_server.base_url + "/server_info", timeout=60).json()
    stats = state["internal_states"][0]["spexis"]
    live = state["internal_states"][0]["spexis_alpha"]
    print(
        f"alpha {stats['alpha']}, choices {live['choices']}, changes {live['changes']}, "
        f"explore iterations {live['explore_iterations']}, history {live['history']}, "
        f"profile {live['profile']}, latency {live['latency']}"
    )
    assert cmp.all_identical, cmp.summary()
    assert live["mode"] == "auto" and live["alpha"] == stats["alpha"]
    assert stats["alpha"] in ONLINE_ALPHA_GRID
    assert all(a in ONLINE_ALPHA_GRID for _, a in live["history"])
    # it measured, explored and chose: verdicts by rank, iteration times, alpha-0 iterations
    assert live["verdicts"] > 0 and live["samples"] > 0
    assert stats["alpha_explore_iterations"] == live["explore_iterations"] > 0
    assert stats["alpha_probe_iterations"] == live["probe_iterations"]
    assert live["choices"] > 0
    assert stats["drafts_dropped"] > 0  # it starts at 0.15: drops happened
    metrics = requests.get(sp_server.base_url + "/metrics", timeout=60).text
    line = next(m for m in metrics.splitlines() if m.startswith("spexis:alpha{"))
    assert float(line.rsplit(" ", 1)[1]) == stats["alpha"]

    # stage 1's reply to /server_info is dropped: it logged its state instead, and the two
    # stages ran the same batches (the states are mirrored)
    later = {}
    for _ in range(50):
        later = decode_throughput.rank_states(sp_server.log_path)
        if later.get("pp rank 1"):
            break
        time.sleep(0.1)
    stage1 = later["pp rank 1"][-1]["spexis"]
    for key in ("decode_iterations", "rows_normal", "rows_spec", "drafts_dropped"):
        assert stage1[key] == stats[key], key
    assert stage1["time_busy_s"] > 0 and stage1["cpu_launch_s"] > 0
