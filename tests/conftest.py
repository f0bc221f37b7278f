"""Test-wide set-up: the CPU environment must be active before torch/transformers/sglang load."""

from spexis_sglang.cpu_support import activate

activate()
