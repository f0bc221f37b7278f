"""``python -m spexis_sglang.launch_server``: SGLang's server with Spexis' scheduler hooks.

Accepts every SGLang server argument plus the ``--spexis-*`` flags (``--help`` lists them).
Without ``--model-path`` it serves the bundled default model (converted on first use) under
the name ``smollm2-135m-instruct``. On a machine without CUDA it turns on SGLang's CPU engine
and picks defaults that work there; every server bounds what one request may ask and how many
requests may wait (``docs/limits-and-errors.md``). The launcher itself is
:mod:`spexis_sglang.srt.launch`.
"""

import sys

from spexis_sglang.srt.launch import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
