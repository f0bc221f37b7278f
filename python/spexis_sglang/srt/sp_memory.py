"""The KV memory of SP rows: a new slot for every row that writes past its request's KV (with
``--page-size > 1`` by SGLang's paged rule), fitting a batch's rows to the free memory
(speculation gives way first, then retraction, latest request first).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Optional, Tuple

import numpy as np
import torch
from sglang.srt.managers.scheduler_components.new_token_ratio_tracker import NewTokenRatioTracker
from sglang.srt.mem_cache.common import evict_from_tree_cache

from spexis_sglang.core.slot_state import Rows

if TYPE_CHECKING:
    from spexis_sglang.srt.sp_scheduler import SpexisScheduler

logger = logging.getLogger(__name__)


class SPMemoryMixin:
    """KV memory of SP rows: slots, fitting, retraction. (A mixin of
    :class:`~.sp_scheduler.SpexisScheduler`.)"""

    def _sp_alloc_kv(
        self: SpexisScheduler,
        rows: Rows,
        alternatives: Optional[np.ndarray] = None,
        transit_rows: Optional[np.ndarray] = None,
    ) -> Tuple[Tuple[torch.Tensor, torch.Tensor], Tuple[torch.Tensor, ...]]:
        """A new KV slot for every row that writes past its request's KV (one alloc, one
        index write). While a request decodes under SP, its KV length is the SlotState's
        (``allocated_len``), not ``req.kv.kv_allocated_len``.

        Returns the slots and sequence lengths on the host (SGLang's ``*_cpu`` fields), and
        the batch's metadata on the device, one copy, as views (one ``split``): tokens, slots,
        positions, sequence lengths (``n`` each), the lengths again as int32 (two to an int64:
        ``orig_seq_lens`` without a cast kernel), the rows' alternatives and transit rows
        (``n`` each, or empty; see ``sp_build_decode_batch``), then the slots and positions of
        the rows that take a new KV slot (``k`` each). On stage 0 a speculative row's token
        is -1: the device takes its request's latest draft (``_sp_resolve_rows``)."""
        need = self.sp.slots.needs_slot(rows)
        n, k = len(rows), int(np.count_nonzero(need))
        h = (n + 1) // 2
        a = n if alternatives is not None else 0
        host = np.empty(4 * n + h + 2 * a + 2 * k, dtype=np.int64)
        tokens = host[:n]
        tokens[:] = rows.token
        if self.sp.rank0:
            tokens[rows.is_spec] = -1
        host[n : 2 * n] = rows.slot
        host[2 * n : 3 * n] = rows.position
        lens = host[3 * n : 4 * n]
        np.add(rows.position, 1, out=lens)
        host[4 * n : 4 * n + h].view(np.int32)[:n] = lens
        at = 4 * n + h
        if a:
            host[at : at + n] = alternatives
            host[at + n : at + 2 * n] = transit_rows
        at += 2 * a
        if k:
            host[at : at + k] = rows.slot[need]
            host[at + k :] = rows.position[need]
        meta_cpu = torch.from_numpy(host)
        meta = self.sp.staging.to_device(meta_cpu)
        parts = meta.split((n, n, n, n, h, a, a, k, k))  # one call for every view
        if meta is meta_cpu:
            parts_cpu = parts[1], parts[3]
        else:
            parts_cpu = meta_cpu[n : 2 * n], meta_cpu[3 * n : 4 * n]
        if k == 0:
            return parts_cpu, parts
        new_slot_of, new_position = parts[7], parts[8]
        if self.token_to_kv_pool_allocator.page_size == 1:
            new_slots = self.token_to_kv_pool_allocator.alloc(k)
        else:
            new_slots = self._sp_alloc_paged(new_slot_of, new_position, host[at + k :])
        if new_slots is None:
            raise RuntimeError("Spexis: KV allocation failed after the memory check")
        req_to_token = self.req_to_token_pool.req_to_token
        req_to_token[new_slot_of, new_position] = new_slots.to(req_to_token.dtype)
        # req.kv.kv_allocated_len is brought up to the slot's high-water mark on release
        return parts_cpu, parts

    def _sp_alloc_paged(
        self: SpexisScheduler, slot_of: torch.Tensor, position: torch.Tensor, positions: np.ndarray
    ) -> Optional[torch.Tensor]:
        """KV slots for new positions with ``--page-size > 1`` (SGLang's ``alloc_decode``
        rule): a position that opens a page takes a fresh page's first slot, any other
        continues its predecessor's page. A new position is always the request's next one
        (``needs_slot``: KV covers every position below it), so the predecessor's slot is
        set, by the prefill or by an earlier SP row. ``slot_of`` and ``position`` are on the
        device, ``positions`` the same positions on the host."""
        allocator = self.token_to_kv_pool_allocator
        page = allocator.page_size
        opens = torch.from_numpy(positions % page == 0).to(position.device)
        req_to_token = self.req_to_token_pool.req_to_token
        new_slots = req_to_token[slot_of, (position - 1).clamp_min(0)].to(torch.int64) + 1
        n_pages = int(opens.sum())
        if n_pages:
            pages = allocator.alloc(n_pages * page)
            if pages is None:
                return None
            new_slots[opens] = pages[::page]
        return new_slots

    def sp_fit_memory(self: SpexisScheduler, rows: Rows) -> Rows:
        """Make room for the rows that need new KV memory; speculation gives way first."""
        slots = self.sp.slots
        page = self.token_to_kv_pool_allocator.page_size
        need = self._sp_needs_memory(rows)
        n_need = int(np.count_nonzero(need)) * page
        if n_need == 0:
            return rows
        evict_from_tree_cache(self.tree_cache, n_need)
        avail = self.token_to_kv_pool_allocator.available_size()
        if avail >= n_need:
            return rows
        spec_need = rows.is_spec & need
        if spec_need.any():
            slots.drop(rows.slot[spec_need])
            rows = rows.take(~spec_need)
            need = self._sp_needs_memory(rows)
            n_need = int(np.count_nonzero(need)) * page
            if avail >= n_need:
                return rows
        # Not even the verified rows fit: retract requests (latest first) until they do.
        rows = self.sp_retract(rows, n_need - avail)
        need = self._sp_needs_memory(rows)
        if int(np.count_nonzero(need)) * page <= avail:
            return rows
        # A retracted request's KV returns only once its rows have drained, so this iteration
        # runs the rows that fit; the others simply wait (next_rows is pure: nothing to undo).
        return rows.take(~need | (np.cumsum(need) * page <= avail))

    def _sp_needs_memory(self: SpexisScheduler, rows: Rows) -> np.ndarray:
        """Rows that take KV memory: a new slot, and with ``--page-size > 1`` only a new
        position that opens a page (the others continue their request's last page)."""
        need = self.sp.slots.needs_slot(rows)
        page = self.token_to_kv_pool_allocator.page_size
        return need if page == 1 else need & (rows.position % page == 0)

    def sp_retract(self: SpexisScheduler, rows: Rows, shortfall: int) -> Rows:
        self.sp_flush_tokens()
        reqs = self.sp.req_at[rows.slot].tolist()
        order = sorted(
            range(len(reqs)),
            key=lambda i: (len(reqs[i].output_ids), -len(reqs[i].origin_input_ids)),
        )
        retracted = []
        while shortfall > 0 and len(order) > 1:
            req = reqs[order.pop()]
            retracted.append(req.req_pool_idx)
            allocated = int(self.sp.slots.allocated_len(req.req_pool_idx)[0])
            shortfall -= 1 + max(0, allocated - req.kv_committed_len)
            shortfall -= req.kv_committed_len  # freed once its rows have drained
            self._sp_release(req, retracted=True)
            logger.info("Spexis: KV cache pool is full, retracting request %s", req.rid)
        if retracted:
            # as SGLang's retract_decode: reserve what the remaining requests have shown
            req_at = self.sp.req_at
            kept = [r for r in self.sp.running.reqs if req_at[r.req_pool_idx] is r]
            self.new_token_ratio_tracker.current = (
                NewTokenRatioTracker.estimate_new_token_ratio_after_retract(kept)
            )
            self.sp.stats.retractions += len(retracted)
        return rows.without(np.asarray(retracted, dtype=np.int64))
