"""Routing policies, chosen separately for prefill and decode: `round_robin`, `power_of_two`, `cache_aware`.

A policy picks one healthy worker for a prompt; `cache_aware` (prefill only) prefers the worker whose cache most
likely holds the longest prefix of the prompt, unless that worker is busier than the least loaded one by more
than `balance_threshold` requests.
"""

from __future__ import annotations

import itertools
import random
from typing import Protocol

from pdspark.router.workers.approx_prefix_tree import ApproxPrefixTree
from pdspark.router.workers.worker_registry import WorkerInfo

POLICIES = ("round_robin", "power_of_two", "cache_aware")


class Policy(Protocol):
    def select(self, workers: list[WorkerInfo], prompt_ids: list[int]) -> WorkerInfo:
        """Pick one of `workers` (non-empty, all healthy) for the prompt."""
        ...

    def forget(self, address: str) -> None:
        """Drop what the policy remembers about a removed worker."""
        ...


class RoundRobin:
    def __init__(self) -> None:
        self._counter = itertools.count()

    def select(self, workers: list[WorkerInfo], prompt_ids: list[int]) -> WorkerInfo:
        ordered = sorted(workers, key=lambda w: w.address)
        return ordered[next(self._counter) % len(ordered)]

    def forget(self, address: str) -> None:
        pass


class PowerOfTwo:
    """The less loaded of two workers drawn at random."""

    def __init__(self, seed: int | None = None) -> None:
        self._rng = random.Random(seed)

    def select(self, workers: list[WorkerInfo], prompt_ids: list[int]) -> WorkerInfo:
        if len(workers) == 1:
            return workers[0]
        a, b = self._rng.sample(workers, 2)
        return a if a.load <= b.load else b

    def forget(self, address: str) -> None:
        pass


class CacheAware:
    def __init__(self, balance_threshold: int = 4, min_match_ratio: float = 0.3, block: int = 16) -> None:
        self.tree = ApproxPrefixTree(block=block)
        self.balance_threshold = balance_threshold
        self.min_match_ratio = min_match_ratio

    def select(self, workers: list[WorkerInfo], prompt_ids: list[int]) -> WorkerInfo:
        least = min(workers, key=lambda w: (w.load, w.address))
        by_address = {w.address: w for w in workers}
        matches = {a: n for a, n in self.tree.match(prompt_ids).items() if a in by_address}
        choice = least
        if matches:
            address, matched = max(matches.items(), key=lambda kv: (kv[1], -by_address[kv[0]].load))
            best = by_address[address]
            if matched >= self.min_match_ratio * len(prompt_ids) and best.load - least.load <= self.balance_threshold:
                choice = best
        self.tree.insert(prompt_ids, choice.address)
        return choice

    def forget(self, address: str) -> None:
        self.tree.remove_worker(address)


def make_policy(name: str) -> Policy:
    from pdspark.errors import check_choice

    check_choice("policy", name, POLICIES)
    return {"round_robin": RoundRobin, "power_of_two": PowerOfTwo, "cache_aware": CacheAware}[name]()
