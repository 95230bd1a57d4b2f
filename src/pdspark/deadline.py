"""`Deadline`: when something must be over, as a point on this process's monotonic clock.

No wall-clock time crosses hosts. A message carries a relative timeout (`timeout_ms`, or a gRPC call's own
deadline); the receiver turns it into a `Deadline` on receipt, and passes on only what is left (`remaining()`).
The router keeps one per request (its admission queue wait, every attempt on a pair and the whole stream: a retry
gets what is left, never a fresh timeout); workers keep one per transfer.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

# A request that names no timeout and comes on a call without a deadline still gets one (the router's default).
DEFAULT_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class Deadline:
    at: float  # time.monotonic() seconds
    timeout_s: float  # what it was given, for messages

    @classmethod
    def after(cls, seconds: float) -> Deadline:
        return cls(time.monotonic() + seconds, seconds)

    @classmethod
    def on_receipt(cls, timeout_s: float, call_remaining_s: float | None,
                   default_s: float = DEFAULT_TIMEOUT_S) -> Deadline:
        """The deadline of a request that just arrived with a relative `timeout_s` (0: none given) on a call with
        `call_remaining_s` left (None: the call has no deadline): the earlier of the two, else `default_s`."""
        given = [s for s in (timeout_s if timeout_s > 0 else None, call_remaining_s) if s is not None]
        return cls.after(max(0.0, min(given)) if given else default_s)

    def remaining(self) -> float:
        """Seconds left, never negative: the timeout for the next call."""
        return max(0.0, self.at - time.monotonic())

    @property
    def expired(self) -> bool:
        return time.monotonic() >= self.at

    def earlier(self, other: Deadline) -> Deadline:
        return self if self.at <= other.at else other
