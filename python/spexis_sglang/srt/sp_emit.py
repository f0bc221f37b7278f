"""Emitting the committed tokens of an SP decode batch, with per-request work only where needed.

Per committed token, stock SGLang's result processing calls ``Req.update_finish_state`` and
hands every request of the batch to ``stream_output``. For most tokens both are no-ops: a
request without stop strings or a grammar finishes only on a token that is a stop id, out of
the vocabulary, at ``max_new_tokens``, or after an abort (``to_finish``); a request that does
not stream is sent to the detokenizer only when it finishes or every
``SGLANG_FORCE_STREAM_INTERVAL`` tokens. At B = 256 those calls were most of stage 0's result
processing.

:class:`SlotEmit` keeps, per request slot (``req_pool_idx``) and written when the request
starts decoding under SP, what decides whether a token may finish or stream its request.
:meth:`SlotEmit.finish_candidates` and :meth:`SlotEmit.stream_candidates` are conservative
numpy prefilters: SGLang's own per-request code still decides for every row they select, and
a row they do not select is one for which that code would do nothing. So finish reasons,
``finished_len``, streaming and detokenizer payloads stay SGLang's (``tests/srt/
test_sp_emit.py`` checks the prefilters against the per-request path on random cases).

Appending each committed token to its ``Req`` was the largest per-row cost left (~1 µs a row:
the forward has pushed the ``Req`` objects out of the cache). So the tokens of a request that
neither finishes nor streams wait in a per-slot buffer (:meth:`SlotEmit.push`) and reach
``output_ids`` / ``kv_committed_len`` in one ``extend`` (:meth:`SlotEmit.flush`) when SGLang's
code is about to read them: a finish check or ``stream_output`` of that row, the request's
release, a full buffer, or (the scheduler's part) anything that reads the running requests:
an arriving request or abort, admission, retraction. An abort sets ``to_finish`` outside result
processing, so the scheduler flags the slot (:meth:`SlotEmit.flag`) and its every token then
takes the finish check.
"""

from __future__ import annotations

from typing import Callable, List, Optional, Tuple

import numpy as np
from sglang.srt.managers.schedule_batch import Req
from sglang.srt.managers.scheduler_components.output_streamer import DEFAULT_FORCE_STREAM_INTERVAL

from spexis_sglang.srt.sp_penalties import needs_penalizer

__all__ = ["SlotEmit", "emit_batch", "finish_requests", "stop_token_ids"]

_NO_LIMIT = np.iinfo(np.int64).max
#: committed tokens a slot may hold back before they are appended to its request
PENDING_CAP = 64


