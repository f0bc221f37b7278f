"""Stage-0 models of Spexis: the draft head and the remaining-length predictor (torch only).

Loader API::

    head, cfg = load_draft_head(
        path, base_config, exit_layer=None, device="cpu", dtype=torch.float32
    )
    tokens, confidence, kv = head.draft(hidden, positions, lm_head_weight)
    lp, cfg = load_length_predictor(path, base_config, exit_layer=None, device="cpu")
    probs = lp.probabilities(hidden); below = lp.predict(hidden)

``base_config`` is the base model's HF config (object or dict). See each module's docstring
for the exact forward.
"""

from spexis_sglang.models.artifact import (  # noqa: F401
    ArtifactConfig,
    ArtifactMismatchError,
    architecture_fields,
    base_fingerprint,
)
from spexis_sglang.models.draft_head import (  # noqa: F401
    DraftHead,
    DraftHeadConfig,
    greedy_with_confidence,
    load_draft_head,
    save_draft_head,
)
from spexis_sglang.models.length_predictor import (  # noqa: F401
    DEFAULT_THRESHOLDS,
    LengthPredictor,
    LengthPredictorConfig,
    load_length_predictor,
    save_length_predictor,
)


def default_artifact_dir(name: str) -> str:
    """Path of a shipped artifact, e.g. ``default_artifact_dir("draft-exit15")``."""
    import os

    return os.path.join(
        os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
        "artifacts",
        "smollm2-135m-instruct",
        name,
    )
