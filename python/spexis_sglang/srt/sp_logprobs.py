"""Output-token logprobs under speculative parallelism.

Stock SGLang's decode batch asks the last stage's logits processor for logprobs through the
batch's ``return_logprob`` / ``top_logprobs_nums`` / ``token_ids_logprobs``; the last stage
sends them back with the sampled tokens (``_pp_prepare_tensor_dict``) and every rank rebuilds a
``LogitsProcessorOutput`` from them (``_pp_prep_batch_result``) when its own copy of the batch
has ``return_logprob`` set. SP's decode batches are built the same way on every rank, so
:func:`set_decode_logprob_fields` is all the forward needs.

What differs is which rows count: a row's logprobs are those of the distribution the target
model gave at the row's position. They are the request's only when the row's prefix was
verified, i.e. when ``SPState.on_result`` commits the row's token; rows built on a draft that
was rejected come back stale and their logprobs are dropped with them. The prefill's first
token and the prompt logprobs come from SGLang's own prefill processing, unchanged.
"""

from __future__ import annotations

import logging
from typing import Optional, Sequence

import torch
from sglang.srt.managers.schedule_batch import Req, ScheduleBatch

logger = logging.getLogger(__name__)


def set_decode_logprob_fields(batch: ScheduleBatch, reqs: Sequence[Req]) -> None:
    """The logprob arguments of a decode batch with one row per entry of ``reqs``
    (what stock SGLang's ``prepare_for_decode`` keeps from the requests)."""
    batch.return_logprob = any(r.return_logprob for r in reqs)
    if batch.return_logprob:
        batch.top_logprobs_nums = [r.logprob.top_logprobs_num for r in reqs]
        batch.token_ids_logprobs = [r.logprob.token_ids_logprob for r in reqs]
    else:
        batch.top_logprobs_nums = None
        batch.token_ids_logprobs = None


def _host_list(values) -> Optional[list]:
    if values is None:
        return None
    if isinstance(values, torch.Tensor):
        return values.tolist()
    return [v.tolist() if isinstance(v, torch.Tensor) else v for v in values]


class DecodeLogprobs:
    """One SP decode result's logprobs per row, on the host."""

    def __init__(self, logits_output) -> None:
        self.token = _host_list(logits_output.next_token_logprobs)
        self.top_val = _host_list(logits_output.next_token_top_logprobs_val)
        self.top_idx = _host_list(logits_output.next_token_top_logprobs_idx)
        self.ids_val = _host_list(logits_output.next_token_token_ids_logprobs_val)
        self.ids_idx = _host_list(logits_output.next_token_token_ids_logprobs_idx)

    @classmethod
    def from_result(cls, batch: ScheduleBatch, result) -> Optional["DecodeLogprobs"]:
        """None unless the batch asked for logprobs (and they came back)."""
        if not batch.return_logprob:
            return None
        logits_output = getattr(result, "logits_output", None)
        if logits_output is None or logits_output.next_token_logprobs is None:
            logger.warning("Spexis: a decode batch asked for logprobs but none came back")
            return None
        return cls(logits_output)

    def record(self, req: Req, row: int, token: int) -> None:
        """Append row ``row``'s logprobs to ``req``: call only for a committed (verified) row,
        right after its token was appended to ``req.output_ids``."""
        if not req.return_logprob:
            return
        lp = req.logprob
        lp.output_token_logprobs_val.append(self.token[row])
        lp.output_token_logprobs_idx.append(int(token))
        if lp.top_logprobs_num > 0 and self.top_val is not None:
            lp.output_top_logprobs_val.append(self.top_val[row])
            lp.output_top_logprobs_idx.append(self.top_idx[row])
        if lp.token_ids_logprob is not None and self.ids_val is not None:
            lp.output_token_ids_logprobs_val.append(self.ids_val[row])
            lp.output_token_ids_logprobs_idx.append(self.ids_idx[row])
