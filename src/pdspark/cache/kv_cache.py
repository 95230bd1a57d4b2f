"""`KVCache`: who holds which page, and the index tables the model reads. The one entry point the engine uses.

A coordinator over one manager per page kind, each owning its allocator and its tables:
- `FullPages` (full_pages.py): full slots, one per token position; `req_to_token`.
- `SwaWindow` (swa_window.py): SWA pages for the positions a request still reads; `full_to_swa_page`; `keep_from`.
- `C128Sidecar` (c128_sidecar.py): refcounted C128 pages; `req_to_c128`.
- `StateRings` (state_rings.py): the compressor-state rows (C4 per SWA page, C128 per request slot).
- request slots: one row of each table and one C128 state ring per running request.
The tensors themselves live in `KVPools` (kv_pools.py); a request's pages in `ReqPages` (req_pages.py).

With the prefix cache on, a request starts from a `RadixCache` match: it *borrows* the matched full pages (and the
SWA pages of the window before the match end) from the tree, locks the matched path, and takes its own reference on
each matched C128 page. As its prompt is computed, and when it ends, its computed pages are inserted into the tree
(`cache_computed`): the tree adopts new pages, and where the tree already held the same tokens the request switches
to the tree's pages and frees its own copies. Inserted pages count as borrowed from then on. At the end the request
frees what it still owns (the uncacheable tail) and drops its C128 references.

NOTE: capacity is checked with `reserve` (which may evict from the tree) before `grow`; `grow` never fails halfway.
"""

from __future__ import annotations

from typing import NamedTuple, cast

import numpy as np
import torch

from pdspark.cache.c128_sidecar import C128Sidecar
from pdspark.cache.full_pages import FullPages
from pdspark.cache.index_arrays import Indices
from pdspark.cache.kv_pools import KVPools
from pdspark.cache.page_allocator import PageAllocator, PoolUsage
from pdspark.cache.pool_sizes import PoolSizes
from pdspark.cache.radix_cache import RadixCache, RadixNode, TreePages
from pdspark.cache.req_pages import ReqPages
from pdspark.cache.state_rings import StateRings
from pdspark.cache.swa_window import SwaWindow
from pdspark.model.model_config import ModelConfig

