"""Start-up hooks for every Python process of the CPU environment (spawned schedulers too).

Lives next to the ``sgl_kernel`` stand-in, on ``PYTHONPATH`` only in the CPU environment.
"""

from spexis_sglang.cpu_support import install_startup_hooks

install_startup_hooks()
