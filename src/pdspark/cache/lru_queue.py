"""`LruQueue`: items ordered by a rank (least recently used first), for picking eviction victims in O(log n).

A binary heap with lazy invalidation. The owner calls `push(item)` whenever the item's rank changes or it may
have become eligible (unlocked, became a leaf, ...); the newest entry of an item supersedes the older ones, which
stay in the heap until popped or compacted. Eligibility is checked again when an entry is popped, so an item that
became ineligible needs no call: its entry is dropped then, and the owner pushes it again once it is eligible.

Invariant (`holds`): every eligible item has a current entry.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Hashable
from typing import Any, Generic, TypeVar

T = TypeVar("T", bound=Hashable)


class LruQueue(Generic[T]):
    def __init__(self, eligible: Callable[[T], bool], rank: Callable[[T], tuple[Any, ...]]):
        self._eligible = eligible
        self._rank = rank
        # (rank, entry id, item); ids break rank ties in push order
        self._heap: list[tuple[tuple[Any, ...], int, T]] = []
        self._current: dict[T, int] = {}  # item -> id of its current entry (items with one)
        self._ids = itertools.count()
        self.num_inspected = 0  # entries popped so far (a cost measure for tests)

    def push(self, item: T) -> None:
        """Record the item's current rank, if it is eligible now (its older entries become stale)."""
        self._current.pop(item, None)
        if not self._eligible(item):
            return
        entry_id = next(self._ids)
        self._current[item] = entry_id
        heapq.heappush(self._heap, (self._rank(item), entry_id, item))
        if len(self._heap) > 2 * len(self._current) + 64:
            self._compact()

    def discard(self, item: T) -> None:
        """Forget the item (it left the structure the queue ranks)."""
        self._current.pop(item, None)

    def pop(self) -> T | None:
        """The lowest-ranked eligible item, removed from the queue (push it again if it stays); None if none."""
        while self._heap:
            _, entry_id, item = heapq.heappop(self._heap)
            self.num_inspected += 1
            if self._current.get(item) != entry_id:
                continue  # superseded
            del self._current[item]
            if self._eligible(item):
                return item
        return None

    def holds(self, item: T) -> bool:
        """Whether the item has a current entry."""
        return item in self._current

    def _compact(self) -> None:
        self._heap = [e for e in self._heap if self._current.get(e[2]) == e[1]]
        heapq.heapify(self._heap)
