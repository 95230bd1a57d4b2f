"""`ApproxPrefixTree`: the router's guess of which prefill worker holds which prompt prefix in its cache.

Approximate by design: the router records the prompts it sent, not what the worker kept (a worker may evict).
Token blocks of `block` tokens keep the tree small; each node remembers which workers were sent that prefix and
when, and the tree forgets the least recently used blocks past `max_blocks`.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

_clock = itertools.count()


@dataclass(eq=False)
class _Node:
    children: dict[tuple[int, ...], _Node] = field(default_factory=dict)
    workers: dict[str, int] = field(default_factory=dict)  # worker -> last use
    parent: _Node | None = None
    key: tuple[int, ...] = ()


class ApproxPrefixTree:
    def __init__(self, block: int = 16, max_blocks: int = 100_000):
        self.block = block
        self.max_blocks = max_blocks
        self.root = _Node()
        self.num_blocks = 0

    def _blocks(self, tokens: list[int]):
        b = self.block
        for i in range(0, len(tokens) - len(tokens) % b, b):
            yield tuple(tokens[i : i + b])

    def insert(self, tokens: list[int], worker: str) -> None:
        stamp = next(_clock)
        node = self.root
        for key in self._blocks(tokens):
            child = node.children.get(key)
            if child is None:
                child = node.children[key] = _Node(parent=node, key=key)
                self.num_blocks += 1
            child.workers[worker] = stamp
            node = child
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
        stack = [self.root]
        while stack:
            n = stack.pop()
            n.workers.pop(worker, None)
            stack.extend(n.children.values())

    def _evict_one(self) -> None:
        oldest, stack = None, [self.root]
        while stack:
            n = stack.pop()
            stack.extend(n.children.values())
            if n is not self.root and not n.children:
                age = max(n.workers.values(), default=-1)
                if oldest is None or age < oldest[0]:
                    oldest = (age, n)
        if oldest is not None:
            leaf = oldest[1]
            del leaf.parent.children[leaf.key]  # type: ignore[union-attr]
            self.num_blocks -= 1
