"""Prompt data for training and evaluating the draft head and the length predictor.

Everything comes from PyPI packages that ship data files (no hub access here); files are
located with :func:`importlib.util.find_spec` so that no package ``__init__`` runs.
"""

from spexis_sglang.data.mix import CATEGORIES, evaluation_mix  # noqa: F401
from spexis_sglang.data.sources import SOURCES, Prompt, load_source  # noqa: F401
from spexis_sglang.data.splits import SPLITS, split_of, training_prompts  # noqa: F401
