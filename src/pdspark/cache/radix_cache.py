"""`RadixCache`: the prefix cache, a radix tree over page-aligned token blocks with per-node components.

Components of a node covering tokens `[start, end)` (a whole number of pages):
- FULL: `full_pages`, one full page per page of the key. The C4 rows of those tokens live at
  `full_slot // csa_ratio`, so they come with the full pages.
- SWA: `swa_pages` (one per full page), or None: a tombstone, the SWA data was evicted and only FULL remains. The
  page-scoped CSA compressor state lives in the SWA pages and follows them.
- C128 sidecar: `c128_page`, only on nodes whose `end` is a C128 group boundary (`group_tokens` =
  `hca_ratio * c128_page_size`); that node holds one reference on the page covering `[end - group_tokens, end)`.

Rules:
- A match ends on a page boundary, on a C128 group boundary when the model has HCA layers, and only where the last
  `window_tokens` tokens before it still hold SWA pages (the window and the CSA overlap rows the next tokens read).
- Locks: a request using a match holds a FULL lock on the path root -> match node (never evicted) and an SWA lock
  on the nodes covering the window before the match end (their SWA pages are never evicted); it gives the SWA lock
  back once its own window has moved past them.
- Insertion over a tombstone adopts the inserting request's SWA pages for it (the request computed the same tokens).
- Eviction: least recently used unlocked leaf first; evicting a leaf frees every component and may expose its
  parent. The SWA pages of a node without an SWA lock may be evicted alone, leaving a tombstone (an unlocked leaf
  is removed instead). Tombstone leaves are useless (no match can end there) and are evicted with priority.
  Victims come from two `LruQueue`s (unlocked leaves; nodes whose SWA pages may go), O(log n) per victim: every
  change of a node's rank or eligibility is pushed to them (`_requeue`).
- C128 pages do not count in the token figures: they are auxiliary to FULL.

The tree never frees a page itself: it hands freed page ids to the owner's callbacks (`TreeFreer`).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

from pdspark.cache.lru_queue import LruQueue


class TreeFreer(Protocol):
    """What the pool owner does with pages the tree lets go of."""

    def free_full(self, pages: list[int]) -> None: ...

    def free_swa(self, full_pages: list[int], swa_pages: list[int]) -> None: ...

    def release_c128(self, pages: list[int]) -> None: ...

    def retain_c128(self, pages: list[int]) -> None: ...

    def map_swa(self, full_pages: list[int], swa_pages: list[int]) -> None:
        """The tree adopted `swa_pages` as the SWA data of `full_pages`."""
        ...


_clock = itertools.count()


@dataclass(eq=False)
class RadixNode:
    key: tuple[int, ...] = ()
    full_pages: list[int] = field(default_factory=list)
    swa_pages: list[int] | None = field(default_factory=list)
    c128_page: int | None = None
    parent: RadixNode | None = None
    children: dict[tuple[int, ...], RadixNode] = field(default_factory=dict)
    lock_ref: int = 0
    # SWA locks through this node, by the first position their window needs (a split keeps each lock on the parts
    # that overlap its window).
    swa_locks: dict[int, int] = field(default_factory=dict)
    last_access: int = 0
    depth: int = 0  # tokens before this node's key

    @property
    def window_pages(self) -> list[int | None]:
        """The SWA page of each full page (None throughout for a tombstone: its SWA pages were evicted)."""
        return list(self.swa_pages) if self.swa_pages is not None else [None] * len(self.full_pages)

    @property
    def end(self) -> int:
        return self.depth + len(self.key)

    @property
    def is_leaf(self) -> bool:
        return not self.children

    @property
    def tombstone(self) -> bool:
        return self.swa_pages is None

    @property
    def swa_lock_ref(self) -> int:
        return sum(self.swa_locks.values())


class SwaLock(NamedTuple):
    node: RadixNode
    need_from: int  # first position the locked window needs


class MatchResult(NamedTuple):
    node: RadixNode  # deepest node of the match (the root when nothing matched)
    length: int  # matched tokens
    full_pages: list[int]
    swa_pages: list[int | None]  # per matched page; None where the tree holds no SWA data
    c128_pages: list[int]  # one per complete C128 group of the match


class InsertResult(NamedTuple):
    node: RadixNode  # the node ending at the inserted key's end
    full_pages: list[int]  # the tree's full page for every page of the key (the request's own where adopted)
    swa_pages: list[int | None]  # the tree's SWA page for every page of the key (None: tombstone)
    c128_pages: list[int]  # the tree's C128 page for every complete group of the key


class TreePages(NamedTuple):
    """The pages the tree holds (each listed once per node holding it)."""

    full_pages: list[int]
    swa_pages: list[int]
    c128_pages: list[int]  # one entry per node reference


class RadixCache:
    def __init__(self, page_size: int, group_tokens: int | None, window_tokens: int, freer: TreeFreer):
        self.page_size = page_size
        self.group_tokens = group_tokens  # None when the model has no HCA layers
        self.window_tokens = window_tokens
        self.freer = freer
        self.root = RadixNode()
        self.root.lock_ref = 1  # never evicted
        self._leaves = LruQueue(self._removable, _leaf_rank)  # unlocked leaves: whole-node victims
        self._swa_holders = LruQueue(self._swa_evictable, _swa_rank)  # nodes whose SWA pages may go alone

    # ---- matching ----------------------------------------------------------------------------------------------------
    def match_prefix(self, tokens: list[int], max_len: int) -> MatchResult:
        """Longest prefix of `tokens[:max_len]` valid for every component. Touches (LRU) the matched path."""
        P = self.page_size
        path: list[RadixNode] = []
        node, pos = self.root, 0
        while pos + P <= max_len:
            child = node.children.get(tuple(tokens[pos : pos + P]))
            if child is None:
                break
            n = _common_pages(child.key, tokens[pos:max_len], P)
            if n < len(child.key):
                if n == 0:
                    break
                child = self._split(child, n)
            path.append(child)
            node, pos = child, child.end
        # Walk back to the deepest end point that satisfies the component rules.
        while path and not self._valid_end(path):
            path.pop()
        stamp = next(_clock)
        for hit in path:
            hit.last_access = stamp
            self._requeue(hit)
        end = path[-1] if path else self.root
        full = [p for hit in path for p in hit.full_pages]
        swa: list[int | None] = []
        for hit in path:
            swa += hit.window_pages
        c128 = [n.c128_page for n in path if n.c128_page is not None]
        return MatchResult(end, end.end, full, swa, c128)

    def _valid_end(self, path: list[RadixNode]) -> bool:
        end = path[-1].end
        if self.group_tokens is not None and (end % self.group_tokens or path[-1].c128_page is None):
            return False
        # Every page overlapping the last `window_tokens` tokens must still hold SWA data.
        need_from = max(0, end - self.window_tokens)
        for n in reversed(path):
            if n.end <= need_from:
                break
            if n.tombstone:
                return False
        return True

    # ---- locks -------------------------------------------------------------------------------------------------------
    def lock(self, node: RadixNode) -> None:
        at: RadixNode | None = node
        while at is not None:
            at.lock_ref += 1
            at = at.parent

    def unlock(self, node: RadixNode) -> None:
        at: RadixNode | None = node
        while at is not None:
            assert at.lock_ref > 0, "unlock without lock"
            at.lock_ref -= 1
            if at.lock_ref == 0:
                self._leaves.push(at)
            at = at.parent

    def lock_swa(self, node: RadixNode) -> SwaLock:
        """SWA-lock the nodes covering the `window_tokens` before `node.end`; returns what `unlock_swa` takes."""
        lock = SwaLock(node, node.end - self.window_tokens)
        for n in self._window_path(lock):
            n.swa_locks[lock.need_from] = n.swa_locks.get(lock.need_from, 0) + 1
        return lock

    def unlock_swa(self, lock: SwaLock | None) -> None:
        if lock is None:
            return
        for n in self._window_path(lock):
            count = n.swa_locks.get(lock.need_from, 0)
            assert count > 0, "SWA unlock without lock"
            if count == 1:
                del n.swa_locks[lock.need_from]
                if not n.swa_locks:
                    self._requeue(n)
            else:
                n.swa_locks[lock.need_from] = count - 1

    def _window_path(self, lock: SwaLock) -> Iterator[RadixNode]:
        """The nodes from `lock.node` upward that hold tokens at or after `lock.need_from` (splits included)."""
        n: RadixNode | None = lock.node
        while n is not None and n is not self.root and n.end > lock.need_from:
            yield n
            n = n.parent

    # ---- insertion ---------------------------------------------------------------------------------------------------
    def insert(
        self,
        tokens: list[int],
        full_pages: list[int],
        swa_pages: list[int | None],
        c128_pages: list[int],
    ) -> InsertResult:
        """Insert `tokens` (whole pages, whole C128 groups) computed by a request.

        Args:
            tokens: the request's computed tokens, cut to a page (and C128 group) boundary.
            full_pages / swa_pages: the request's pages for `tokens` (swa None where released).
            c128_pages: the request's C128 pages for the complete groups of `tokens`.
        Returns:
            The tree's pages for the whole key. Where they differ from the request's, the tree already held that
            content: the request switches to the tree's pages and frees its own. Where they are equal, the tree
            adopted (or already owned) the request's page.
        """
        P = self.page_size
        assert len(tokens) % P == 0 and len(full_pages) == len(tokens) // P
        node, pos = self.root, 0
        tree_full: list[int] = []
        tree_swa: list[int | None] = []
        stamp = next(_clock)
        while pos < len(tokens):
            child = node.children.get(tuple(tokens[pos : pos + P]))
            if child is None:
                break
            n = _common_pages(child.key, tokens[pos:], P)
            if n < len(child.key):
                child = self._split(child, n)
            child = self._recover_swa(child, swa_pages[pos // P : pos // P + len(child.full_pages)])
            tree_full += child.full_pages
            tree_swa += child.window_pages
            child.last_access = stamp
            self._requeue(child)
            node, pos = child, child.end
        if pos < len(tokens):
            first = pos // P
            node = self._add_leaves(node, tokens[pos:], full_pages[first:], swa_pages[first:], stamp)
            tree_full += full_pages[first:]
            tree_swa += swa_pages[first:]
        return InsertResult(node, tree_full, tree_swa, self._attach_c128(tokens, c128_pages))

    def _recover_swa(self, node: RadixNode, swa: list[int | None]) -> RadixNode:
        """A tombstone whose tokens the request still holds SWA pages for takes them back (the part it holds them
        for, split off first); returns the node the walk continues with."""
        if not node.tombstone or all(p is None for p in swa):
            return node
        first = next(i for i, p in enumerate(swa) if p is not None)
        if first > 0:
            return self._split(node, first * self.page_size)  # the lower part recovers on the next step
        node.swa_pages = _contiguous_tail(swa)
        self.freer.map_swa(node.full_pages, node.swa_pages)
        self._requeue(node)
        return node

    def _add_leaves(
        self, parent: RadixNode, key: list[int], full: list[int], swa: list[int | None], stamp: int
    ) -> RadixNode:
        # Pages whose SWA was already released form a tombstone node in front of the SWA-holding tail.
        P = self.page_size
        cut = next((i for i, s in enumerate(swa) if s is not None), len(swa))
        segments: list[tuple[int, int, list[int] | None]] = [(0, cut, None),
                                                             (cut, len(full), _contiguous_tail(swa[cut:]))]
        for lo, hi, swa_seg in segments:
            if lo == hi:
                continue
            node = RadixNode(
                key=tuple(key[lo * P : hi * P]),
                full_pages=list(full[lo:hi]),
                swa_pages=swa_seg,
                parent=parent,
                last_access=stamp,
                depth=parent.end,
            )
            parent.children[node.key[:P]] = node
            self._requeue(node)
            parent = node
        return parent

    def _attach_c128(self, tokens: list[int], c128_pages: list[int]) -> list[int]:
        """Give every complete C128 group boundary of `tokens` a node carrying that group's page; returns the
        tree's page per group (an earlier insert's page where the node already had one)."""
        if self.group_tokens is None:
            return []
        G, out = self.group_tokens, []
        for k, page in enumerate(c128_pages[: len(tokens) // G]):
            node = self._node_ending_at(tokens, (k + 1) * G)
            if node.c128_page is None:
                node.c128_page = page
                self.freer.retain_c128([page])
            out.append(node.c128_page)
        return out

    def _node_ending_at(self, tokens: list[int], end: int) -> RadixNode:
        node, pos, P = self.root, 0, self.page_size
        while pos < end:
            child = node.children[tuple(tokens[pos : pos + P])]
            if child.end > end:
                child = self._split(child, end - pos)
            node, pos = child, child.end
        return node

    def _split(self, node: RadixNode, n_tokens: int) -> RadixNode:
        """Cut `node` after `n_tokens` (a page multiple); returns the new upper part."""
        P = self.page_size
        assert 0 < n_tokens < len(node.key) and n_tokens % P == 0
        k = n_tokens // P
        upper = RadixNode(
            key=node.key[:n_tokens],
            full_pages=node.full_pages[:k],
            swa_pages=None if node.swa_pages is None else node.swa_pages[:k],
            parent=node.parent,
            lock_ref=node.lock_ref,
            # Only locks whose window reaches into the upper part hold it.
            swa_locks={nf: c for nf, c in node.swa_locks.items() if nf < node.depth + n_tokens},
            last_access=node.last_access,
            depth=node.depth,
        )
        assert node.parent is not None
        node.parent.children[upper.key[:P]] = upper
        node.key = node.key[n_tokens:]
        node.full_pages = node.full_pages[k:]
        if node.swa_pages is not None:
            node.swa_pages = node.swa_pages[k:]
        node.parent = upper
        node.depth = upper.end
        upper.children[node.key[:P]] = node
        # The C128 page stays with the node whose end it marks (the lower part keeps the original end).
        self._requeue(upper)
        self._requeue(node)  # its depth (a tie-break of its rank) moved
        return upper

    # ---- eviction ----------------------------------------------------------------------------------------------------
    def evict(self, full_pages: int = 0, swa_pages: int = 0) -> None:
        """Free at least the asked numbers of pages if possible (fewer when too much is locked)."""
        freed_full = freed_swa = 0
        while freed_full < full_pages or freed_swa < swa_pages:
            if freed_full < full_pages:
                victim = self._leaves.pop()
                if victim is None:
                    break
                f, s = self._remove_leaf(victim)
            else:
                victim = self._swa_holders.pop()
                if victim is None:
                    break
                f, s = self._evict_swa(victim)
            freed_full += f
            freed_swa += s

    @staticmethod
    def _removable(node: RadixNode) -> bool:
        return node.is_leaf and node.lock_ref == 0 and node.swa_lock_ref == 0

    @staticmethod
    def _swa_evictable(node: RadixNode) -> bool:
        return node.parent is not None and node.swa_lock_ref == 0 and not node.tombstone

    def evict_c128(self, pages: int) -> None:
        """Evict unlocked leaves until `pages` C128 references have been dropped (C128 has no token cost)."""
        dropped = 0
        while dropped < pages:
            leaf = self._leaves.pop()
            if leaf is None:
                break
            dropped += leaf.c128_page is not None
            self._remove_leaf(leaf)

    def flush(self) -> None:
        """Evict every unlocked node (removing a leaf may expose its parent, which then comes up too)."""
        while (leaf := self._leaves.pop()) is not None:
            self._remove_leaf(leaf)

    def _requeue(self, node: RadixNode) -> None:
        """The node's rank or eligibility may have changed: record it in both victim queues."""
        self._leaves.push(node)
        self._swa_holders.push(node)

    def _remove_leaf(self, leaf: RadixNode) -> tuple[int, int]:
        """Free every component of `leaf`; returns `(full, swa)` pages freed."""
        f, s = len(leaf.full_pages), 0
        if leaf.swa_pages is not None:
            s = len(leaf.swa_pages)
            self.freer.free_swa(leaf.full_pages, leaf.swa_pages)
        self.freer.free_full(leaf.full_pages)
        if leaf.c128_page is not None:
            self.freer.release_c128([leaf.c128_page])
        assert leaf.parent is not None
        del leaf.parent.children[leaf.key[: self.page_size]]
        self._leaves.discard(leaf)
        self._swa_holders.discard(leaf)
        self._leaves.push(leaf.parent)  # it may have become a leaf
        return f, s

    def _evict_swa(self, node: RadixNode) -> tuple[int, int]:
        """Free the SWA pages of `node` (the whole node when it is an unlocked leaf); returns `(full, swa)`."""
        if self._removable(node):
            return self._remove_leaf(node)  # a leaf without SWA is useless: drop it whole
        assert node.swa_pages is not None
        self.freer.free_swa(node.full_pages, node.swa_pages)
        n = len(node.swa_pages)
        node.swa_pages = None
        self._requeue(node)  # a tombstone now: first in line once it is an unlocked leaf
        return 0, n

    # ---- inspection --------------------------------------------------------------------------------------------------
    def nodes(self) -> Iterator[RadixNode]:
        stack = [self.root]
        while stack:
            n = stack.pop()
            yield n
            stack.extend(n.children.values())

    def held(self) -> TreePages:
        """The full pages, SWA pages and C128 page references the tree holds."""
        held = TreePages([], [], [])
        for n in self.nodes():
            held.full_pages.extend(n.full_pages)
            held.swa_pages.extend(n.swa_pages or [])
            if n.c128_page is not None:
                held.c128_pages.append(n.c128_page)
        return held

    def swa_page_of(self) -> dict[int, int | None]:
        """The SWA page of every full page the tree holds (None on tombstones)."""
        out: dict[int, int | None] = {}
        for n in self.nodes():
            for i, page in enumerate(n.full_pages):
                out[page] = None if n.swa_pages is None else n.swa_pages[i]
        return out

    def check_integrity(self) -> None:
        P = self.page_size
        for n in self.nodes():
            if n is self.root:
                continue
            assert n.parent is not None and n.parent.children.get(n.key[:P]) is n, "broken parent link"
            assert len(n.key) == len(n.full_pages) * P and len(n.key) > 0, "key/page mismatch"
            assert n.swa_pages is None or len(n.swa_pages) == len(n.full_pages), "swa/full mismatch"
            assert n.depth == n.parent.end, "depth mismatch"
            if n.c128_page is not None:
                assert self.group_tokens is not None and n.end % self.group_tokens == 0, "C128 page off boundary"
        for n in self.nodes():
            # A lock counts on its node and every ancestor, so a node holds at least its children's locks.
            assert n.lock_ref >= sum(c.lock_ref for c in n.children.values()), "lock not propagated upward"
            assert n.swa_lock_ref >= 0 and (n.swa_lock_ref == 0 or not n.tombstone), "SWA-locked tombstone"
            assert not self._removable(n) or self._leaves.holds(n), "an evictable leaf is missing from its queue"
            assert not self._swa_evictable(n) or self._swa_holders.holds(n), "an SWA holder is missing from its queue"


def _contiguous_tail(swa: list[int | None]) -> list[int]:
    """The SWA pages of a segment that must hold one on every page (a request's SWA pages are a contiguous tail)."""
    pages = [p for p in swa if p is not None]
    assert len(pages) == len(swa), "a request's SWA pages must be a contiguous tail"
    return pages


def _leaf_rank(node: RadixNode) -> tuple[bool, int, int]:
    # Tombstone leaves first (no match can end there), then least recently used.
    return (not node.tombstone, node.last_access, node.depth)


def _swa_rank(node: RadixNode) -> tuple[int, int]:
    # Least recently used; on one touched path (equal stamps) the shallowest first, whose SWA pages the fewest
    # matches need.
    return (node.last_access, node.depth)


def _common_pages(key: tuple[int, ...], tokens: list[int], P: int) -> int:
    """Tokens (a page multiple) shared by `key` and the start of `tokens`, compared page by page."""
    n = 0
    limit = min(len(key), len(tokens) - len(tokens) % P)
    while n < limit and tuple(tokens[n : n + P]) == key[n : n + P]:
        n += P
    return n
