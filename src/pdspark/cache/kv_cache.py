"""`KVCache`: who holds which page, and the index tables the model reads.

Index spaces (see `kv_pools.py` for the tensors):
- full slots: one per token position, handed out in pages of `page_size`. There is no full-attention KV; a full
  slot addresses the C4 rows (`full_slot // csa_ratio`) and, through `full_to_swa_page`, the SWA slot.
- SWA pages: only for pages that still overlap the window (or hold CSA overlap state); released as the request
  moves on.
- C128 pages: refcounted, listed per request in `req_to_c128` (the sidecar table).
- request slots: one row of `req_to_token` / `req_to_c128` and one C128 state ring per running request.

With the prefix cache on, a request starts from a `RadixCache` match: it *borrows* the matched full pages (and the
SWA pages of the window before the match end) from the tree, locks the matched path, and takes its own reference on
each matched C128 page. As its prompt is computed, and when it ends, its computed pages are inserted into the tree
(`cache_computed`): the tree adopts new pages, and where the tree already held the same tokens the request switches
to the tree's pages and frees its own copies. Inserted pages count as borrowed from then on. At the end the request
frees what it still owns (the uncacheable tail) and drops its C128 references.

NOTE: capacity is checked with `reserve` (which may evict from the tree) before `grow`; `grow` never fails halfway.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch

from pdspark.cache.kv_pools import KVPools
from pdspark.cache.page_allocator import PageAllocator, RefCountedPageAllocator
from pdspark.cache.pool_sizes import PoolSizes
from pdspark.cache.radix_cache import RadixCache, RadixNode, SwaLock
from pdspark.model.model_config import ModelConfig


@dataclass
class ReqPages:
    """Pages held by one request. `swa_pages[i]` is None once full page `i` left the window."""

    slot: int
    full_pages: list[int] = field(default_factory=list)
    swa_pages: list[int | None] = field(default_factory=list)
    c128_pages: list[int] = field(default_factory=list)
    num_released: int = 0  # leading full pages whose SWA page has been released
    num_borrowed: int = 0  # leading full pages (and their SWA pages) owned by the prefix tree
    match_node: RadixNode | None = None  # FULL-locked while the request runs
    swa_lock: SwaLock | None = None  # the SWA lock on the window before match_node's end


class PageNeed(NamedTuple):
    full: int
    swa: int
    c128: int


class HostTables(NamedTuple):
    """NumPy views sharing memory with `KVCache`'s host-side tables (for building step indices cheaply)."""

    req_to_token: np.ndarray
    req_to_c128: np.ndarray
    full_to_swa_page: np.ndarray


