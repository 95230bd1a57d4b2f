"""`AdmissionQueue`: how many requests the router has at the workers at once, and how many may wait for a turn.

A request holds a slot for as long as it is at the workers; at most `max_in_flight` slots are held at once. When
none is free the request waits in a FIFO queue of at most `max_queued`, until a slot passes to it, its deadline
passes (`DEADLINE`) or its caller aborts it (`ABORTED`). Beyond the queue it is refused at once with `OVERLOADED`
(HTTP 429 + Retry-After, gRPC RESOURCE_EXHAUSTED): a full router says so immediately, and never lets a request
time out in a queue it had no chance of leaving.

Single-threaded: every method runs on the router's event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import time
from collections import deque

from pdspark.errors import ErrorCode, RequestFailed


class _State(enum.Enum):
    WAITING = "waiting"
    HOLDING = "holding"
    RELEASED = "released"


class AdmissionTicket:
    """One request's place: waiting in the queue, then holding a slot, then released (exactly once)."""

    def __init__(self, queue: AdmissionQueue, waiter: asyncio.Future | None):
        self._queue = queue
        self._waiter = waiter  # None: a slot was free on arrival
        self._state = _State.HOLDING if waiter is None else _State.WAITING
        self._since = time.monotonic()

    @property
    def holding(self) -> bool:
        return self._state is _State.HOLDING

    async def wait(self, timeout_s: float) -> float:
        """Wait for a slot; returns the seconds spent in the queue.

        Raises:
            RequestFailed: `DEADLINE` when no slot came within `timeout_s`; the failure `abort` was given.
        """
        if self._state is _State.WAITING:
            assert self._waiter is not None
            try:
                # NOTE: asyncio.wait, not wait_for: it never cancels the waiter, so a slot handed over just as the
                # timeout fires is seen (waiter done) instead of lost.
                await asyncio.wait((self._waiter,), timeout=timeout_s)
            except BaseException:
                self.release()  # the caller went away while queued: give up the place (or the slot just granted)
                raise
            if not self._waiter.done():
                self.release()
                raise RequestFailed(ErrorCode.DEADLINE, f"no turn at the workers within the request's timeout: "
                                    f"waited {timeout_s:.3g} s in the router's queue ({self._queue.in_flight} "
                                    f"requests in flight, {self._queue.queued} waiting)")
            failure = self._waiter.exception()
            if failure is not None:
                self._state = _State.RELEASED  # aborted: `abort` already left the queue
                raise failure
            self._state = _State.HOLDING
        if self._state is not _State.HOLDING:
            raise RequestFailed(ErrorCode.ABORTED, "the request left the admission queue")
        return time.monotonic() - self._since

    def abort(self, failure: RequestFailed) -> bool:
        """End the wait of a queued request with `failure`; False when it is not waiting (then it is the
        dispatcher's to stop)."""
        if self._state is not _State.WAITING or self._waiter is None or self._waiter.done():
            return False
        self._queue._leave(self._waiter)
        self._waiter.set_exception(failure)
        return True

    def release(self) -> None:
        """Give back the slot (to the first waiter) or the place in the queue. Idempotent."""
        state, self._state = self._state, _State.RELEASED
        if state is _State.HOLDING:
            self._queue._pass_slot()
        elif state is _State.WAITING and self._waiter is not None:
            w = self._waiter
            if w.done() and not w.cancelled() and w.exception() is None:
                self._queue._pass_slot()  # granted, but its holder left before it noticed
            else:
                self._queue._leave(w)
                w.cancel()


class AdmissionQueue:
    def __init__(self, max_in_flight: int, max_queued: int):
        assert max_in_flight >= 1 and max_queued >= 0, (max_in_flight, max_queued)
        self.max_in_flight = max_in_flight
        self.max_queued = max_queued
        self.in_flight = 0  # slots held
        self._waiting: deque[asyncio.Future] = deque()

    @property
    def queued(self) -> int:
        return len(self._waiting)

    def enter(self) -> AdmissionTicket:
        """A place for a new request: a slot when one is free and nobody waits (FIFO), else a place in the queue.

        Raises:
            RequestFailed: `OVERLOADED`, at once, when the queue is full.
        """
        if self.in_flight < self.max_in_flight and not self._waiting:
            self.in_flight += 1
            return AdmissionTicket(self, None)
        if len(self._waiting) >= self.max_queued:
            raise RequestFailed(ErrorCode.OVERLOADED, f"the router is at capacity: {self.in_flight} requests in "
                                f"flight (max_in_flight {self.max_in_flight}) and {len(self._waiting)} waiting "
                                f"(max_queued {self.max_queued}); retry later")
        waiter = asyncio.get_running_loop().create_future()
        self._waiting.append(waiter)
        return AdmissionTicket(self, waiter)

    def _pass_slot(self) -> None:
        while self._waiting:
            waiter = self._waiting.popleft()
            if not waiter.done():
                waiter.set_result(None)  # the slot changes hands: in_flight stays
                return
        self.in_flight -= 1
        assert self.in_flight >= 0

    def _leave(self, waiter: asyncio.Future) -> None:
        with contextlib.suppress(ValueError):  # already popped by `_pass_slot`
            self._waiting.remove(waiter)
