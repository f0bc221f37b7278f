"""Stock SGLang scheduling with the draft head on stage 0 (a developer and test tool).

``SPEXIS_DRAFT_HEAD=<artifact dir or random:SEED> python -m spexis_sglang.draft_head_server
[sglang args]``: every stage-0 forward also runs the draft head and sends its drafts
downstream, where nobody consumes them (``srt/draft_runner.py``). A baseline for the head's
cost, and the test bed for the head itself (``tests/srt/test_draft_model.py``).
"""

from __future__ import annotations

import os
import sys
from typing import List, Optional

from spexis_sglang.cpu_support import activate

PROG = "python -m spexis_sglang.draft_head_server"


def main(argv: Optional[List[str]] = None) -> int:
    from spexis_sglang import launch_server as spexis_launch
    from spexis_sglang.srt.config import ENV_DRAFT_HEAD

    argv = sys.argv[1:] if argv is None else list(argv)
    on_cpu = activate()
    if not os.environ.get(ENV_DRAFT_HEAD):
        print(
            f"{PROG}: error: set {ENV_DRAFT_HEAD} (artifact dir or random:<seed>)", file=sys.stderr
        )
        return 2
    try:
        argv = spexis_launch.prepare_argv(argv, on_cpu)
    except Exception as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    from sglang.srt.entrypoints.http_server import launch_server
    from sglang.srt.server_args import prepare_server_args
    from sglang.srt.utils import kill_process_tree

    from spexis_sglang.srt.draft_runner import run_draft_head_scheduler_process

    server_args = prepare_server_args(argv)
    try:
        launch_server(server_args, run_scheduler_process_func=run_draft_head_scheduler_process)
    finally:
        kill_process_tree(os.getpid(), include_parent=False)
    return 0


if __name__ == "__main__":
    # Run through the importable module so that spawn pickles the scheduler function by name.
    from spexis_sglang import draft_head_server as _module

    sys.exit(_module.main())