class SlotEmit:
    """Per-slot facts that decide which committed tokens can finish or stream a request.

    Lengths are kept as *verified lengths* (prompt + output tokens, ``SlotState``'s
    ``verified_len``): a row committed at position ``p`` makes it ``p + 2``.
    """

    def __init__(self, capacity: int, vocab_size: int, force_stream_interval: int = 0) -> None:
        self.vocab_size = int(vocab_size)
        self.force_stream_interval = int(force_stream_interval or DEFAULT_FORCE_STREAM_INTERVAL)
        #: verified length at which len(output_ids) reaches max_new_tokens (-1: every token
        #: takes SGLang's check)
        self._finish_at = np.full(capacity, _NO_LIMIT, dtype=np.int64)
        #: len(output_ids) - verified length (minus the prompt's length)
        self._out_offset = np.zeros(capacity, dtype=np.int64)
        #: stop and EOS token ids apply (not ignore_eos)
        self._stops_apply = np.zeros(capacity, dtype=bool)
        #: a token id that some request admitted so far stops on (a superset: never cleared)
        self._stop_token = np.zeros(self.vocab_size, dtype=bool)
        #: ``_stop_token.any()``, kept beside it (set where it is) so that the per-batch
        #: prefilter skips the lookup without a vocabulary-sized scan
        self._any_stop = False
        #: every token goes to stream_output (streaming, or a batch-wide output flag)
        self._always_stream = np.zeros(capacity, dtype=bool)
        #: metrics or tracing observe every token's decode timestamp
        self._timed = np.zeros(capacity, dtype=bool)
        #: the request's tokens reach it every iteration (timed, or penalised: the sampling
        #: rank reads its output_ids when it builds a batch)
        self._eager = np.zeros(capacity, dtype=bool)
        #: committed tokens not yet appended to the request, and kv_committed_len after them
        self._pend_tok = np.zeros((capacity, PENDING_CAP), dtype=np.int64)
        self._pend_n = np.zeros(capacity, dtype=np.int64)
        self._pend_kv = np.zeros(capacity, dtype=np.int64)

    def admit(self, slot: int, req: Req, verified_len: int) -> None:
        """``req`` starts decoding under SP in ``slot`` with ``verified_len`` tokens."""
        sp = req.sampling_params
        out_offset = len(req.output_ids) - verified_len
        self._out_offset[slot] = out_offset
        max_new = sp.max_new_tokens
        if (
            len(sp.stop_strs) > 0
            or len(sp.stop_regex_strs) > 0
            or req.grammar is not None
            or req.vocab_size != self.vocab_size
        ):
            # stop strings or regexes, a grammar, another vocabulary: check every token
            self._finish_at[slot] = -1
        else:
            self._finish_at[slot] = _NO_LIMIT if max_new is None else max_new - out_offset
        self._stops_apply[slot] = not sp.ignore_eos
        if not sp.ignore_eos:
            self._stop_token[self._in_vocab(stop_token_ids(req))] = True
            self._any_stop = bool(self._stop_token.any())
        self._always_stream[slot] = bool(
            req.stream
            or req.return_hidden_states
            or req.return_routed_experts
            or req.return_indexer_topk
            or req.return_sampling_mask
        )
        time_stats = req.time_stats
        self._timed[slot] = bool(
            getattr(time_stats, "enable_metrics", True)
            or getattr(getattr(time_stats, "trace_ctx", None), "tracing_enable", True)
        )
        self._eager[slot] = self._timed[slot] or needs_penalizer(sp)
        self._pend_n[slot] = 0
        if req.to_finish is not None:
            self.flag(slot)

    def flag(self, slot: int) -> None:
        """Something outside result processing may finish the request (an abort set
        ``to_finish``): every token of it takes SGLang's finish check from now on."""
        self._finish_at[slot] = -1

    def push(self, slots: np.ndarray, tokens: np.ndarray, kv_committed: np.ndarray) -> np.ndarray:
        """Hold back one committed token per row (distinct slots); the held counts after."""
        n = self._pend_n[slots]
        self._pend_tok[slots, n] = tokens
        n += 1
        self._pend_n[slots] = n
        self._pend_kv[slots] = kv_committed
        return n

    def pending_slots(self) -> np.ndarray:
        """Slots holding tokens back."""
        return np.flatnonzero(self._pend_n)

    def flush(self, reqs: List[Req], slots: np.ndarray) -> None:
        """Append the held-back tokens of ``slots`` to their requests (``reqs[k]`` holds
        ``slots[k]``), as SGLang's result processing does per token (``output_ids``,
        ``kv_committed_len``)."""
        counts = self._pend_n[slots]
        pend, kv = self._pend_tok, self._pend_kv
        for req, slot, n in zip(reqs, slots.tolist(), counts.tolist()):
            if n:
                req.output_ids.extend(pend[slot, :n].tolist())
                req.kv_committed_len = int(kv[slot])
        self._pend_n[slots] = 0

    def timed_per_token(self, slots: np.ndarray) -> np.ndarray:
        """Rows whose decode timestamp metrics or tracing observe on every token."""
        return self._timed[slots]

    def _in_vocab(self, ids: List[int]) -> np.ndarray:
        a = np.asarray(ids, dtype=np.int64)
        return a[(a >= 0) & (a < self.vocab_size)]

    def finish_candidates(
        self, slots: np.ndarray, tokens: np.ndarray, verified_len: np.ndarray
    ) -> np.ndarray:
        """Rows whose token may finish the request (just committed, ``verified_len`` after).

        Every row for which ``Req.update_finish_state`` could set a finish reason is selected
        (aborts aside: ``to_finish`` and an already set reason are checked per request by
        :func:`commit_tokens`)."""
        cand = verified_len >= self._finish_at[slots]
        in_vocab = (tokens >= 0) & (tokens < self.vocab_size)
        if not in_vocab.all():
            cand |= ~in_vocab
            tokens = np.where(in_vocab, tokens, 0)
        if self._any_stop:  # no request admitted so far stops on a token: nothing to look up
            cand |= self._stop_token[tokens] & self._stops_apply[slots]
        return cand

    def stream_candidates(
        self, slots: np.ndarray, verified_len: np.ndarray, finished: np.ndarray
    ) -> np.ndarray:
        """Rows ``stream_output`` would do anything for: finished, streaming, or at the
        forced stream interval (a request that neither streams nor finishes is skipped
        there unless ``len(output_ids) % SGLANG_FORCE_STREAM_INTERVAL == 0``)."""
        out_len = verified_len + self._out_offset[slots]
        return finished | self._always_stream[slots] | (out_len % self.force_stream_interval == 0)


