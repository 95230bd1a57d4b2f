"""`C128Sidecar`: C128 pages (compressed KV of the HCA layers), refcounted, and each request's sidecar table.

One C128 page holds `c128_page_size` compressed entries, i.e. covers `group_tokens = hca_ratio * c128_page_size`
tokens. A page is shared by the requests and tree nodes that hold it (its refcount is their number); only complete
pages enter the tree, a request's partial tail page stays its own.
"""

from __future__ import annotations

import math

import torch

from pdspark.cache.page_allocator import PoolUsage, RefCountedPageAllocator
from pdspark.cache.pool_sizes import PoolSizes
from pdspark.model.model_config import ModelConfig


class C128Sidecar:
    def __init__(self, model: ModelConfig, sizes: PoolSizes):
        self.has_layers = bool(model.hca_layers)
        self.hca_ratio = model.hca_ratio
        self.entries_per_page = sizes.c128_page_size
        self.group_tokens = model.hca_ratio * sizes.c128_page_size  # tokens covered by one C128 page
        self._pages = RefCountedPageAllocator(sizes.num_c128_pages, "c128")
        max_pages = math.ceil(sizes.max_model_len / self.group_tokens) + 1
        # [req slots, max C128 pages per request] C128 page id of every C128 page index (the sidecar table)
        self.req_to_c128 = torch.zeros(sizes.num_req_slots, max_pages, dtype=torch.long)

    def pages_for(self, num_tokens: int) -> int:
        """C128 pages holding the compressed entries of `num_tokens` tokens (only closed groups have one)."""
        if not self.has_layers:
            return 0
        return math.ceil(num_tokens // self.hca_ratio / self.entries_per_page)

    @property
    def num_free(self) -> int:
        return self._pages.num_free

    def can_allocate(self, n: int) -> bool:
        return self._pages.can_allocate(n)

    def allocate(self, slot: int, first: int, n: int) -> list[int]:
        """`n` new pages (refcount 1) for request `slot`'s C128 page indices `first ..`, entered in its table."""
        pages = self._pages.allocate(n)
        self.point(slot, first, pages)
        return pages

    def point(self, slot: int, first: int, pages: list[int]) -> None:
        if pages:
            self.req_to_c128[slot, first : first + len(pages)] = torch.tensor(pages, dtype=torch.long)

    def retain(self, pages: list[int]) -> None:
        self._pages.retain(pages)

    def release(self, pages: list[int]) -> None:
        self._pages.release(pages)

    def usage(self) -> PoolUsage:
        return self._pages.usage()

    def check_integrity(self, held: list[int]) -> None:
        """`held`: every C128 page once per holder (request rows and tree nodes)."""
        self._pages.check_integrity()
        self._pages.check_holders(held)
