"""`SharedKeyQuota`: `KeyQuota` for a router of several processes (`--processes`): one count per API key over all.

A per-key limit is small (a client's share of the router), so dividing it between processes would refuse a key
whose requests happen to land on one of them. The counts live instead in one table of shared memory, and every
`enter`/`leave` takes the table's lock (a semaphore: ~1 us uncontended): the limit holds exactly across processes.

The table: `SLOTS` pairs (tag, count), found by linear probing from the tag, a 64-bit digest of the key id (Python's
`hash` of a str differs between processes). Tags are never unset one by one (that would break probe chains); a key
whose requests are all over keeps its slot at count 0, and a full table is rebuilt from its nonzero counts.
"""

from __future__ import annotations

import ctypes
import hashlib
from multiprocessing.context import BaseContext
from typing import Any

from pdspark.errors import ErrorCode, RequestFailed

SLOTS = 4096  # distinct keys at once (a rebuild drops the idle ones)


def _tag(key_id: str) -> int:
    """A nonzero 64-bit digest of `key_id` (0 marks an empty slot)."""
    return int.from_bytes(hashlib.blake2b(key_id.encode(), digest_size=8).digest(), "little", signed=True) or 1


class SharedKeyQuota:
    """Picklable to a spawned process (its array and lock travel as `multiprocessing` passes them to a child)."""

    def __init__(self, limit: int, table: Any):
        """`table`: from `create` (a synchronized shared array of 2 * SLOTS int64: tag, count)."""
        assert limit >= 1, limit
        self.limit = limit
        self._table = table
        self._tags: dict[str, int] = {}  # this process's digests, computed once per key id

    @classmethod
    def create(cls, limit: int, ctx: BaseContext) -> SharedKeyQuota:
        return cls(limit, ctx.Array(ctypes.c_int64, 2 * SLOTS, lock=ctx.Lock()))

    def __getstate__(self) -> dict:
        return {"limit": self.limit, "table": self._table}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["limit"], state["table"])  # type: ignore[misc]

    def held(self, key_id: str) -> int:
        with self._table.get_lock():
            slot = self._find(self._table.get_obj(), self._tag_of(key_id), insert=False)
            return 0 if slot is None else self._table.get_obj()[2 * slot + 1]

    def enter(self, key_id: str) -> None:
        """Count one more request of `key_id` ("": no key, not counted).

        Raises:
            RequestFailed: `OVERLOADED` when the key already has `limit` requests in the router's processes.
        """
        if not key_id:
            return
        tag = self._tag_of(key_id)
        with self._table.get_lock():
            t = self._table.get_obj()
            slot = self._find(t, tag, insert=True)
            if slot is None:
                self._rebuild(t)
                slot = self._find(t, tag, insert=True)
            if slot is None:
                raise RequestFailed(ErrorCode.OVERLOADED, f"{SLOTS} API keys have requests in the router at once, "
                                    "the most it counts; retry when one has finished")
            held = t[2 * slot + 1]
            if held >= self.limit:
                raise RequestFailed(ErrorCode.OVERLOADED, f"this API key has {held} requests in the router, its "
                                    f"limit (max_in_flight_per_key {self.limit}); retry when one has finished")
            t[2 * slot + 1] = held + 1

    def leave(self, key_id: str) -> None:
        """One request of `key_id` is over (call once per successful `enter`)."""
        if not key_id:
            return
        with self._table.get_lock():
            t = self._table.get_obj()
            slot = self._find(t, self._tag_of(key_id), insert=False)
            assert slot is not None and t[2 * slot + 1] > 0, key_id
            t[2 * slot + 1] -= 1

    def _tag_of(self, key_id: str) -> int:
        tag = self._tags.get(key_id)
        if tag is None:
            tag = self._tags[key_id] = _tag(key_id)
        return tag

    @staticmethod
    def _find(t: Any, tag: int, insert: bool) -> int | None:
        """The slot of `tag` (claimed when `insert` and it has none, None when the table is full); None when it
        has none and not `insert`."""
        start = tag % SLOTS
        for i in range(SLOTS):
            slot = (start + i) % SLOTS
            seen = t[2 * slot]
            if seen == tag:
                return slot
            if seen == 0:
                if not insert:
                    return None
                t[2 * slot] = tag
                return slot
        return None

    @staticmethod
    def _rebuild(t: Any) -> None:
        """The table again from its nonzero counts (the idle keys' slots freed)."""
        live = [(t[2 * s], t[2 * s + 1]) for s in range(SLOTS) if t[2 * s + 1] > 0]
        ctypes.memset(ctypes.addressof(t), 0, ctypes.sizeof(t))
        for tag, count in live:
            slot = SharedKeyQuota._find(t, tag, insert=True)
            assert slot is not None
            t[2 * slot + 1] = count
