"""Stock SGLang scheduling with the draft head on stage 0 (a developer and test tool).

``SPEXIS_DRAFT_HEAD=<artifact dir or random:SEED> python -m spexis_sglang.draft_head_server
[sglang args]``: every stage-0 forward also runs the draft head and sends its drafts
downstream, where nobody consumes them (``srt/draft_runner.py``). A baseline for the head's
cost, and the test bed for the head itself (``tests/srt/test_draft_model.py``).
"""

import sys

from spexis_sglang.srt.launch import draft_head_main as main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
