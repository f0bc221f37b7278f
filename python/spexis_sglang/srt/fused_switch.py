"""Whether one of our fused Triton kernels runs (:class:`FusedSwitch`).

Each kernel has PyTorch's ops beside it, which a CPU always runs. On a GPU the kernel runs
unless its environment switch is ``"0"`` (to time one against the other); where Triton cannot
compile or launch it, the server says so once and runs the ops from then on instead of failing
its requests.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional

from spexis_sglang.srt.config import env_value

logger = logging.getLogger(__name__)


class FusedSwitch:
    """``on`` unless the environment variable ``env`` is ``"0"`` or the kernel has failed.
    ``what``: the kernel, ``instead``: what the ops then do, for the log line."""

    def __init__(self, env: str, what: str, instead: str) -> None:
        self.on = env_value(env) != "0"
        self.what = what
        self.instead = instead

    def run(self, kernel: Callable[..., Any], *args, **kwargs) -> Optional[Any]:
        """``kernel(*args, **kwargs)``, or None where it failed (and the switch is off)."""
        try:
            return kernel(*args, **kwargs)
        except Exception as e:  # a compiler or driver error, not a wrong result
            self.on = False
            logger.warning(
                "Spexis: the %s failed on this GPU (%s: %s); %s with PyTorch's ops instead",
                self.what,
                type(e).__name__,
                e,
                self.instead,
            )
            return None
