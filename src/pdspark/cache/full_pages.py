"""`FullPages`: full slots, one per token position, handed out in pages, and each request's position table.

There is no full-attention KV: a full slot addresses the C4 rows (`full_slot // csa_ratio`) and, through
`SwaWindow`'s page map, the SWA slot. Full pages are the prefix tree's FULL component.
"""

from __future__ import annotations

import math

import torch

from pdspark.cache.page_allocator import PageAllocator, PoolUsage
from pdspark.cache.pool_sizes import PoolSizes


class FullPages:
    def __init__(self, sizes: PoolSizes):
        P = self.page_size = sizes.page_size
        self._pages = PageAllocator(sizes.num_full_pages, "full")
        # [req slots, max_pages_per_req * page_size] full slot of every position of each request
        self.req_to_token = torch.zeros(sizes.num_req_slots, sizes.max_pages_per_req * P, dtype=torch.long)
        self._offsets = torch.arange(P, dtype=torch.long)  # [page_size]

    def pages_for(self, num_tokens: int) -> int:
        return math.ceil(num_tokens / self.page_size)

    @property
    def num_free(self) -> int:
        return self._pages.num_free

    def can_allocate(self, n: int) -> bool:
        return self._pages.can_allocate(n)

    def allocate(self, slot: int, first: int, n: int) -> list[int]:
        """`n` new pages for request `slot`'s page indices `first ..`, entered in its table."""
        pages = self._pages.allocate(n)
        self.point(slot, first, pages)
        return pages

    def point(self, slot: int, first: int, pages: list[int]) -> None:
        """Enter `pages` as request `slot`'s page indices `first ..` (its own or borrowed from the tree)."""
        if not pages:
            return
        P = self.page_size
        page_t = torch.tensor(pages, dtype=torch.long)
        self.req_to_token[slot, first * P : (first + len(pages)) * P] = (page_t[:, None] * P + self._offsets).flatten()

    def free(self, pages: list[int]) -> None:
        self._pages.free(pages)

    def usage(self) -> PoolUsage:
        return self._pages.usage()

    def check_integrity(self, held: list[int]) -> None:
        """`held`: every full page each holder (request or tree node) owns."""
        self._pages.check_integrity()
        self._pages.check_holders(held)
