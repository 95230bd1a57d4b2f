"""`SharedKeyQuota`: `KeyQuota` for a router of several processes (`--processes`): one count per API key over all.

A per-key limit is small (a client's share of the router), so dividing it between processes would refuse a key
whose requests happen to land on one of them. The counts live instead in one table of shared memory, and every
`enter`/`leave` holds the table's lock: the limit holds exactly across processes.

Robust to a process killed at any instant (SIGKILL, OOM): the lock is an `flock` on a file, which the kernel
releases with its holder's death (a semaphore would stay taken, and every process would wait on it forever); and
each key's count is kept per process, one column each, so the supervisor zeroes a dead process's column
(`forget_process`) before it starts another: the requests it held stop counting against their keys.

The table: `SLOTS` rows (tag, a count per process), found by linear probing from the tag, a 64-bit digest of the key
id (Python's `hash` of a str differs between processes). Tags are never unset one by one (that would break probe
chains); a key whose requests are all over keeps its slot at count 0, and a full table is rebuilt from its nonzero
rows.
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import os
from collections.abc import Iterator
from contextlib import contextmanager
from multiprocessing.context import BaseContext
from typing import Any

from pdspark.errors import ErrorCode, RequestFailed

SLOTS = 4096  # distinct keys at once (a rebuild drops the idle ones)


def _tag(key_id: str) -> int:
    """A nonzero 64-bit digest of `key_id` (0 marks an empty slot)."""
    return int.from_bytes(hashlib.blake2b(key_id.encode(), digest_size=8).digest(), "little", signed=True) or 1


class SharedKeyQuota:
    """Picklable to a spawned process (its array travels as `multiprocessing` passes it to a child); each process
    counts in its own column (`for_process`)."""

    def __init__(self, limit: int, table: Any, lock_path: str, processes: int, index: int = 0):
        """`table`: from `create` (a shared array of SLOTS * (1 + processes) int64: tag, then a count per process)."""
        assert limit >= 1 and 0 <= index < processes, (limit, index, processes)
        self.limit = limit
        self.processes = processes
        self.index = index
        self.lock_path = lock_path
        self._table = table
        self._fd: int | None = None  # this process's open file of the lock (an flock belongs to an open file)
        self._tags: dict[str, int] = {}  # this process's digests, computed once per key id

    @classmethod
    def create(cls, limit: int, processes: int, lock_path: str, ctx: BaseContext) -> SharedKeyQuota:
        open(lock_path, "a").close()
        return cls(limit, ctx.Array(ctypes.c_int64, SLOTS * (1 + processes), lock=False), lock_path, processes)

    def for_process(self, index: int) -> SharedKeyQuota:
        """The same table, counting in process `index`'s column."""
        return SharedKeyQuota(self.limit, self._table, self.lock_path, self.processes, index)

    def __getstate__(self) -> dict:
        return {"limit": self.limit, "table": self._table, "lock_path": self.lock_path, "processes": self.processes,
                "index": self.index}

    def __setstate__(self, state: dict) -> None:
        self.__init__(**state)  # type: ignore[misc]

    @contextmanager
    def _locked(self) -> Iterator[Any]:
        if self._fd is None:
            self._fd = os.open(self.lock_path, os.O_RDWR)
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        try:
            yield self._table
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)

    def held(self, key_id: str) -> int:
        with self._locked() as t:
            slot = self._find(t, self._tag_of(key_id), insert=False)
            return 0 if slot is None else self._total(t, slot)

    def enter(self, key_id: str) -> None:
        """Count one more request of `key_id` ("": no key, not counted).

        Raises:
            RequestFailed: `OVERLOADED` when the key already has `limit` requests in the router's processes.
        """
        if not key_id:
            return
        tag = self._tag_of(key_id)
        with self._locked() as t:
            slot = self._find(t, tag, insert=True)
            if slot is None:
                self._rebuild(t)
                slot = self._find(t, tag, insert=True)
            if slot is None:
                raise RequestFailed(ErrorCode.OVERLOADED, f"{SLOTS} API keys have requests in the router at once, "
                                    "the most it counts; retry when one has finished")
            held = self._total(t, slot)
            if held >= self.limit:
                raise RequestFailed(ErrorCode.OVERLOADED, f"this API key has {held} requests in the router, its "
                                    f"limit (max_in_flight_per_key {self.limit}); retry when one has finished")
            t[self._at(slot, self.index)] += 1

    def leave(self, key_id: str) -> None:
        """One request of `key_id` is over (call once per successful `enter`)."""
        if not key_id:
            return
        with self._locked() as t:
            slot = self._find(t, self._tag_of(key_id), insert=False)
            assert slot is not None and t[self._at(slot, self.index)] > 0, key_id
            t[self._at(slot, self.index)] -= 1

    def forget_process(self, index: int) -> None:
        """Process `index` is gone: its requests no longer count (the supervisor, before it starts another)."""
        with self._locked() as t:
            for slot in range(SLOTS):
                t[self._at(slot, index)] = 0

    def _tag_of(self, key_id: str) -> int:
        tag = self._tags.get(key_id)
        if tag is None:
            tag = self._tags[key_id] = _tag(key_id)
        return tag

    def _at(self, slot: int, index: int) -> int:
        """The table position of process `index`'s count in `slot`."""
        return slot * (1 + self.processes) + 1 + index

    def _total(self, t: Any, slot: int) -> int:
        base = slot * (1 + self.processes) + 1
        return sum(t[base:base + self.processes])

    def _find(self, t: Any, tag: int, insert: bool) -> int | None:
        """The slot of `tag` (claimed when `insert` and it has none, None when the table is full); None when it
        has none and not `insert`."""
        width = 1 + self.processes
        start = tag % SLOTS
        for i in range(SLOTS):
            slot = (start + i) % SLOTS
            seen = t[slot * width]
            if seen == tag:
                return slot
            if seen == 0:
                if not insert:
                    return None
                t[slot * width] = tag
                return slot
        return None

    def _rebuild(self, t: Any) -> None:
        """The table again from its rows with a nonzero count (the idle keys' slots freed)."""
        width = 1 + self.processes
        live = [list(t[s * width:(s + 1) * width]) for s in range(SLOTS) if self._total(t, s) > 0]
        ctypes.memset(ctypes.addressof(t), 0, ctypes.sizeof(t))
        for row in live:
            slot = self._find(t, row[0], insert=True)
            assert slot is not None
            t[slot * width:(slot + 1) * width] = row
