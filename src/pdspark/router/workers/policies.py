"""Routing policies, chosen separately for prefill and decode: `round_robin`, `power_of_two`, `cache_aware`.

A policy picks one healthy worker for a prompt; `cache_aware` (prefill only) prefers the worker whose cache most
likely holds the longest prefix of the prompt, unless that worker is busier than the least loaded one by more
than `balance_threshold` requests.
"""

from __future__ import annotations

import hashlib
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
    def __init__(self, balance_threshold: int = 4, min_match_ratio: float = 0.3, block: int = 16,
                 hash_on_miss: bool = False) -> None:
        """`hash_on_miss`: a prompt whose prefix the tree does not hold goes to the worker its first block hashes
        to (rendezvous hashing over the workers within `balance_threshold` of the least loaded) instead of the least
        loaded: the processes of a router group, each with its own tree, then send a new prefix to the same worker
        (`router_group`)."""
        self.tree = ApproxPrefixTree(block=block)
        self.balance_threshold = balance_threshold
        self.min_match_ratio = min_match_ratio
        self.block = block
        self.hash_on_miss = hash_on_miss

    def select(self, workers: list[WorkerInfo], prompt_ids: list[int]) -> WorkerInfo:
        least = min(workers, key=lambda w: (w.load, w.address))
        by_address = {w.address: w for w in workers}
        matches = {a: n for a, n in self.tree.match(prompt_ids).items() if a in by_address}
        choice = self._by_hash(workers, prompt_ids, least) if self.hash_on_miss else least
        if matches:
            address, matched = max(matches.items(), key=lambda kv: (kv[1], -by_address[kv[0]].load))
            best = by_address[address]
            if matched >= self.min_match_ratio * len(prompt_ids) and best.load - least.load <= self.balance_threshold:
                choice = best
        self.tree.insert(prompt_ids, choice.address)
        return choice

    def forget(self, address: str) -> None:
        self.tree.remove_worker(address)

    def _by_hash(self, workers: list[WorkerInfo], prompt_ids: list[int], least: WorkerInfo) -> WorkerInfo:
        first = ",".join(map(str, prompt_ids[:self.block])).encode()
        near = [w for w in workers if w.load - least.load <= self.balance_threshold]
        return max(near, key=lambda w: hashlib.blake2b(first + b"@" + w.address.encode(), digest_size=8).digest())


def make_policy(name: str, group: bool = False) -> Policy:
    """`group`: for a process of a router group (see `CacheAware.hash_on_miss`)."""
    from pdspark.errors import check_choice

    check_choice("policy", name, POLICIES)
    if name == "cache_aware":
        return CacheAware(hash_on_miss=group)
    return {"round_robin": RoundRobin, "power_of_two": PowerOfTwo}[name]()
