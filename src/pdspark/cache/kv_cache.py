"""`KVCache`: who holds which page, and the index tables the model reads.

Index spaces (see `kv_pools.py` for the tensors):
- full slots: one per token position, handed out in pages of `page_size`. There is no full-attention KV; a full
  slot addresses the C4 rows (`full_slot // csa_ratio`) and, through `full_to_swa_page`, the SWA slot.
- SWA pages: only for pages that still overlap the window (or hold CSA overlap state); released as the request
  moves on.
- C128 pages: refcounted, listed per request in `req_to_c128` (the sidecar table).
- request slots: one row of `req_to_token` / `req_to_c128` and one C128 state ring per running request.

NOTE: capacity is checked with `can_grow` before `grow`; `grow` itself never fails halfway.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from pdspark.cache.kv_pools import KVPools
from pdspark.cache.page_allocator import PageAllocator, RefCountedPageAllocator
from pdspark.config import PoolSizes
from pdspark.model.model_config import ModelConfig


@dataclass
class ReqPages:
    """Pages held by one request. `swa_pages[i]` is None once full page `i` left the window."""

    slot: int
    full_pages: list[int] = field(default_factory=list)
    swa_pages: list[int | None] = field(default_factory=list)
    c128_pages: list[int] = field(default_factory=list)
    num_released: int = 0  # leading full pages whose SWA page has been released

    @property
    def num_tokens_capacity(self) -> int:
        return len(self.full_pages)


class PageNeed(NamedTuple):
    full: int
    swa: int
    c128: int


class KVCache:
    def __init__(self, model: ModelConfig, sizes: PoolSizes, dtype: torch.dtype, device: torch.device | str):
        self.model = model
        self.sizes = sizes
        self.device = device
        self.pools = KVPools(model, sizes, dtype, device)
        self.full = PageAllocator(sizes.num_full_pages, "full")
        self.swa = PageAllocator(sizes.num_swa_pages, "swa")
        self.c128 = RefCountedPageAllocator(sizes.num_c128_pages, "c128")
        self.slots = PageAllocator(sizes.num_req_slots, "req_slots")
        P = sizes.page_size
        self.group_tokens = model.hca_ratio * sizes.c128_page_size  # tokens covered by one C128 page
        max_c128 = math.ceil(sizes.max_model_len / self.group_tokens) + 1
        # [slots, max_model_len rounded to pages] full slot of every position
        self.req_to_token = torch.zeros(sizes.num_req_slots, sizes.max_pages_per_req * P, dtype=torch.long)
        # [slots, max C128 pages] C128 page id of every C128 page index (the sidecar table)
        self.req_to_c128 = torch.zeros(sizes.num_req_slots, max_c128, dtype=torch.long)
        # [full pages + 1] SWA page of each full page; the dummy page where there is none
        self.full_to_swa_page = torch.full((sizes.num_full_pages + 1,), self.pools.swa_dummy_page, dtype=torch.long)
        self._page_offsets = torch.arange(P, dtype=torch.long)
        self.live: dict[int, ReqPages] = {}

    # ---- request lifetime -------------------------------------------------------------------------------------------
    def open(self) -> ReqPages | None:
        """Take a request slot (None when all are busy) and clear its C128 state ring."""
        if not self.slots.can_allocate(1):
            return None
        slot = self.slots.allocate(1)[0]
        rp = ReqPages(slot)
        self.live[slot] = rp
        ring = self.sizes.hca_ring
        self.pools.clear_c128_state_rows(torch.arange(slot * ring, (slot + 1) * ring))
        return rp

    def close(self, rp: ReqPages) -> None:
        """Free every page the request holds and its slot."""
        for i, page in enumerate(rp.full_pages):
            self.full_to_swa_page[page] = self.pools.swa_dummy_page
            swa_page = rp.swa_pages[i]
            if swa_page is not None:
                self.swa.free([swa_page])
        self.full.free(rp.full_pages)
        self.c128.release(rp.c128_pages)
        self.slots.free([rp.slot])
        del self.live[rp.slot]
        rp.full_pages, rp.swa_pages, rp.c128_pages = [], [], []

    # ---- growth -----------------------------------------------------------------------------------------------------
    def need(self, rp: ReqPages, new_len: int) -> PageNeed:
        """Pages to add so that positions `< new_len` have full slots, SWA slots and C128 pages."""
        full = max(0, math.ceil(new_len / self.sizes.page_size) - len(rp.full_pages))
        c128 = 0
        if self.model.hca_layers:
            entries = new_len // self.model.hca_ratio
            c128 = max(0, math.ceil(entries / self.sizes.c128_page_size) - len(rp.c128_pages))
        return PageNeed(full, full, c128)

    def can_grow(self, rp: ReqPages, new_len: int) -> bool:
        n = self.need(rp, new_len)
        return self.full.can_allocate(n.full) and self.swa.can_allocate(n.swa) and self.c128.can_allocate(n.c128)

    def grow(self, rp: ReqPages, new_len: int) -> None:
        assert new_len <= self.sizes.max_model_len, "grow past max_model_len"
        n = self.need(rp, new_len)
        P = self.sizes.page_size
        if n.full:
            first = len(rp.full_pages)
            pages = self.full.allocate(n.full)
            swa_pages = self.swa.allocate(n.swa)
            rp.full_pages.extend(pages)
            rp.swa_pages.extend(swa_pages)
            page_t = torch.tensor(pages, dtype=torch.long)
            self.full_to_swa_page[page_t] = torch.tensor(swa_pages, dtype=torch.long)
            slots = (page_t[:, None] * P + self._page_offsets[None, :]).flatten()
            self.req_to_token[rp.slot, first * P : (first + n.full) * P] = slots
        if n.c128:
            first = len(rp.c128_pages)
            pages = self.c128.allocate(n.c128)
            rp.c128_pages.extend(pages)
            self.req_to_c128[rp.slot, first : first + n.c128] = torch.tensor(pages, dtype=torch.long)

    def keep_from(self, computed_len: int) -> int:
        """First position whose SWA page the request still needs after `computed_len` tokens are computed.

        The next query at `computed_len` reads the window `[computed_len - W + 1, computed_len]`, and when CSA
        layers exist the next closing group reads the previous group's overlap rows, which live in the page-scoped
        state of the SWA page holding them.
        """
        keep = computed_len - self.model.sliding_window + 1
        if self.model.csa_layers:
            R = self.model.csa_ratio
            keep = min(keep, (computed_len // R) * R - R)
        return max(0, keep)

    def release_window(self, rp: ReqPages, computed_len: int) -> int:
        """Release SWA pages of full pages entirely before `keep_from(computed_len)`; returns how many."""
        upto = self.keep_from(computed_len) // self.sizes.page_size
        released = 0
        for i in range(rp.num_released, min(upto, len(rp.full_pages))):
            swa_page = rp.swa_pages[i]
            if swa_page is not None:
                self.swa.free([swa_page])
                rp.swa_pages[i] = None
                self.full_to_swa_page[rp.full_pages[i]] = self.pools.swa_dummy_page
                released += 1
        rp.num_released = max(rp.num_released, upto)
        return released

    # ---- translation ------------------------------------------------------------------------------------------------
    def full_to_swa(self, full_slots: torch.Tensor) -> torch.Tensor:
        P = self.sizes.page_size
        return self.full_to_swa_page[full_slots // P] * P + full_slots % P

    def c4_state_rows(self, full_slots: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Page-scoped CSA state row of each position: its SWA page's ring, row `pos % ring`."""
        ring = self.sizes.csa_ring
        return self.full_to_swa_page[full_slots // self.sizes.page_size] * ring + positions % ring

    def c128_state_rows(self, slots: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        ring = self.sizes.hca_ring
        return slots * ring + positions % ring

    # ---- checks -----------------------------------------------------------------------------------------------------
    def check_integrity(self) -> None:
        for alloc in (self.full, self.swa, self.c128, self.slots):
            alloc.check_integrity()
        held_full = [p for rp in self.live.values() for p in rp.full_pages]
        held_swa = [p for rp in self.live.values() for p in rp.swa_pages if p is not None]
        assert len(held_full) == len(set(held_full)) and set(held_full) == self.full._used, "full pages: owners"
        assert len(held_swa) == len(set(held_swa)) and set(held_swa) == self.swa._used, "SWA pages: owners"
        holders: dict[int, int] = {}
        for rp in self.live.values():
            for p in rp.c128_pages:
                holders[p] = holders.get(p, 0) + 1
        assert holders == self.c128.refcount, "C128 refcounts differ from the number of holders"
        assert set(self.live) == self.slots._used, "request slots: owners"
        for rp in self.live.values():
            for page, swa_page in zip(rp.full_pages, rp.swa_pages):
                expect = self.pools.swa_dummy_page if swa_page is None else swa_page
                assert int(self.full_to_swa_page[page]) == expect, "full->SWA map out of date"
        self.pools.check_dummy_rows()

    def usage(self) -> dict[str, tuple[int, int]]:
        """Per pool `(used, total)` pages."""
        return {
            a.name: (a.num_used, a.num_pages) for a in (self.full, self.swa, self.c128, self.slots)
        }
