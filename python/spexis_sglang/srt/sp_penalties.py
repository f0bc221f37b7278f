"""SGLang's penalizers under speculative parallelism.

Stock SGLang keeps the penalizers' state (frequency, presence and repetition penalties,
``min_new_tokens``) in the running batch's ``BatchedPenalizerOrchestrator`` and advances it
by one token per decode step (``ScheduleBatch.cumulate_penalty_output_tokens``): when a
request's next token is sampled, the state reflects exactly its output tokens so far.

SP builds a fresh ``SamplingBatchInfo`` from its rows every iteration, so there is no running
state to advance. Instead, the rank that samples (the last PP stage) sets the freshly
prepared penalizers from each row's *output prefix*: the request's committed output tokens
followed by the unverified drafts the row was built on (a speculative row at position ``p``
is conditioned on the tokens before ``p + 1``, drafts included). Whenever the row's result is
used, those drafts were all accepted, so the prefix is the true one; when one is rejected the
row is stale and its result is dropped anyway.

The state set here is bit-identical to what stock SGLang reaches by cumulating the same
tokens one step at a time: the frequency penalty adds the same float32 value once per
occurrence (the sum of equal addends does not depend on their order), presence and
repetition scatter a per-request constant, ``min_new_tokens`` counts tokens.
"""

from __future__ import annotations

import itertools
import logging
from typing import List, Optional, Sequence

import torch
from sglang.srt.sampling.penaltylib import (
    BatchedFrequencyPenalizer,
    BatchedMinNewTokensPenalizer,
    BatchedPresencePenalizer,
    BatchedRepetitionPenalizer,
)
from sglang.srt.sampling.penaltylib.orchestrator import BatchedPenalizerOrchestrator

logger = logging.getLogger(__name__)

__all__ = ["needs_penalizer", "row_output_prefix", "set_penalizer_state"]


def needs_penalizer(sampling_params) -> bool:
    """The request uses a penalizer (the conditions of SGLang's ``_is_required``)."""
    return (
        sampling_params.frequency_penalty != 0.0
        or sampling_params.presence_penalty != 0.0
        or sampling_params.repetition_penalty != 1.0
        or sampling_params.min_new_tokens > 0
    )


def row_output_prefix(
    output_ids: Sequence[int], drafts: Sequence[int], prompt_len: int, position: int
) -> List[int]:
    """The output tokens a row at ``position`` is conditioned on: committed, then drafts.

    The row's input is the token at ``position``, so it samples output token number
    ``position + 1 - prompt_len`` and is conditioned on that many output tokens.
    """
    prefix = list(output_ids)
    prefix.extend(drafts)
    expected = position + 1 - prompt_len
    if len(prefix) != expected:
        raise RuntimeError(
            f"Spexis penalties: a row at position {position} (prompt {prompt_len} tokens) "
            f"needs {expected} output tokens, got {len(output_ids)} committed + "
            f"{len(drafts)} drafts"
        )
    return prefix


def set_penalizer_state(
    orchestrator: Optional[BatchedPenalizerOrchestrator],
    prefixes: Sequence[Optional[Sequence[int]]],
) -> None:
    """Set the prepared penalizers as if row ``i`` had output ``prefixes[i]``.

    ``orchestrator`` is a batch's freshly built one (one row per entry of ``prefixes``).
    ``None`` marks a row whose request uses no penalizer (its penalties are neutral in any
    state, so the state is left empty). Token ids outside the vocabulary (a draft can only
    be one if the draft head's vocabulary is padded; its row is stale then) are skipped.
    """
    if orchestrator is None or not orchestrator.is_required:
        return
    n = len(prefixes)
    vocab = orchestrator.vocab_size
    device = orchestrator.device
    lengths = [len(p) if p is not None else 0 for p in prefixes]
    tokens = torch.tensor(
        list(itertools.chain.from_iterable(p for p in prefixes if p)), dtype=torch.int64
    )
    rows = torch.repeat_interleave(torch.arange(n), torch.tensor(lengths, dtype=torch.int64))
    valid = (tokens >= 0) & (tokens < vocab)
    if not bool(valid.all()):
        tokens, rows = tokens[valid], rows[valid]
    flat_index = (rows * vocab + tokens).to(device, non_blocking=True)
    rows = rows.to(device, non_blocking=True)

    for penalizer in orchestrator.penalizers.values():
        if not penalizer.is_prepared():
            continue
        if isinstance(penalizer, BatchedFrequencyPenalizer):
            acc = penalizer.cumulated_frequency_penalties
            acc.zero_()
            src = penalizer.frequency_penalties.view(-1)[rows]
            acc.view(-1).scatter_add_(0, flat_index, src)
        elif isinstance(penalizer, BatchedPresencePenalizer):
            acc = penalizer.cumulated_presence_penalties
            acc.zero_()
            acc.view(-1).scatter_(0, flat_index, penalizer.presence_penalties.view(-1)[rows])
        elif isinstance(penalizer, BatchedRepetitionPenalizer):
            acc = penalizer.cumulated_repetition_penalties
            acc.fill_(1.0)
            acc.view(-1).scatter_(0, flat_index, penalizer.repetition_penalties.view(-1)[rows])
        elif isinstance(penalizer, BatchedMinNewTokensPenalizer):
            penalizer.len_output_tokens = (
                torch.tensor(lengths, dtype=torch.int32).view(-1, 1).to(device, non_blocking=True)
            )
        else:
            raise TypeError(
                f"Spexis: cannot set the state of the penalizer {type(penalizer).__name__} "
                "under speculative parallelism"
            )
