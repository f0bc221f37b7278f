"""Copies between host and device in the SP loop that do not wait for the GPU: the per-iteration
metadata up (:class:`HostStaging`), stage 0's drafts back (:class:`HostReadback`).

A ``.to(device)`` of a pageable host tensor synchronises the stream, and CUDA's wait spins a
CPU core. On an H200 with CUDA graphs, stage 0's KV bookkeeping cost 0.45 ms of CPU per
iteration at 256 rows. :class:`HostStaging` copies through a ring of pinned buffers
with ``non_blocking=True`` instead: the copy is queued on the current stream, ahead of the
kernels that read it, and the scheduler goes on at once.

No event guards a buffer's reuse (each CUDA call costs the scheduler tens of µs). The SP loop
guarantees it instead: a decode batch's result is processed ``pp_loop_size`` launches after
the batch, and only once its outputs have arrived, which needs the batch's forward pass on
every stage, which ran after the batch's copy on the same stream order. So a copy is done
before ``pp_loop_size`` more batches are staged; the ring is deeper than that.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch


class _PinnedRing:
    """``depth`` pinned host buffers used in turn, each grown (doubled) when a copy outgrows
    it. On a CPU device nothing is pinned (``pinned`` is False) and no buffer is made.

    Copies that vary in their first dimension only reuse the buffers: a buffer is made again
    only when it is too short or its trailing shape or dtype changes, and pinning host memory
    costs milliseconds (and a pinned block the host allocator keeps), so callers keep the
    varying length first. ``allocations`` counts them."""

    def __init__(self, device, depth: int, pin_memory: Optional[bool] = None):
        self.device = torch.device(device)
        self.pinned = self.device.type == "cuda"
        self._pin = self.pinned if pin_memory is None else pin_memory
        self.depth = depth
        self._buffers: List[Optional[torch.Tensor]] = [None] * depth
        self._next = 0
        self.allocations = 0

    def _take(self, like: torch.Tensor) -> Tuple[int, torch.Tensor]:
        """The next buffer's index, and its first ``len(like)`` rows shaped and typed like
        ``like``."""
        i = self._next
        self._next = (i + 1) % self.depth
        n = like.shape[0]
        buf = self._buffers[i]
        if (
            buf is None
            or buf.shape[0] < n
            or buf.shape[1:] != like.shape[1:]
            or buf.dtype != like.dtype
        ):
            size = max(n, 2 * (0 if buf is None else buf.shape[0]))
            buf = torch.empty((size, *like.shape[1:]), dtype=like.dtype, pin_memory=self._pin)
            self._buffers[i] = buf
            self.allocations += 1
        return i, buf[:n]


class HostStaging(_PinnedRing):
    """A ring of ``depth`` pinned buffers for host-to-device copies.

    The caller guarantees that a copy has completed before ``depth`` more calls. On a CPU
    device there is nothing to copy: :meth:`to_device` returns the host tensor.
    """

    def to_device(self, host: torch.Tensor) -> torch.Tensor:
        """``host`` (a 1-D int64 CPU tensor) on the device; ``host`` stays the caller's."""
        if not self.pinned:
            return host.to(self.device)
        _, staged = self._take(host)
        staged.copy_(host)
        return staged.to(self.device, non_blocking=True)


class HostReadback(_PinnedRing):
    """Device-to-host copies that do not wait: a ring of ``depth`` pinned buffers, each with
    its own reusable event.

    :meth:`start` queues the copy on the current stream and records the buffer's event after
    it; the reader synchronizes on that event before reading. The caller guarantees that a
    buffer has been read before ``depth`` more copies start. On a CPU device nothing is
    copied: the source itself is returned, with no event.
    """

    def __init__(self, device, depth: int):
        super().__init__(device, depth)
        self._events: List[Optional[torch.cuda.Event]] = [None] * depth
        # (``current_stream(index)``: without an index torch resolves the device in Python)
        self._device_index = None
        if self.pinned:
            index = self.device.index
            self._device_index = torch.cuda.current_device() if index is None else index

    def start(self, src: torch.Tensor) -> Tuple[torch.Tensor, Optional["torch.cuda.Event"]]:
        """``src`` (contiguous) on the host once the returned event has completed."""
        if not self.pinned:
            return src, None
        i, dst = self._take(src)
        dst.copy_(src, non_blocking=True)
        event = self._events[i]
        if event is None:
            event = self._events[i] = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self._device_index))
        return dst, event
