"""`ReservationQueue`: a decode worker's requests waiting for destination pages, granted in arrival order on the
engine-loop thread.

A request whose prompt cache arrives by transfer needs a request slot and pages for that cache before its plan can
go out. While the pools are full it waits here as a `ReservationTicket`, without polling from outside: between
steps the loop retries the head ticket, and only when the pools' page counts have changed since the head last did
not fit (a request finished, a reservation was cancelled: pages were released) or the head is another ticket (the
one that did not fit left the line: withdrawn, expired). The caller awaits the ticket's
future with its deadline; a caller that gives up withdraws the ticket (on the loop thread too, in order), so a
waiting ticket is dropped and one granted meanwhile has its pages freed: nothing is handed to a caller who is gone.
A granted reservation stays outstanding until it is adopted or cancelled, so a clean-up that races an adopt frees
nothing twice.

Every method runs on the loop thread.
"""

from __future__ import annotations

import collections
import contextlib
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pdspark.errors import ErrorCode, PdsparkError, RequestFailed, as_request_failed
from pdspark.transfer.transfer_plan import destination
from pdspark.types import SamplingParams

if TYPE_CHECKING:
    from pdspark.cache.kv_cache import ReqPages
    from pdspark.engine.engine import Engine


@dataclass(frozen=True)
class Reservation:
    """Destination pages held for a prompt computed elsewhere, and the plan fields that tell the prefill side
    where to write (`TransferPlan`'s prompt_len, full_pages, swa_pages, swa_first_page, c128_pages, req_slot)."""

    pages: ReqPages
    plan_fields: dict


@dataclass(eq=False)
class ReservationTicket:
    prompt_ids: list[int]
    params: SamplingParams
    deadline: float  # time.monotonic(): the queue fails the ticket after it
    future: Future = field(default_factory=Future)  # -> Reservation, or RequestFailed


class ReservationQueue:
    def __init__(self, engine: Engine):
        self.engine = engine
        self._waiting: collections.deque[ReservationTicket] = collections.deque()
        # (rank, request slot) -> granted pages, until adopted or cancelled (rank: of a DP-attention group; else 0)
        self._outstanding: dict[tuple[int, int], ReqPages] = {}
        self._blocked_at: dict | None = None  # the pools' page counts when the head last did not fit
        self._blocked_head: ReservationTicket | None = None  # that head

    def __len__(self) -> int:
        return len(self._waiting)

    def offer(self, ticket: ReservationTicket) -> None:
        """Queue `ticket` and grant what fits now. Raises `InvalidRequestError` / `CapacityError` for a prompt
        that could never be served (it would wait for nothing)."""
        self.engine.validate(ticket.prompt_ids, ticket.params)
        self._waiting.append(ticket)
        self.grant()

    def grant(self) -> None:
        """Ticker: fail expired tickets; hand out pages to waiting tickets, oldest first, while they fit."""
        self._expire()
        if not self._waiting:
            return
        if self._waiting[0] is self._blocked_head and self.engine.pool_usage() == self._blocked_at:
            return  # nothing released since this head last did not fit
        while self._waiting:
            ticket = self._waiting[0]
            if ticket.future.cancelled():  # its caller gave up; the withdraw command is on its way
                self._waiting.popleft()
                continue
            try:
                pages = self.engine.reserve_transfer(ticket.prompt_ids, ticket.params)
            except PdsparkError as e:  # validated at `offer`; kept for safety, the ticket fails alone
                self._waiting.popleft()
                if ticket.future.set_running_or_notify_cancel():
                    ticket.future.set_exception(as_request_failed(e))
                continue
            if pages is None:
                self._blocked_at, self._blocked_head = self.engine.pool_usage(), ticket
                return
            self._waiting.popleft()
            if not ticket.future.set_running_or_notify_cancel():  # its caller (another thread) gave up just now
                self.engine.cancel_transfer(pages)
                continue
            self._outstanding[pages.place] = pages
            ticket.future.set_result(Reservation(pages, destination(self.engine.kv, pages, len(ticket.prompt_ids))))
        self._blocked_at = self._blocked_head = None

    def withdraw(self, ticket: ReservationTicket) -> None:
        """The ticket's caller gave up: drop the ticket, or free the reservation it was granted meanwhile."""
        with contextlib.suppress(ValueError):  # not waiting (any more)
            self._waiting.remove(ticket)
        fut = ticket.future
        if fut.done() and not fut.cancelled() and fut.exception() is None:
            self.cancel(fut.result())

    def cancel(self, reservation: Reservation) -> None:
        """Free a reservation whose transfer failed or whose caller is gone; a no-op once it was adopted or freed."""
        key = reservation.pages.place
        if self._outstanding.get(key) is reservation.pages:
            del self._outstanding[key]
            self.engine.cancel_transfer(reservation.pages)

    def adopted(self, reservation: Reservation) -> None:
        """The reservation's pages now belong to a running request (which frees them when it ends)."""
        if self._outstanding.get(reservation.pages.place) is reservation.pages:
            del self._outstanding[reservation.pages.place]

    def _expire(self) -> None:
        now = time.monotonic()
        if not any(t.deadline <= now for t in self._waiting):
            return
        late = [t for t in self._waiting if t.deadline <= now]
        self._waiting = collections.deque(t for t in self._waiting if t.deadline > now)
        for ticket in late:
            if ticket.future.set_running_or_notify_cancel():
                ticket.future.set_exception(no_room())


def no_room() -> RequestFailed:
    """The failure of a request that got no request slot and pages for its prompt's cache in time: the decode
    worker's own shortage, not the transfer's. OVERLOADED (busy, not broken): the router avoids this worker on the
    retry, and answers 429 + Retry-After once every decode worker is full, as for a refusal at admission."""
    return RequestFailed(ErrorCode.OVERLOADED, "no room (a request slot and pages) for the prompt's cache before "
                                               "the deadline: this decode worker is full")
