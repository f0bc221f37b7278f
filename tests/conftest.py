"""Test-wide set-up: the CPU environment must be active before torch/transformers/sglang load."""

from spexis_sglang.cpu_support import activate

activate()

# Property tests draw the same examples on every run (a test that fails on noise blocks
# everyone): hypothesis derives each test's seed from the test itself.
from hypothesis import settings  # noqa: E402

settings.register_profile("spexis", derandomize=True, print_blob=True)
settings.load_profile("spexis")
