"""Stage 0's draft pass replayed from a CUDA graph (:class:`DraftPassGraphs`).

Under SP stage 0 makes its drafts after the forward (``spexis_make_drafts``): the draft head's
LM head and the fused Triton pass over its logits, a few kernels whose Python launch sits on
stage 0's critical path every iteration. A graph per row bucket replays them in one launch: the
head's hidden state is copied into the graph's input, and the drafts are read from its outputs
(on an H100 host stage 0's launch phase 0.19-0.44 ms shorter an iteration at 64 and 256 rows:
benchmark/README.md, section 8).

A bucket's graph is captured the first time a batch of its size drafts, in a memory pool the
buckets share (the largest first holds most of it). Where the capture fails the pass runs
eagerly from then on; ``SPEXIS_DRAFT_GRAPH=0`` keeps it eager (to time one against the other).
"""

from __future__ import annotations

import logging
from typing import Callable, Dict, Optional, Tuple

import torch

from spexis_sglang.srt.config import ENV_DRAFT_GRAPH, env_value

logger = logging.getLogger(__name__)

#: rows above this draft eagerly (a bucket's graph holds its logits: rows x vocabulary)
MAX_GRAPH_ROWS = 1024

Drafts = Tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def bucket_rows(rows: int) -> Optional[int]:
    """The graph size that serves ``rows``: the next power of two up to 16, then the next
    multiple of 16 (at most 15 padding rows through the LM head); None above
    ``MAX_GRAPH_ROWS``."""
    if rows < 1 or rows > MAX_GRAPH_ROWS:
        return None
    if rows <= 16:
        return 1 << (rows - 1).bit_length()
    return -(-rows // 16) * 16


class _Captured:
    __slots__ = ("graph", "x", "buckets", "out")

    def __init__(self, graph, x, buckets, out: Drafts):
        self.graph, self.x, self.buckets, self.out = graph, x, buckets, out


class DraftPassGraphs:
    """``draft(x, buckets) -> (ids, conf, packed)`` replayed from one CUDA graph per row bucket.

    ``draft`` must be capturable: fixed shapes in, no host synchronisation, no collective
    (stage 0 with TP drafts eagerly). Its outputs are the graph's: they stay valid until the
    bucket's next replay, which the SP loop queues only after the proxy carrying them was sent
    and the drafts' readback queued behind it (same stream)."""

    def __init__(self, draft: Callable[..., Drafts], hidden_size: int, dtype, device) -> None:
        self.draft = draft
        self.hidden_size = hidden_size
        self.dtype = dtype
        self.device = torch.device(device)
        self.on = env_value(ENV_DRAFT_GRAPH) != "0"
        self._graphs: Dict[Tuple[int, bool], _Captured] = {}
        self._pool = None

    @property
    def captures(self) -> int:
        """Buckets captured so far."""
        return len(self._graphs)

    def run(self, x: torch.Tensor, rows: int, buckets: Optional[torch.Tensor]) -> Optional[Drafts]:
        """The drafts of ``x``'s first ``rows`` rows, or None where no graph serves them (the
        caller drafts eagerly)."""
        if (
            not self.on
            or x.dtype != self.dtype
            or x.shape[-1] != self.hidden_size
            or x.shape[0] < rows
        ):
            return None
        size = bucket_rows(rows)
        if size is None:
            return None
        key = (size, buckets is not None)
        captured = self._graphs.get(key)
        if captured is None:
            captured = self._capture(size, buckets is not None)
            if captured is None:
                return None
        captured.x[:rows].copy_(x[:rows])
        if buckets is not None:
            captured.buckets[:rows].copy_(buckets[:rows])
        captured.graph.replay()
        ids, conf, packed = captured.out
        return ids[:rows], conf[:rows], packed[:rows]

    def _capture(self, size: int, with_buckets: bool) -> Optional[_Captured]:
        x = torch.zeros((size, self.hidden_size), dtype=self.dtype, device=self.device)
        buckets = None
        if with_buckets:
            buckets = torch.full((size,), -1, dtype=torch.int64, device=self.device)
        try:
            # On a side stream, without ``torch.cuda.graph``'s device-wide synchronize (the
            # other pipeline stages keep running): a run that compiles and loads the kernels,
            # then the capture, only this thread's work in it.
            current = torch.cuda.current_stream(self.device)
            side = torch.cuda.Stream(device=self.device)
            side.wait_stream(current)
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.stream(side):
                self.draft(x, buckets)
                graph.capture_begin(pool=self._pool, capture_error_mode="thread_local")
                try:
                    out = self.draft(x, buckets)
                finally:
                    graph.capture_end()
            current.wait_stream(side)
        except Exception as e:  # a capture the driver or a kernel refuses: draft eagerly
            self.on = False
            logger.warning(
                "Spexis: capturing the draft pass in a CUDA graph failed (%s: %s); stage 0 "
                "drafts eagerly",
                type(e).__name__,
                e,
            )
            return None
        captured = _Captured(graph, x, buckets, out)
        self._graphs[(size, with_buckets)] = captured
        logger.debug("Spexis: draft pass captured for %d rows", size)
        return captured
