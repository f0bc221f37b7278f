"""Constrained decoding (regex, JSON schema, EBNF, structural tags) under speculative parallelism.

Stock SGLang keeps one grammar matcher per request, ``req.grammar``. Before a decode step samples,
``SamplingBatchInfo.update_regex_vocab_mask`` fills each row's vocabulary bitmask from the
matcher; after it, ``process_batch_result_decode`` appends the token, calls
``update_finish_state`` and only then advances the matcher by the token. (A grammar that has just
terminated therefore finishes its request at the *next* token's ``update_finish_state``; rows of a
terminated grammar are not masked.)

Under SP the matcher may only ever hold *verified* output, while a speculative row at position
``p`` samples after the committed output *and* the unverified drafts before ``p + 1``:

* **Commit** (every rank). :func:`accept_committed` advances ``req.grammar`` by each token SP
  commits, in stock order (after ``update_finish_state``). Every rank's matcher holds the state of
  the request's committed output, and the grammar's termination finishes the request on every
  rank at the same token as in plain SGLang.
* **Row masks** (the sampling rank). :func:`row_masks` gives each row the matcher state after its
  own prefix: the live matcher accepts the row's drafts, fills the row's bitmask and rolls back,
  so a row costs what stock's fill costs plus ``O(drafts)`` (at most ``N - 1``) accept/rollback
  steps of about a microsecond. The batch's sampling state (``sp_sampling.SPSamplingBatchInfo``)
  makes the sampler apply these masks instead of the committed-state ones it would compute.
* **A draft the grammar forbids.** The row that samples that position has a valid prefix and
  samples under the mask, so the true token differs from the draft: the draft is rejected, and
  every row built on it comes back stale. Such a row gets no mask (any mask would do). The
  forbidden token is never fed to the matcher: xgrammar's ``accept_token`` answers False and
  leaves the state unchanged, so the rollback undoes exactly the drafts that were accepted.
* **Draft masking** (stage 0). The draft stage 0 makes at a row is a guess of the same token the
  row samples, under the same prefix: it needs the same mask. With draft masking on, stage 0
  computes the row masks too, and the draft head takes its argmax (and confidence) over the tokens
  the grammar allows (the batch's ``SPSamplingBatchInfo.draft_mask``, read by ``draft_model``
  through :func:`draft_mask_of`). Drafts the grammar forbids
  are certain rejections; masking them turns them into chances. (Lossless either way: only the
  sampling rank's masks decide tokens.)

Only xgrammar's matcher is supported: the fork above relies on its ``accept_token`` refusing a
token without a state change and on its unlimited ``rollback``. Requests whose grammar is another
backend's are refused by name (:func:`grammar_request_error`), as is any grammar in the
benchmark-only forced-acceptance mode, which may commit a draft the grammar forbids.
"""

from __future__ import annotations

import logging
from typing import List, Optional, Sequence

import torch
from sglang.srt.constrained.base_grammar_backend import BaseGrammarObject, GrammarMask
from sglang.srt.managers.schedule_batch import FINISH_ABORT, Req

from spexis_sglang.srt.sp_sampling import SPSamplingBatchInfo

logger = logging.getLogger(__name__)

__all__ = [
    "GRAMMAR_PARAMS",
    "accept_committed",
    "draft_mask_of",
    "draft_masking_enabled",
    "grammar_request_error",
    "invalid_draft_rows",
    "row_masks",
    "set_decode_masks",
]

#: the sampling parameters that make SGLang compile a grammar for a request
GRAMMAR_PARAMS = ("regex", "json_schema", "ebnf", "structural_tag")


def _supported(grammar: BaseGrammarObject) -> bool:
    from sglang.srt.constrained.xgrammar_backend import XGrammarGrammar

    return isinstance(grammar, XGrammarGrammar)


def grammar_request_error(sampling_params, grammar, forced: bool) -> Optional[str]:
    """Why SP cannot serve this request's grammar (None: it can, or it has none).

    ``grammar`` is ``req.grammar`` once SGLang has compiled it (``None`` without one).
    """
    used = [k for k in GRAMMAR_PARAMS if getattr(sampling_params, k, None) is not None]
    if forced and (used or grammar is not None):
        return (
            f"Spexis --spexis-benchmark-force-accept does not support "
            f"{', '.join(used) or 'grammars'} (a forced acceptance can commit a token the "
            "grammar forbids); send this request to a server without it"
        )
    if grammar is not None and not _supported(grammar):
        return (
            "Spexis speculative parallelism supports constrained decoding with SGLang's "
            f"xgrammar backend only (this request's grammar is a {type(grammar).__name__}); "
            "send this request to a server without --spexis-draft-head"
        )
    return None


def accept_committed(req: Req, token: int) -> None:
    """Advance the request's grammar by a committed token (stock order: call it right after
    ``req.update_finish_state``). As stock SGLang, a token the grammar refuses aborts the
    request."""
    grammar = req.grammar
    if grammar is None:
        return
    try:
        grammar.accept_token(token)
    except ValueError as e:
        logger.error("Grammar accept_token failed for req %s with token %s: %s", req.rid, token, e)
        req.to_finish = FINISH_ABORT()
    grammar.finished = req.finished()


