"""`RadixCache` on its own (a recording freer, no tensors): eviction order and the cost of finding a victim."""

from __future__ import annotations

import pytest

from pdspark.cache.radix_cache import RadixCache

P = 4


class Recorder:
    """A `TreeFreer` that records what the tree lets go of."""

    def __init__(self):
        self.freed_full: list[int] = []
        self.freed_swa: list[int] = []

    def free_full(self, pages):
        self.freed_full += pages

    def free_swa(self, full_pages, swa_pages):
        self.freed_swa += swa_pages

    def release_c128(self, pages):
        pass

    def retain_c128(self, pages):
        pass

    def map_swa(self, full_pages, swa_pages):
        pass


def tree_with_leaves(n: int) -> tuple[RadixCache, Recorder]:
    """`n` one-page prompts `[i] * P` under the root, inserted in order (leaf i holds full page i, SWA page
    100 + i), so leaf 0 is the least recently used."""
    freer = Recorder()
    tree = RadixCache(P, None, P - 1, freer)
    for i in range(n):
        tree.insert([i] * P, [i], [100 + i], [])
    return tree, freer


def test_eviction_takes_the_least_recently_used_leaf_first():
    tree, freer = tree_with_leaves(4)
    assert tree.match_prefix([0] * P + [9], P).length == P  # touch leaf 0: now leaf 1 is the oldest
    for _ in range(4):
        tree.evict(full_pages=1)
    assert freer.freed_full == [1, 2, 3, 0]


def test_a_locked_leaf_is_skipped_and_keeps_its_place_once_unlocked():
    tree, freer = tree_with_leaves(3)
    match = tree.match_prefix([0] * P + [9], P)  # touches leaf 0 ...
    tree.lock(match.node)
    tree.evict(full_pages=1)
    assert freer.freed_full == [1]
    tree.insert([1] * P, [7], [107], [])  # a newer leaf
    tree.unlock(match.node)
    tree.evict(full_pages=2)
    assert freer.freed_full == [1, 2, 0]  # ... so it goes after leaf 2 but before the newer leaf (page 7)
    tree.flush()
    assert freer.freed_full == [1, 2, 0, 7]
    assert sorted(freer.freed_swa) == [100, 101, 102, 107]


def test_swa_eviction_takes_the_least_recently_used_node_and_tombstone_leaves_go_first():
    tree, freer = tree_with_leaves(3)
    tree.insert([0] * P + [5] * P, [0, 3], [100, 103], [])  # leaf 0 becomes an inner node (touched)
    tree.evict(swa_pages=1)  # leaf 1 is the oldest unlocked node holding SWA: removed whole (it is a leaf)
    assert freer.freed_full == [1] and freer.freed_swa == [101]
    match = tree.match_prefix([0] * P + [5] * P + [9], 2 * P)
    tree.lock(match.node)
    tree.evict(swa_pages=2)  # leaf 2, then the inner node [0]*P (not a leaf: it keeps FULL, a tombstone)
    assert freer.freed_full == [1, 2] and freer.freed_swa == [101, 102, 100]
    tree.unlock(match.node)
    tree.insert([6] * P, [8], [108], [])
    tree.evict(full_pages=1)  # the newest leaf has SWA; [0]*P -> [5]*P is older and goes first
    assert freer.freed_full == [1, 2, 3]


def test_a_leaf_passed_over_while_locked_is_evictable_once_unlocked():
    freer = Recorder()
    tree = RadixCache(P, None, P - 1, freer)
    oldest = tree.insert([0] * P, [0], [100], []).node
    tree.insert([1] * P, [1], [101], [])
    tree.lock(oldest)
    tree.evict(full_pages=2)  # looks at the locked leaf first, passes over it
    assert freer.freed_full == [1]
    tree.unlock(oldest)
    tree.check_integrity()
    tree.evict(full_pages=1)
    assert freer.freed_full == [1, 0]


def test_a_node_passed_over_while_swa_locked_gives_up_its_swa_once_unlocked():
    freer = Recorder()
    tree = RadixCache(P, None, P - 1, freer)
    inner = tree.insert([0] * P, [0], [100], []).node
    tree.insert([0] * P + [2] * P, [0, 2], [100, 102], [])  # `inner` is no leaf now; both have the same stamp
    tree.insert([1] * P, [1], [101], [])
    lock = tree.lock_swa(inner)
    tree.evict(swa_pages=2)  # passes over the SWA-locked inner node
    assert freer.freed_swa == [102, 101] and freer.freed_full == [2, 1]
    tree.unlock_swa(lock)
    tree.check_integrity()
    tree.evict(swa_pages=1)
    assert freer.freed_swa == [102, 101, 100] and freer.freed_full == [2, 1, 0]


@pytest.mark.parametrize("n", [50, 400])
def test_finding_a_victim_does_not_scan_the_tree(monkeypatch, n):
    """Timing-free complexity guard: evicting one leaf checks a handful of candidates, however big the tree."""
    checks = 0
    removable = RadixCache._removable

    def counting(node):
        nonlocal checks
        checks += 1
        return removable(node)

    monkeypatch.setattr(RadixCache, "_removable", staticmethod(counting))
    tree, freer = tree_with_leaves(n)
    checks = 0
    tree.evict(full_pages=3)
    assert freer.freed_full == [0, 1, 2]
    assert checks <= 6
