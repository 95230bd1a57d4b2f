"""`ApproxPrefixTree`: the router's guess of which prefill worker holds which prompt prefix in its cache.

Approximate by design: the router records the prompts it sent, not what the worker kept (a worker may evict).
Token blocks of `block` tokens keep the tree small; each node remembers which workers were sent that prefix and
when, and the tree forgets the least recently used blocks past `max_blocks`, leaves first.

NOTE: every node but the root sits in one `OrderedDict`, least recently used first. An insert stamps its whole
path and moves it to the back deepest node first, so a parent is never ahead of its children: the front is always
a leaf, the least recently used one, and forgetting a block costs O(1) however big the tree (it runs on the
router's event loop, once per block past the limit).
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import dataclass, field

_clock = itertools.count()


@dataclass(eq=False)
class _Node:
    children: dict[tuple[int, ...], _Node] = field(default_factory=dict)
    workers: dict[str, int] = field(default_factory=dict)  # worker -> last use
    parent: _Node | None = None
    key: tuple[int, ...] = ()
    depth: int = 0  # blocks from the root

    @property
    def last_use(self) -> int:
        """The latest use by any worker it remembers (-1 when it remembers none)."""
        return max(self.workers.values(), default=-1)


class ApproxPrefixTree:
    def __init__(self, block: int = 16, max_blocks: int = 100_000):
        self.block = block
        self.max_blocks = max_blocks
        self.root = _Node()
        self.num_blocks = 0
        self._lru: OrderedDict[_Node, None] = OrderedDict()  # every node but the root, least recently used first

    def _blocks(self, tokens: list[int]):
        b = self.block
        for i in range(0, len(tokens) - len(tokens) % b, b):
            yield tuple(tokens[i : i + b])

    def insert(self, tokens: list[int], worker: str) -> None:
        stamp = next(_clock)
        node = self.root
        path = []
        for key in self._blocks(tokens):
            child = node.children.get(key)
            if child is None:
                child = node.children[key] = _Node(parent=node, key=key, depth=node.depth + 1)
                self.num_blocks += 1
            child.workers[worker] = stamp
            path.append(child)
            node = child
        for n in reversed(path):
            self._lru[n] = None
            self._lru.move_to_end(n)
        while self.num_blocks > self.max_blocks:
            self._evict_one()

    def match(self, tokens: list[int]) -> dict[str, int]:
        """Matched prefix length (tokens) per worker."""
        out: dict[str, int] = {}
        node, depth = self.root, 0
        for key in self._blocks(tokens):
            node = node.children.get(key)  # type: ignore[assignment]
            if node is None:
                break
            depth += self.block
            for w in node.workers:
                out[w] = depth
        return out

    def remove_worker(self, worker: str) -> None:
        for n in self._lru:
            n.workers.pop(worker, None)
        # A node's last use is now its remaining workers' (-1 with none left): re-sort, deeper nodes first among
        # equals (a child's last use is never later than its parent's, so leaves stay ahead of their parents).
        # O(n log n), as rare as a worker leaving.
        self._lru = OrderedDict.fromkeys(sorted(self._lru, key=lambda n: (n.last_use, -n.depth)))

    def _evict_one(self) -> None:
        leaf, _ = self._lru.popitem(last=False)
        assert not leaf.children and leaf.parent is not None, "the least recently used node must be a leaf"
        del leaf.parent.children[leaf.key]
        self.num_blocks -= 1