def _fill_after(
    grammar: BaseGrammarObject, drafts: Sequence[int], mask: torch.Tensor, row: int
) -> bool:
    """Fill ``mask[row]`` with the grammar's mask after ``drafts``, then restore its state.

    Leaves the row unconstrained (as stock does) when the grammar terminates within the drafts,
    and when a draft is forbidden (False: the row is built on a draft that will be rejected).
    """
    matcher = grammar.matcher
    accepted = 0
    valid = True
    for token in drafts:
        if matcher.is_terminated():
            break
        if not matcher.accept_token(token):
            valid = False
            break
        accepted += 1
    if valid and not matcher.is_terminated():
        grammar.fill_vocab_mask(mask, row)
    if accepted:
        matcher.rollback(accepted)
    return valid


def row_masks(
    grammars: Sequence[Optional[BaseGrammarObject]],
    drafts: Sequence[Sequence[int]],
    vocab_size: int,
    device,
) -> Optional[GrammarMask]:
    """One bitmask row per batch row: row ``i``'s grammar after the drafts ``drafts[i]``.

    ``grammars[i]`` is the row's request's committed-state grammar (None: no grammar; its row is
    unconstrained). Returns None when no row has a grammar.
    """
    first = next((g for g in grammars if g is not None), None)
    if first is None:
        return None
    mask = first.allocate_vocab_mask(vocab_size=vocab_size, batch_size=len(grammars), device=device)
    for i, (grammar, row_drafts) in enumerate(zip(grammars, drafts)):
        if grammar is None or grammar.finished:
            continue
        _fill_after(grammar, row_drafts, mask, i)
    return GrammarMask(first, first.move_vocab_mask(mask, device))


def invalid_draft_rows(
    grammars: Sequence[Optional[BaseGrammarObject]], drafts: Sequence[Sequence[int]]
) -> List[int]:
    """Rows built on a draft their grammar forbids (diagnostics and tests; restores state)."""
    out = []
    for i, (grammar, row_drafts) in enumerate(zip(grammars, drafts)):
        if grammar is None or not row_drafts:
            continue
        matcher = grammar.matcher
        accepted = 0
        for token in row_drafts:
            if matcher.is_terminated():
                break
            if not matcher.accept_token(token):
                out.append(i)
                break
            accepted += 1
        if accepted:
            matcher.rollback(accepted)
    return out


def draft_mask_of(forward_batch) -> Optional[GrammarMask]:
    """The draft mask a decode forward carries (None: draft freely)."""
    info = getattr(forward_batch, "sampling_info", None)
    return info.draft_mask if isinstance(info, SPSamplingBatchInfo) else None


def draft_masking_enabled(config, server_args) -> bool:
    """Stage 0 masks drafts when ``--spexis-grammar-draft-mask`` is on and its decode forwards
    run eagerly: the mask is applied in the draft head's Python forward, which a CUDA graph
    replay does not run (there the drafts stay unmasked, which costs acceptance, not tokens)."""
    if not config.grammar_draft_mask:
        return False
    if server_args.device != "cpu" and not server_args.disable_cuda_graph:
        logger.info(
            "Spexis: grammar draft masking is off on this server (decode CUDA graphs are on; "
            "the draft head's mask applies to eager forwards only)"
        )
        return False
    return True


def set_decode_masks(
    batch, positions, row_drafts, *, vocab_size: int, sampling_rank: bool, draft_rank: bool
) -> bool:
    """Give an SP decode batch (launched; ``positions[i]`` is row ``i``'s, its request
    ``batch.reqs[i]``) its grammar masks.

    ``row_drafts(i)`` are the launched, unverified drafts row ``i`` is built on
    (``SlotState.draft_tokens``). On the sampling rank the masks replace the sampler's own and
    the batch needs its drafts' real values (the next batch's rows are built on them: the
    return value); on stage 0 they go to the draft head.
    """
    grammars: List[Optional[BaseGrammarObject]] = []
    drafts: List[Sequence[int]] = []
    for i, (req, position) in enumerate(zip(batch.reqs, positions)):
        if req.grammar is None:
            grammars.append(None)
            drafts.append(())
            continue
        drafts_i = row_drafts(i)
        expected = position + 1 - len(req.origin_input_ids) - len(req.output_ids)
        if len(drafts_i) != expected:
            raise RuntimeError(
                f"Spexis grammar: request {req.rid} has a row at position {position} on "
                f"{len(drafts_i)} drafts, expected {expected}"
            )
        grammars.append(req.grammar)
        drafts.append(drafts_i)
    mask = row_masks(grammars, drafts, vocab_size, batch.device)
    info: SPSamplingBatchInfo = batch.sampling_info
    if sampling_rank:
        info.rows_masked, info.row_mask = True, mask
    if draft_rank:
        info.draft_mask = mask
    return sampling_rank
