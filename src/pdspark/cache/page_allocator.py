"""`PageAllocator`: hands out integer page ids from a fixed range; `RefCountedPageAllocator` adds sharing.

Pure Python bookkeeping (no tensors): the pools that hold data are addressed by the ids handed out here.
"""

from __future__ import annotations

import heapq
from collections import Counter
from typing import NamedTuple


class PoolUsage(NamedTuple):
    used: int  # pages handed out (pages the prefix tree holds count as used)
    total: int


class PageAllocator:
    def __init__(self, num_pages: int, name: str = "pages"):
        assert num_pages >= 0
        self.name = name
        self.num_pages = num_pages
        # A min-heap: an allocation takes the lowest free pages, in ascending order. One request's pages then form
        # few contiguous runs, on a fresh pool and after others freed theirs (a transfer writes one span per pool
        # kind per run; the pools are page-major, `kv_pools.py`).
        self._free: list[int] = list(range(num_pages))
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._used)

    def usage(self) -> PoolUsage:
        return PoolUsage(len(self._used), self.num_pages)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        """Take `n` pages. The caller checks `can_allocate` first; running short is a bug here."""
        assert n <= len(self._free), f"{self.name}: asked for {n} pages, {len(self._free)} free"
        pages = [heapq.heappop(self._free) for _ in range(n)]
        self._used.update(pages)
        return pages

    def free(self, pages: list[int]) -> None:
        for p in pages:
            assert p in self._used, f"{self.name}: double free of page {p}"
            self._used.remove(p)
            heapq.heappush(self._free, p)

    def check_integrity(self) -> None:
        free = set(self._free)
        assert len(free) == len(self._free), f"{self.name}: a page is on the free list twice"
        assert not (free & self._used), f"{self.name}: a page is both free and used"
        assert len(free) + len(self._used) == self.num_pages, f"{self.name}: free + used != total"
        assert all(0 <= p < self.num_pages for p in free | self._used), f"{self.name}: page id out of range"

    def check_holders(self, held: list[int]) -> None:
        """`held` lists every page once per holder: each used page must have exactly one, free pages none."""
        assert len(held) == len(set(held)), f"{self.name}: a page has two owners"
        assert set(held) == self._used, f"{self.name}: owned pages differ from used pages"


class RefCountedPageAllocator(PageAllocator):
    """Pages with several holders (request rows and radix nodes). A page returns to the free list at refcount 0."""

    def __init__(self, num_pages: int, name: str = "pages"):
        super().__init__(num_pages, name)
        self.refcount: dict[int, int] = {}

    def allocate(self, n: int) -> list[int]:
        pages = super().allocate(n)
        for p in pages:
            self.refcount[p] = 1
        return pages

    def retain(self, pages: list[int]) -> None:
        for p in pages:
            assert self.refcount.get(p, 0) > 0, f"{self.name}: retain of free page {p}"
            self.refcount[p] += 1

    def release(self, pages: list[int]) -> list[int]:
        """Drop one reference from each page; returns the pages that became free."""
        freed = []
        for p in pages:
            count = self.refcount.get(p, 0)
            assert count > 0, f"{self.name}: release of free page {p}"
            if count == 1:
                del self.refcount[p]
                freed.append(p)
            else:
                self.refcount[p] = count - 1
        super().free(freed)
        return freed

    def free(self, pages: list[int]) -> None:
        raise AssertionError("refcounted pages are released, not freed")

    def check_integrity(self) -> None:
        super().check_integrity()
        assert set(self.refcount) == self._used, f"{self.name}: refcount keys differ from used pages"
        assert all(c > 0 for c in self.refcount.values()), f"{self.name}: non-positive refcount"

    def check_holders(self, held: list[int]) -> None:
        """`held` lists every page once per holder: the refcounts must be exactly these counts."""
        assert dict(Counter(held)) == self.refcount, f"{self.name}: refcounts differ from the number of holders"
