"""Test-wide set-up: the CPU environment must be active before torch/transformers/sglang load."""

import os

import pytest

from spexis_sglang.cpu_support import activate

# the environment as the user's shell gave it, before activate() changes it for this process
# and its children (a test that runs a program the way a user would starts it with this)
_USER_ENV = dict(os.environ)
activate()

# Property tests draw the same examples on every run (a test that fails on noise blocks
# everyone): hypothesis derives each test's seed from the test itself.
from hypothesis import settings  # noqa: E402

settings.register_profile("spexis", derandomize=True, print_blob=True)
settings.load_profile("spexis")


@pytest.fixture(scope="session")
def user_env() -> dict:
    """The environment the test run started with, before the CPU support was activated."""
    return dict(_USER_ENV)