__all__ = ["HostTables", "KVCache", "PageNeed", "ReqPages"]


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
        kv_cache_dtype: str = "auto",
    ):
        self.model = model
        self.sizes = sizes
        self.pools = KVPools(model, sizes, dtype, device, draft_stages, kv_cache_dtype)
        self.full = FullPages(sizes)
        self.c128 = C128Sidecar(model, sizes)
        self.group_tokens = self.c128.group_tokens  # tokens covered by one C128 page
        # Only whole pages enter the prefix tree, and only whole C128 groups (a partial group's page stays private).
        cache_unit = self.group_tokens if model.hca_layers else sizes.page_size
        self.swa = SwaWindow(model, sizes, self.pools.swa_dummy_page, draft_stages > 0,
                             cache_unit if enable_prefix_cache else None)
        self.rings = StateRings(sizes, self.pools)
        self.slots = PageAllocator(sizes.num_req_slots, "req_slots")
        self._cache_unit = cache_unit
        self._host = HostTables(self.full.req_to_token.numpy(), self.c128.req_to_c128.numpy(),
                                self.swa.full_to_swa_page.numpy())
        self.live: dict[int, ReqPages] = {}
        self.tree: RadixCache | None = None
        if enable_prefix_cache:
            # The tree SWA-locks the `window_tokens` before a match end: what `keep_from` keeps there.
            group = self.group_tokens if model.hca_layers else None
            self.tree = RadixCache(sizes.page_size, group, self.swa.window_tokens, self)

    @property
    def req_to_token(self) -> torch.Tensor:
        """[req slots, max_pages_per_req * page_size] full slot of every position of each request."""
        return self.full.req_to_token

    @property
    def req_to_c128(self) -> torch.Tensor:
        """[req slots, max C128 pages per request] C128 page id of every C128 page index of each request."""
        return self.c128.req_to_c128

    # ---- request lifetime -------------------------------------------------------------------------------------------
    def open(self) -> ReqPages | None:
        """Take a request slot (None when all are busy) and clear its C128 state ring."""
        if not self.slots.can_allocate(1):
            return None
        slot = self.slots.allocate(1)[0]
        rp = ReqPages(slot)
        self.live[slot] = rp
        self.rings.clear_request(slot)
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
        n = len(full)
        self.tree.lock(node)
        swa_lock = self.tree.lock_swa(node)
        if rp.match_node is not None:
            self.tree.unlock(rp.match_node)
        self.tree.unlock_swa(rp.swa_lock)
        rp.match_node, rp.swa_lock = node, swa_lock
        # The SWA lock covers the tree's pages from `keep_from(length)` on (`SwaWindow.window_tokens`).
        keep_page = self.keep_from(length) // self.sizes.page_size
        rp.full_pages[:n] = full
        rp.swa_pages[:n] = [s if i >= keep_page else None for i, s in enumerate(swa)]
        rp.num_borrowed = n
        rp.num_released = max(rp.num_released, min(keep_page, n))
        self.full.point(rp.slot, 0, full)
        # C128: hold a reference on the tree's page of every cached group instead of our own copy.
        self.c128.retain(c128)
        self.c128.release(rp.c128_pages[: len(c128)])
        rp.c128_pages[: len(c128)] = c128
        self.c128.point(rp.slot, 0, c128)

    def close(self, rp: ReqPages, cache_tokens: list[int] | None = None) -> None:
        """Release the request: insert its computed `cache_tokens` into the prefix tree (when on), free the pages
        it still owns, drop its C128 references and locks, free its slot."""
        if cache_tokens is not None:
            self.cache_computed(rp, cache_tokens)
        for i in range(rp.num_borrowed, len(rp.full_pages)):
            swa_page = rp.swa_pages[i]
            if swa_page is not None:
                self.free_swa([rp.full_pages[i]], [swa_page])
        self.free_full(rp.owned_full_pages)
        self.c128.release(rp.c128_pages)
        if rp.match_node is not None:
            assert self.tree is not None
            self.tree.unlock(rp.match_node)
            self.tree.unlock_swa(rp.swa_lock)
        self.slots.free([rp.slot])
        del self.live[rp.slot]
        rp.full_pages, rp.swa_pages, rp.c128_pages, rp.match_node, rp.swa_lock = [], [], [], None, None

    def _cacheable_len(self, n_tokens: int) -> int:
        return n_tokens // self._cache_unit * self._cache_unit

    def flush_prefix_cache(self) -> None:
        if self.tree is not None:
            self.tree.flush()

    # ---- the tree's callbacks (TreeFreer) ---------------------------------------------------------------------------
    def free_full(self, pages: list[int]) -> None:
        self.full.free(pages)
        self.swa.unmap(pages)  # a freed page maps to no SWA page (its SWA page may live on, adopted by the tree)

    def map_swa(self, full_pages: list[int], swa_pages: list[int]) -> None:
        self.swa.map(full_pages, swa_pages)

    def free_swa(self, full_pages: list[int], swa_pages: list[int]) -> None:
        self.swa.free(full_pages, swa_pages)

    def release_c128(self, pages: list[int]) -> None:
        self.c128.release(pages)

    def retain_c128(self, pages: list[int]) -> None:
        self.c128.retain(pages)

    # ---- growth -----------------------------------------------------------------------------------------------------
    def need(self, rp: ReqPages, new_len: int) -> PageNeed:
        """Pages to add so that positions `< new_len` have full slots, SWA slots and C128 pages."""
        full = max(0, self.full.pages_for(new_len) - len(rp.full_pages))
        c128 = max(0, self.c128.pages_for(new_len) - len(rp.c128_pages))
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
        if n.full:
            pages = self.full.allocate(rp.slot, len(rp.full_pages), n.full)
            rp.full_pages += pages
            rp.swa_pages += self.swa.allocate_for(pages)
        if n.c128:
            rp.c128_pages += self.c128.allocate(rp.slot, len(rp.c128_pages), n.c128)

    def grow_tail(self, rp: ReqPages, length: int) -> None:
        """Pages for a `length`-token prompt whose cache arrives by transfer: full pages for all of it, SWA pages
        only for the pages the next tokens still read (from `keep_from(length)`), C128 pages for its groups."""
        assert not rp.full_pages, "grow_tail fills a fresh request"
        n = self.need(rp, length)
        first_swa = min(self.keep_from(length) // self.sizes.page_size, n.full)
        pages = self.full.allocate(rp.slot, 0, n.full)
        rp.full_pages = pages
        rp.swa_pages = [None] * first_swa
        rp.swa_pages += self.swa.allocate_for(pages[first_swa:])
        rp.num_released = first_swa
        if n.c128:
            rp.c128_pages = self.c128.allocate(rp.slot, 0, n.c128)

    def can_grow_tail(self, rp: ReqPages, length: int) -> bool:
        n = self.need(rp, length)
        swa = n.swa - self.keep_from(length) // self.sizes.page_size
        return self.full.can_allocate(n.full) and self.swa.can_allocate(swa) and self.c128.can_allocate(n.c128)

    @property
    def keep_margin(self) -> int:
        """The most tokens before a request's computed length whose SWA pages `keep_from` keeps."""
        return self.swa.keep_margin

    def keep_from(self, computed_len: int) -> int:
        """First position whose SWA page the request still needs after `computed_len` tokens are computed (the
        window its next query or draft block reads, the CSA overlap rows, and with the prefix cache the window
        before the last cacheable boundary)."""
        return self.swa.keep_from(computed_len)

    def release_window(self, rp: ReqPages, computed_len: int) -> None:
        """Release SWA pages of full pages entirely before `keep_from(computed_len)`."""
        keep = self.keep_from(computed_len)
        upto = keep // self.sizes.page_size
        for i in range(rp.num_released, min(upto, len(rp.full_pages))):
            swa_page = rp.swa_pages[i]
            if swa_page is not None:
                if i >= rp.num_borrowed:  # the tree's pages stay with the tree
                    self.free_swa([rp.full_pages[i]], [swa_page])
                rp.swa_pages[i] = None
        rp.num_released = max(rp.num_released, upto)
        if rp.swa_lock is not None and keep >= rp.swa_lock.node.end:
            assert self.tree is not None
            self.tree.unlock_swa(rp.swa_lock)  # our window has moved past the tree's pages
            rp.swa_lock = None

    # ---- translation ------------------------------------------------------------------------------------------------
    def host_tables(self) -> HostTables:
        """The page tables as NumPy views (the tables stay on the host; they are never reallocated)."""
        return self._host

    def full_to_swa(self, full_slots: Indices, tables: HostTables | None = None) -> Indices:
        """SWA slot of each full slot; tensors in and out, or NumPy arrays with `tables=host_tables()`."""
        return self.swa.slots(full_slots, self._page_map(full_slots, tables))

    def c4_state_rows(self, full_slots: Indices, positions: Indices, tables: HostTables | None = None) -> Indices:
        """Page-scoped CSA state row of each position: its SWA page's ring, row `pos % ring` (tensors, or NumPy
        arrays with `tables`). A position whose SWA page was released maps to the state pool's dummy row."""
        return self.rings.c4_rows(full_slots, positions, self._page_map(full_slots, tables))

    def _page_map(self, like: Indices, tables: HostTables | None) -> Indices:
        """The full page -> SWA page map of the kind of `like`: the tensor, or the host tables' NumPy view of it."""
        return cast(Indices, self.swa.full_to_swa_page if tables is None else tables.full_to_swa_page)

    def c128_state_rows(self, slots: Indices, positions: Indices) -> Indices:
        """Request-scoped HCA state row of each position (tensors or NumPy arrays)."""
        return self.rings.c128_rows(slots, positions)

    # ---- checks -----------------------------------------------------------------------------------------------------
    def check_integrity(self) -> None:
        tree = self.tree.held() if self.tree is not None else TreePages([], [], [])
        reqs = list(self.live.values())
        self.full.check_integrity([p for rp in reqs for p in rp.owned_full_pages] + tree.full_pages)
        self.swa.check_integrity([p for rp in reqs for p in rp.owned_swa_pages] + tree.swa_pages)
        self.c128.check_integrity([p for rp in reqs for p in rp.c128_pages] + tree.c128_pages)
        self.slots.check_integrity()
        self.slots.check_holders(list(self.live))
        tree_swa_of = self.tree.swa_page_of() if self.tree is not None else {}
        for rp in reqs:
            assert set(rp.full_pages[: rp.num_borrowed]) <= tree_swa_of.keys(), "a borrowed page left the tree"
            for i in range(rp.num_borrowed):
                if rp.swa_pages[i] is None:
                    continue
                # A borrowed SWA page the request still reads is the tree's, and the request's SWA lock covers it.
                assert tree_swa_of[rp.full_pages[i]] == rp.swa_pages[i], "a borrowed SWA page left the tree"
                lock = rp.swa_lock
                assert lock is not None and (i + 1) * self.sizes.page_size > lock.need_from, "borrowed SWA unlocked"
            self.swa.check_map(rp.owned_full_pages, rp.swa_pages[rp.num_borrowed :], "request")
        if self.tree is not None:
            self.tree.check_integrity()
            self.swa.check_map(list(tree_swa_of), list(tree_swa_of.values()), "tree")
        self.pools.check_dummy_rows()

    def cached_pages(self) -> dict[str, int]:
        """Pages held only by the prefix cache, per pool (evictable; they count as used in `usage`)."""
        tree = self.tree.held() if self.tree is not None else TreePages([], [], [])
        held_by_requests = {p for rp in self.live.values() for p in rp.c128_pages}
        return {"full": len(tree.full_pages), "swa": len(tree.swa_pages),
                "c128": len(set(tree.c128_pages) - held_by_requests), "req_slots": 0}

    def usage(self) -> dict[str, PoolUsage]:
        """Pages used and in all, per pool (`full`, `swa`, `c128`, `req_slots`; tree-held pages count as used)."""
        return {"full": self.full.usage(), "swa": self.swa.usage(), "c128": self.c128.usage(),
                "req_slots": self.slots.usage()}
