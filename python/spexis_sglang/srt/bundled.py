"""Resolve ``--spexis-draft-head bundled`` (and ``--spexis-length-predictor bundled``) to the
trained artifacts shipped for the served model.

Heads live in ``spexis_sglang/artifacts/<model>/draft-exit<L>/``; the exit layer ``L`` must be
stage 0's depth, which depends on ``--pp-size`` (and ``SGLANG_PP_LAYER_PARTITION``).
"""

from __future__ import annotations

import os
from typing import List

from spexis_sglang.srt.model_files import read_model_config

ARTIFACTS_DIR = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "artifacts"
)
# config fingerprints are checked at load time; here we only need to find the folder
_MODEL_FOLDERS = {"smollm2-135m-instruct": "smollm2-135m-instruct"}


class BundledHeadError(ValueError):
    pass


def stage0_end_layer(num_layers: int, pp_size: int) -> int:
    """Stage 0's last layer + 1, as SGLang splits layers over pipeline stages (with
    ``SGLANG_PP_LAYER_PARTITION`` when set)."""
    from sglang.srt.distributed.utils import get_pp_indices

    return get_pp_indices(num_layers, 0, pp_size)[1]


def _model_folder(model_path: str) -> str:
    name = os.path.basename(os.path.normpath(model_path)).lower()
    if name in _MODEL_FOLDERS:
        return os.path.join(ARTIFACTS_DIR, _MODEL_FOLDERS[name])
    raise BundledHeadError(
        f"no bundled draft head for the model at {model_path!r} (bundled: "
        f"{', '.join(sorted(_MODEL_FOLDERS))}); pass --spexis-draft-head DIR"
    )


def available_exits(model_path: str) -> List[int]:
    folder = _model_folder(model_path)
    if not os.path.isdir(folder):
        return []
    return sorted(
        int(d[len("draft-exit") :])
        for d in os.listdir(folder)
        if d.startswith("draft-exit") and d[len("draft-exit") :].isdigit()
    )


def bundled_draft_head(model_path: str, pp_size: int) -> str:
    """The shipped head directory whose exit layer is stage 0's depth for this ``pp_size``."""
    try:
        num_layers = read_model_config(model_path)["num_hidden_layers"]
    except (OSError, ValueError, KeyError) as e:
        raise BundledHeadError(f"cannot read the model's layer count: {e}") from None
    exit_layer = stage0_end_layer(num_layers, pp_size)
    path = os.path.join(_model_folder(model_path), f"draft-exit{exit_layer}")
    if not os.path.isfile(os.path.join(path, "model.safetensors")):
        have = available_exits(model_path)
        raise BundledHeadError(
            f"no bundled draft head at exit layer {exit_layer} (stage 0's depth with "
            f"--pp-size {pp_size}); bundled exits: {have or 'none'}. Set "
            "SGLANG_PP_LAYER_PARTITION so stage 0 ends at a bundled exit, or pass "
            "--spexis-draft-head DIR"
        )
    return path


def bundled_length_predictor(model_path: str) -> str:
    """The remaining-length predictor shipped for the served model (its exit layer is
    checked against stage 0's depth by the caller)."""
    path = os.path.join(_model_folder(model_path), "length")
    if not os.path.isfile(os.path.join(path, "model.safetensors")):
        raise BundledHeadError(f"no bundled length predictor in {os.path.dirname(path)}")
    return path
