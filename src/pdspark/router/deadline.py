"""`Deadline`: when a request must be over, on this process's monotonic clock.

One deadline covers the whole request: its wait in the admission queue, every attempt on a pair and the whole
token stream; a retry gets what is left, never a fresh timeout. It never crosses a process boundary as a time:
each call to a worker carries `remaining()`, a relative gRPC timeout, so clock skew between hosts cannot matter.
"""

from __future__ import annotations

import time
from dataclasses import dataclass


@dataclass(frozen=True)
class Deadline:
    timeout_s: float  # what the request was given, for messages
    expires_at: float  # time.monotonic() seconds

    @classmethod
    def after(cls, timeout_s: float) -> Deadline:
        return cls(timeout_s, time.monotonic() + timeout_s)

    def remaining(self) -> float:
        """Seconds left (0 once it passed): the timeout for the next call."""
        return max(0.0, self.expires_at - time.monotonic())

    @property
    def expired(self) -> bool:
        return time.monotonic() >= self.expires_at