class KVCache:
    def __init__(
        self,
        model: ModelConfig,
        sizes: PoolSizes,
        dtype: torch.dtype,
        device: torch.device | str,
        enable_prefix_cache: bool = False,
        draft_stages: int = 0,
    ):
        self.model = model
        self.sizes = sizes
        self.pools = KVPools(model, sizes, dtype, device, draft_stages)
        self.has_draft = draft_stages > 0
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
        self._host = HostTables(self.req_to_token.numpy(), self.req_to_c128.numpy(), self.full_to_swa_page.numpy())
        self.live: dict[int, ReqPages] = {}
        self.tree: RadixCache | None = None
        if enable_prefix_cache:
            # Tokens before a match end whose SWA pages must survive: exactly what `keep_from` keeps at a page
            # boundary (the window rows the next query or draft block reads and, with CSA layers, the previous
            # group's overlap rows in the page-scoped state), so that the tree's SWA lock covers every SWA page
            # a request borrows.
            window = max(self._window_rows, model.csa_ratio if model.csa_layers else 0)
            group = self.group_tokens if model.hca_layers else None
            self.tree = RadixCache(P, group, window, self)

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

    def attach_prefix(self, rp: ReqPages, tokens: list[int]) -> int:
        """Start a fresh request from the longest cached prefix of `tokens`; returns the matched length.

        At least one token is left to compute (its logits pick the next token).
        """
        if self.tree is None:
            return 0
        match = self.tree.match_prefix(tokens, len(tokens) - 1)
        if match.length == 0:
            return 0
        n = len(match.full_pages)
        rp.full_pages = list(match.full_pages)
        rp.swa_pages = [None] * n
        rp.c128_pages = []
        self._borrow(rp, match.node, match.full_pages, match.swa_pages, match.c128_pages, match.length)
        return match.length

    def cache_computed(self, rp: ReqPages, tokens: list[int]) -> None:
        """Insert the request's computed `tokens` (whole pages / C128 groups of them) into the prefix tree."""
        if self.tree is None:
            return
        length = self._cacheable_len(len(tokens))
        k = length // self.sizes.page_size
        if k <= rp.num_borrowed:
            return
        groups = length // self.group_tokens if self.model.hca_layers else 0
        res = self.tree.insert(tokens[:length], rp.full_pages[:k], rp.swa_pages[:k], rp.c128_pages[:groups])
        for i in range(rp.num_borrowed, k):
            own_full, own_swa = rp.full_pages[i], rp.swa_pages[i]
            if own_swa is not None and res.swa_pages[i] != own_swa:  # the tree has (or had) its own copy
                self.free_swa([own_full], [own_swa])
            if res.full_pages[i] != own_full:  # the tree already had these tokens: drop our copy
                self.free_full([own_full])
        self._borrow(rp, res.node, res.full_pages, res.swa_pages, res.c128_pages, length)

    def _borrow(self, rp: ReqPages, node: RadixNode, full: list[int], swa: list[int | None], c128: list[int],
                length: int) -> None:
        """Point the request's first `len(full)` pages at the tree's and move its locks to `node`."""
        assert self.tree is not None
        P, n = self.sizes.page_size, len(full)
        self.tree.lock(node)
        swa_lock = self.tree.lock_swa(node)
        if rp.match_node is not None:
            self.tree.unlock(rp.match_node)
        self.tree.unlock_swa(rp.swa_lock)
        rp.match_node, rp.swa_lock = node, swa_lock
        keep_page = self.keep_from(length) // P
        rp.full_pages[:n] = full
        rp.swa_pages[:n] = [s if i >= keep_page else None for i, s in enumerate(swa)]
        rp.num_borrowed = n
        rp.num_released = max(rp.num_released, min(keep_page, n))
        page_t = torch.tensor(full, dtype=torch.long)
        self.req_to_token[rp.slot, : n * P] = (page_t[:, None] * P + self._page_offsets[None, :]).flatten()
        # C128: hold a reference on the tree's page of every cached group instead of our own copy.
        self.c128.retain(c128)
        self.c128.release(rp.c128_pages[: len(c128)])
        rp.c128_pages[: len(c128)] = c128
        if c128:
            self.req_to_c128[rp.slot, : len(c128)] = torch.tensor(c128, dtype=torch.long)

    def close(self, rp: ReqPages, cache_tokens: list[int] | None = None) -> None:
        """Release the request: insert its computed `cache_tokens` into the prefix tree (when on), free the pages
        it still owns, drop its C128 references and locks, free its slot."""
        if cache_tokens is not None:
            self.cache_computed(rp, cache_tokens)
        for i in range(rp.num_borrowed, len(rp.full_pages)):
            swa_page = rp.swa_pages[i]
            if swa_page is not None:
                self.free_swa([rp.full_pages[i]], [swa_page])
        self.free_full(rp.full_pages[rp.num_borrowed :])
        self.c128.release(rp.c128_pages)
        if rp.match_node is not None:
            assert self.tree is not None
            self.tree.unlock(rp.match_node)
            self.tree.unlock_swa(rp.swa_lock)
        self.slots.free([rp.slot])
        del self.live[rp.slot]
        rp.full_pages, rp.swa_pages, rp.c128_pages, rp.match_node, rp.swa_lock = [], [], [], None, None

    def _cacheable_len(self, n_tokens: int) -> int:
        """Only whole pages enter the tree, and only whole C128 groups (a partial group's page stays private)."""
        unit = self.group_tokens if self.model.hca_layers else self.sizes.page_size
        return n_tokens // unit * unit

    def flush_prefix_cache(self) -> None:
        if self.tree is not None:
            self.tree.flush()

    # ---- the tree's callbacks (TreeFreer) ---------------------------------------------------------------------------
    def free_full(self, pages: list[int]) -> None:
        self.full.free(pages)
        if pages:  # a freed page maps to no SWA page (its SWA page may live on, adopted by the tree)
            self.full_to_swa_page[torch.tensor(pages, dtype=torch.long)] = self.pools.swa_dummy_page

    def map_swa(self, full_pages: list[int], swa_pages: list[int]) -> None:
        self.full_to_swa_page[torch.tensor(full_pages, dtype=torch.long)] = torch.tensor(swa_pages, dtype=torch.long)

    def free_swa(self, full_pages: list[int], swa_pages: list[int]) -> None:
        self.swa.free(swa_pages)
        if full_pages:
            self.full_to_swa_page[torch.tensor(full_pages, dtype=torch.long)] = self.pools.swa_dummy_page

    def release_c128(self, pages: list[int]) -> None:
        self.c128.release(pages)

    def retain_c128(self, pages: list[int]) -> None:
        self.c128.retain(pages)

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

    def reserve(self, rp: ReqPages, new_len: int) -> bool:
        """`can_grow`, evicting unlocked prefix-cache pages to make room when needed."""
        if self.can_grow(rp, new_len):
            return True
        if self.tree is None:
            return False
        n = self.need(rp, new_len)
        self.tree.evict(
            full_pages=max(0, n.full - self.full.num_free), swa_pages=max(0, n.swa - self.swa.num_free)
        )
        if not self.c128.can_allocate(n.c128):
            self.tree.evict_c128(n.c128 - self.c128.num_free)
        return self.can_grow(rp, new_len)

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

    def grow_tail(self, rp: ReqPages, length: int) -> None:
        """Pages for a `length`-token prompt whose cache arrives by transfer: full pages for all of it, SWA pages
        only for the pages the next tokens still read (from `keep_from(length)`), C128 pages for its groups."""
        assert not rp.full_pages, "grow_tail fills a fresh request"
        P = self.sizes.page_size
        n = self.need(rp, length)
        first_swa = min(self.keep_from(length) // P, n.full)
        pages = self.full.allocate(n.full)
        swa_pages = self.swa.allocate(n.full - first_swa)
        rp.full_pages = pages
        rp.swa_pages = [None] * first_swa + swa_pages  # type: ignore[list-item]
        rp.num_released = first_swa
        page_t = torch.tensor(pages, dtype=torch.long)
        self.full_to_swa_page[page_t[first_swa:]] = torch.tensor(swa_pages, dtype=torch.long)
        self.req_to_token[rp.slot, : n.full * P] = (page_t[:, None] * P + self._page_offsets[None, :]).flatten()
        if n.c128:
            rp.c128_pages = self.c128.allocate(n.c128)
            self.req_to_c128[rp.slot, : n.c128] = torch.tensor(rp.c128_pages, dtype=torch.long)

    def can_grow_tail(self, rp: ReqPages, length: int) -> bool:
        n = self.need(rp, length)
        swa = n.swa - self.keep_from(length) // self.sizes.page_size
        return self.full.can_allocate(n.full) and self.swa.can_allocate(swa) and self.c128.can_allocate(n.c128)

    @property
    def keep_margin(self) -> int:
        """The most tokens before a request's computed length whose SWA pages `keep_from` keeps."""
        margin = self.model.sliding_window
        if self.model.csa_layers:
            margin = max(margin, 2 * self.model.csa_ratio)
        if self.tree is not None:
            unit = self.group_tokens if self.model.hca_layers else self.sizes.page_size
            margin = max(margin, unit + self.tree.window_tokens)
        return margin

    @property
    def _window_rows(self) -> int:
        """Window rows before `computed_len` the next step reads: W - 1 for the target's query at `computed_len`;
        W with a drafter, whose block at `computed_len` reads W context rows."""
        return self.model.sliding_window - (0 if self.has_draft else 1)

    def keep_from(self, computed_len: int) -> int:
        """First position whose SWA page the request still needs after `computed_len` tokens are computed.

        The next query at `computed_len` reads the window `[computed_len - W + 1, computed_len]`, and when CSA
        layers exist the next closing group reads the previous group's overlap rows, which live in the page-scoped
        state of the SWA page holding them.
        """
        keep = computed_len - self._window_rows
        if self.model.csa_layers:
            R = self.model.csa_ratio
            keep = min(keep, (computed_len // R) * R - R)
        if self.tree is not None:
            # Keep what a later match ending at the last cacheable boundary needs, so that the pages inserted when
            # the request ends can be matched there.
            keep = min(keep, self._cacheable_len(computed_len) - self.tree.window_tokens)
        return max(0, keep)

    def release_window(self, rp: ReqPages, computed_len: int) -> None:
        """Release SWA pages of full pages entirely before `keep_from(computed_len)`."""
        upto = self.keep_from(computed_len) // self.sizes.page_size
        for i in range(rp.num_released, min(upto, len(rp.full_pages))):
            swa_page = rp.swa_pages[i]
            if swa_page is not None:
                if i >= rp.num_borrowed:  # the tree's pages stay with the tree
                    self.free_swa([rp.full_pages[i]], [swa_page])
                rp.swa_pages[i] = None
        rp.num_released = max(rp.num_released, upto)
        if rp.swa_lock is not None and self.keep_from(computed_len) >= rp.swa_lock.node.end:
            assert self.tree is not None
            self.tree.unlock_swa(rp.swa_lock)  # our window has moved past the tree's pages
            rp.swa_lock = None

    # ---- translation ------------------------------------------------------------------------------------------------
    def host_tables(self) -> HostTables:
        """The page tables as NumPy views (the tables stay on the host; they are never reallocated)."""
        return self._host

    def full_to_swa(self, full_slots, tables: HostTables | None = None):
        """SWA slot of each full slot; tensors in and out, or NumPy arrays with `tables=host_tables()`."""
        P = self.sizes.page_size
        page = self.full_to_swa_page if tables is None else tables.full_to_swa_page
        return page[full_slots // P] * P + full_slots % P

    def c4_state_rows(self, full_slots, positions, tables: HostTables | None = None):
        """Page-scoped CSA state row of each position: its SWA page's ring, row `pos % ring` (tensors, or NumPy
        arrays with `tables`). A position whose SWA page was released maps to the state pool's dummy row."""
        ring = self.sizes.csa_ring
        page_of = self.full_to_swa_page if tables is None else tables.full_to_swa_page
        page = page_of[full_slots // self.sizes.page_size]
        rows = page * ring + positions % ring
        # The dummy SWA page has no ring: only its first row exists (`c4_state_dummy_row`).
        released = page == self.pools.swa_dummy_page
        where = torch.where if tables is None else np.where
        return where(released, self.pools.c4_state_dummy_row, rows)

    def c128_state_rows(self, slots: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        ring = self.sizes.hca_ring
        return slots * ring + positions % ring

    # ---- checks -----------------------------------------------------------------------------------------------------
    def check_integrity(self) -> None:
        for alloc in (self.full, self.swa, self.c128, self.slots):
            alloc.check_integrity()
        tree_full, tree_swa, tree_c128 = self.tree.held() if self.tree is not None else ([], [], [])
        own_full = [p for rp in self.live.values() for p in rp.full_pages[rp.num_borrowed :]]
        own_swa = [p for rp in self.live.values() for p in rp.swa_pages[rp.num_borrowed :] if p is not None]
        held_full, held_swa = own_full + tree_full, own_swa + tree_swa
        assert len(held_full) == len(set(held_full)) and set(held_full) == self.full._used, "full pages: owners"
        assert len(held_swa) == len(set(held_swa)) and set(held_swa) == self.swa._used, "SWA pages: owners"
        holders: dict[int, int] = {}
        for p in [p for rp in self.live.values() for p in rp.c128_pages] + tree_c128:
            holders[p] = holders.get(p, 0) + 1
        assert holders == self.c128.refcount, "C128 refcounts differ from the number of holders"
        assert set(self.live) == self.slots._used, "request slots: owners"
        tree_swa_of = self._tree_swa_by_full_page()
        for rp in self.live.values():
            borrowed = set(rp.full_pages[: rp.num_borrowed])
            assert borrowed <= set(tree_full), "a borrowed page left the tree while in use"
            for i in range(rp.num_borrowed):
                if rp.swa_pages[i] is None:
                    continue
                # A borrowed SWA page the request still reads is the tree's, and the request's SWA lock covers it.
                assert tree_swa_of.get(rp.full_pages[i]) == rp.swa_pages[i], "a borrowed SWA page left the tree"
                lock = rp.swa_lock
                assert lock is not None and (i + 1) * self.sizes.page_size > lock.need_from, "borrowed SWA unlocked"
            for page, swa_page in zip(rp.full_pages[rp.num_borrowed :], rp.swa_pages[rp.num_borrowed :]):
                expect = self.pools.swa_dummy_page if swa_page is None else swa_page
                assert int(self.full_to_swa_page[page]) == expect, "full->SWA map out of date"
        if self.tree is not None:
            self.tree.check_integrity()
            for node in self.tree.nodes():
                for i, page in enumerate(node.full_pages):
                    expect = self.pools.swa_dummy_page if node.swa_pages is None else node.swa_pages[i]
                    assert int(self.full_to_swa_page[page]) == expect, "tree full->SWA map out of date"
        self.pools.check_dummy_rows()

    def _tree_swa_by_full_page(self) -> dict[int, int | None]:
        out: dict[int, int | None] = {}
        for node in self.tree.nodes() if self.tree is not None else ():
            for i, page in enumerate(node.full_pages):
                out[page] = None if node.swa_pages is None else node.swa_pages[i]
        return out

    def cached_pages(self) -> dict[str, int]:
        """Pages held only by the prefix cache, per pool (evictable; they count as used in `usage`)."""
        full, swa, c128 = self.tree.held() if self.tree is not None else ([], [], [])
        held_by_requests = {p for rp in self.live.values() for p in rp.c128_pages}
        return {"full": len(full), "swa": len(swa), "c128": len(set(c128) - held_by_requests), "req_slots": 0}

    def usage(self) -> dict[str, tuple[int, int]]:
        """Per pool `(used, total)` pages (tree-held pages count as used)."""
        return {
            a.name: (a.num_used, a.num_pages) for a in (self.full, self.swa, self.c128, self.slots)
        }
