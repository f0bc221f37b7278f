"""Reject requests whose token ids would crash a scheduler, before they reach one.

SGLang 0.5.17 embeds ``input_ids`` as given: an id outside ``[0, vocab_size)`` raises an
``IndexError`` in stage 0's embedding and takes every rank (and so the whole server) down. Its
``TokenizerManager._validate_input_ids_in_vocab`` exists but is never called, and ignores
negative ids. Likewise ``top_logprobs_num`` above the vocab size makes the last stage's top-k
raise.

Two layers, both SGLang extension points:

* :class:`spexis_sglang.srt.tokenizer_manager.SpexisTokenizerManager` (passed to SGLang's
  ``launch_server`` through ``init_tokenizer_manager_func``) checks the ids of every generate /
  embedding request in the HTTP server's process: ``/generate`` (single and batch), the OpenAI
  completions with a token-id prompt, ... answer HTTP 400 with :func:`input_ids_error`'s
  message.
* :meth:`SpexisScheduler._add_request_to_queue` applies the same check to the request as the
  scheduler received it (every PP rank, so their mirrored states agree), for paths that do not
  go through this tokenizer manager (the offline ``Engine``, ``--tokenizer-worker-num > 1``).
  SGLang's abort then replaces the ids with one valid token and answers 400.
"""

from __future__ import annotations

import logging
from typing import Any, Mapping, Optional, Sequence

logger = logging.getLogger(__name__)


def input_ids_error(input_ids: Optional[Sequence[int]], vocab_size: int) -> Optional[str]:
    """The message for token ids the model cannot embed, or None when they are all valid."""
    if input_ids is None or len(input_ids) == 0:
        return None
    lo, hi = min(input_ids), max(input_ids)
    if 0 <= lo and hi < vocab_size:
        return None
    for i, token in enumerate(input_ids):
        if not 0 <= token < vocab_size:
            return (
                f"input_ids contains the out-of-vocabulary token id {token} at position {i}; "
                f"valid ids are 0 to {vocab_size - 1} (vocab size {vocab_size})"
            )
    return None  # pragma: no cover - min/max said otherwise


def top_logprobs_num_error(top_logprobs_num, vocab_size: int) -> Optional[str]:
    """``top_logprobs_num`` beyond the vocabulary makes the last stage's top-k raise."""
    if top_logprobs_num is None or isinstance(top_logprobs_num, list):
        return None  # a batch's list is split into per-request values before the check
    if not 0 <= top_logprobs_num <= vocab_size:
        return (
            f"top_logprobs_num must be in [0, {vocab_size}] (the vocab size), "
            f"got {top_logprobs_num}"
        )
    return None


def sampling_params_error(params: Any, field_types: Mapping[str, Any]) -> Optional[str]:
    """A sampling parameter SGLang would answer with a bare HTTP 500 instead of refusing it: an
    unknown name (``SamplingParams(**params)`` raises ``TypeError``) or a value of the wrong
    type (``"max_new_tokens": "x"`` fails in arithmetic). ``field_types`` maps each name to its
    type; ``None`` means "the default" to SGLang, and booleans are left alone (SGLang reads any
    value as true or false)."""
    import msgspec

    if params is None:
        return None
    if not isinstance(params, dict):
        return f"sampling_params must be an object, got {type(params).__name__}"
    for name, value in params.items():
        if name not in field_types:
            return f"unknown sampling parameter {name!r}"
        kind = field_types[name]
        if value is None or kind is bool:
            continue
        try:
            msgspec.convert(value, kind)
        except msgspec.ValidationError as e:
            return f"sampling parameter {name!r}: {e}"
    return None


def request_input_error(req, vocab_size: int) -> Optional[str]:
    """The checks above on a scheduler's ``Req`` (token ids of text prompts only)."""
    logprob = getattr(req, "logprob", None)
    if req.return_logprob and logprob is not None:
        error = top_logprobs_num_error(logprob.top_logprobs_num, vocab_size)
        if error is not None:
            return error
    if getattr(req, "multimodal_inputs", None) is not None:
        return None
    return input_ids_error(req.origin_input_ids, vocab_size)
