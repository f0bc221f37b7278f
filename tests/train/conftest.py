"""CPU set-up first (before torch/transformers load), and a small thread count on the shared box."""

from spexis_sglang.cpu_support import activate

activate()

import torch  # noqa: E402

torch.set_num_threads(1)
