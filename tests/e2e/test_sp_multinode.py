"""SP across machines: SGLang's own multi-node launch, one pipeline stage per node.

Two ``spexis_sglang.launch_server`` processes with ``--nnodes 2 --node-rank R --dist-init-addr``
play the two machines (gloo over loopback): node 0 serves HTTP and runs stage 0 with the draft
head, node 1 runs stage 1. Greedy outputs equal plain SGLang's. (On one machine node 1 needs its
own ``--port``: SGLang starts a dummy health server there on every node but the first.)
"""

from __future__ import annotations

import pytest

from spexis_sglang.srt.relay import RELAY_LOG_LINE
from spexis_sglang.testing import ServerProcess, free_port

from .conftest import exact, room_to_start, server_env
from .prompts import lossless_prompts
from .test_sp_lossless import BASELINE, sp_args, spexis_stats, trained_head  # noqa: F401

pytestmark = pytest.mark.e2e


def test_sp_over_two_nodes_equals_plain(server_factory, model_dir, trained_head):
    prompts = lossless_prompts(model_dir, 8)
    expected = server_factory(BASELINE).greedy_ids(prompts, 32)
    dist = ["--nnodes", "2", "--dist-init-addr", f"127.0.0.1:{free_port()}"]
    args = exact(sp_args(2, trained_head, *dist))
    node0 = node1 = None
    try:
        with room_to_start():
            # no HTTP API: stage 1 only
            node1 = ServerProcess(
                args + ["--node-rank", "1"], env=server_env(), die_with_parent=True, preloaded=True
            )
            node0 = ServerProcess(
                args + ["--node-rank", "0"], env=server_env(), die_with_parent=True, preloaded=True
            ).wait_ready()
        got = node0.greedy_ids(prompts, 32)
        stats = spexis_stats(node0)
        assert node1.alive()
    finally:
        for node in (node0, node1):
            if node is not None:
                node.stop()
    assert got == expected
    assert stats["rows_spec"] > 0 and stats["accepted"] > 0  # it speculated across the nodes
    # across nodes the relay stays SGLang's (gloo): no local pipe
    for node in (node0, node1):
        with open(node.log_path) as f:
            assert RELAY_LOG_LINE not in f.read()
