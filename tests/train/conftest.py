"""CPU set-up first (before torch/transformers load), and a small thread count on the shared box."""

from spexis_sglang.cpu_support import activate

activate()

import torch  # noqa: E402

torch.set_num_threads(1)

import pytest  # noqa: E402

from .tiny_base import make_base  # noqa: E402


@pytest.fixture(scope="module")
def base():
    """A tiny trained base model, one per test module (tests may change its state)."""
    return make_base()