def stop_token_ids(req: Req) -> List[int]:
    """The token ids ``Req._check_token_based_finish`` stops on for ``req``."""
    ids = list(req.sampling_params.stop_token_ids or ())
    ids += list(req.eos_token_ids or ())
    tokenizer = req.tokenizer
    if tokenizer is not None:
        if tokenizer.eos_token_id is not None:
            ids.append(tokenizer.eos_token_id)
        ids += list(tokenizer.additional_stop_token_ids or ())
    return [int(i) for i in ids]


def finish_requests(reqs: List[Req], candidates: np.ndarray) -> np.ndarray:
    """``update_finish_state`` for the candidate rows; the mask of finished rows."""
    finished = np.zeros(len(reqs), dtype=bool)
    for k in np.flatnonzero(candidates).tolist():
        req = reqs[k]
        req.update_finish_state(1)
        if req.finished():
            finished[k] = True
    return finished


def emit_batch(
    emit: SlotEmit,
    reqs: List[Req],
    slots: np.ndarray,
    tokens: np.ndarray,
    positions: np.ndarray,
    timestamp: float,
    top_up: Optional[Callable[[Req], None]] = None,
    index: Optional[np.ndarray] = None,
) -> Tuple[List[Req], List[Req]]:
    """Commit ``tokens`` (row ``k``: the request in ``slots[k]``, ``reqs[index[k]]``, or
    ``reqs[k]`` without ``index``, committed at ``positions[k]``): returns ``(finished,
    to_stream)``, the finished requests and those ``stream_output`` has something to do for
    (both in row order).

    Only the rows SGLang's code acts on touch their request: their held-back tokens are
    appended first; the other rows' tokens are held back (:meth:`SlotEmit.push`). Per-request
    state read only when a request is streamed is brought up to date only then: the decode
    timestamp (``set_last_decode_finish_time``, per token where metrics or tracing observe
    every token) and ``top_up`` (the benchmark mode's per-token label)."""
    verified = positions + 2
    held = emit.push(slots, tokens, positions + 1)
    cand = emit.finish_candidates(slots, tokens, verified)
    finished = np.zeros(slots.shape[0], dtype=bool)
    if cand.any():
        rows = np.flatnonzero(cand)
        got = _rows(reqs, rows, index)
        emit.flush(got, slots[rows])
        finished[rows] = finish_requests(got, np.ones(rows.size, dtype=bool))
    stream = emit.stream_candidates(slots, verified, finished)
    eager = emit._eager[slots]
    rest = (stream | eager | (held >= PENDING_CAP)) & ~cand
    if rest.any():
        rows = np.flatnonzero(rest)
        emit.flush(_rows(reqs, rows, index), slots[rows])
    for req in _rows(reqs, np.flatnonzero(stream | emit.timed_per_token(slots)), index):
        req.time_stats.set_last_decode_finish_time(timestamp)
    to_stream = _rows(reqs, np.flatnonzero(stream), index)
    if top_up is not None:
        for req in to_stream:
            top_up(req)
    return _rows(reqs, np.flatnonzero(finished), index), to_stream


def _rows(reqs: List[Req], rows: np.ndarray, index: Optional[np.ndarray]) -> List[Req]:
    """The requests of committed rows ``rows``."""
    if index is not None:
        rows = index[rows]
    return [reqs[k] for k in rows.tolist()]
