"""`KeyQuota`: how many requests each API key has in the router (queued or at the workers), at most `limit` each.

One client, however eager, cannot take every admission slot and queue place from the others: its request beyond
the limit is refused at once with `OVERLOADED` (HTTP 429 + Retry-After, gRPC RESOURCE_EXHAUSTED), as a full router
refuses. Requests without a key (an open API) have nobody to count against and are not counted.

Single-threaded: every method runs on the router's event loop.
"""

from __future__ import annotations

from pdspark.errors import ErrorCode, RequestFailed


class KeyQuota:
    def __init__(self, limit: int):
        assert limit >= 1, limit
        self.limit = limit
        self._held: dict[str, int] = {}  # key id -> requests in the router

    def held(self, key_id: str) -> int:
        return self._held.get(key_id, 0)

    def enter(self, key_id: str) -> None:
        """Count one more request of `key_id` ("": no key, not counted).

        Raises:
            RequestFailed: `OVERLOADED` when the key already has `limit` requests in the router.
        """
        if not key_id:
            return
        held = self._held.get(key_id, 0)
        if held >= self.limit:
            raise RequestFailed(ErrorCode.OVERLOADED, f"this API key has {held} requests in the router, its limit "
                                f"(max_in_flight_per_key {self.limit}); retry when one has finished")
        self._held[key_id] = held + 1

    def leave(self, key_id: str) -> None:
        """One request of `key_id` is over (call once per successful `enter`)."""
        if not key_id:
            return
        held = self._held[key_id] - 1
        assert held >= 0, key_id
        if held:
            self._held[key_id] = held
        else:
            del self._held[key_id]  # keys come and go with rotation: no entry outlives its requests
