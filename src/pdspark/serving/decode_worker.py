"""`DecodeWorker`: receives prompt caches from prefill workers and continues generation (DSpark when enabled).

One request: reserve destination pages (SWA only for the window tail), waiting in line while the pools are full
-> send the plan to the prefill worker, which answers once every payload is in our memory -> check the integrity
value -> join the running batch and stream tokens. A failed or late transfer frees the reservation; nothing waits
without a deadline.

A plan that is out (its `SubmitPlan` call runs) lets the prefill worker write into the reserved pages; how they
are freed depends on what we know of its writes:
- It answered: the cache arrived, or it reported a failure (which it does only once its writes stopped). Freed at
  once.
- It never got the plan (`NotSent`: no connection to it when the plan was due, so the call was never made; see
  `PrefillClients.submit_plan`): nothing can be written. Freed at once. (Most often a prefill worker that died:
  the plans it held are quarantined as below, and those sent to its address afterwards must not be, or every slot
  of this worker ends up quarantined behind one dead peer.)
- We give up first (an abort, or our caller went away, e.g. the router's lease lapsed): the request ends at once,
  but the call is not cancelled: we ask the prefill worker to fail the transfer (`abort_plan`) and free the pages
  as its answer says. (Without `abort_plan`, the call is cancelled, and nothing is known: as below.)
- The call ended unanswered (`Unanswered`: the prefill worker's lease lapsed, i.e. it stopped or vanished, see
  `rpc/keepalive.py`; or the deadline passed): it may still write. It starts no batch of writes after the plan's
  deadline (`plan.timeout_s` from its receipt, on a monotonic clock that runs on while a process is stopped), and a
  batch that started lands within the transfer backend's timeout. So the pages are quarantined until
  `sent + plan.timeout_s + backend.write_grace_s(...)` (the grace also covers the plan's way there), and at least
  that grace after we learn of the failure (if we were the stopped one, writes held up by us land as we resume,
  which is when we learn of it); counted in `quarantined_pages` (`pdspark_pool_quarantined_pages`), freed then.
What this rule does not cover: a prefill process frozen in the middle of a batch for longer than the grace, then
resumed, or a network path that drops packets for that long and heals (the transfer engine completes the batch
late, and a first contact's handshake waits for the peer without a timeout); and a plan that waited unread in a
stopped peer's socket until our lease on it lapsed (on resuming, the peer reads the plan and the closed connection
together, so its call is cancelled before a write can start, but nothing enforces that order). Both need a fence
in the transfer engine.

Admission: the worker holds as many requests as its engine runs (request slots) plus at most `max_waiting`
waiting for a slot and pages; one more is refused at once with OVERLOADED. A quarantined slot serves nobody until
its quarantine ends (its plan's deadline + the transfer engine's timeout: most often later than the deadline of a
request that would wait for it now), so the line shrinks with the slots that are not quarantined: `max_waiting`
times their share, and none at all while every slot is quarantined.
A request that waited its deadline out without room (all but a margin of it: see `_reserve`) fails with OVERLOADED
too: this worker's shortage, which the router avoids on the retry, not the transfer's. The load report counts the
queue and the quarantined slots and pages (`GetLoad`), and the router counts them as load. Everything here runs on
the asyncio loop (no locks): a request is a coroutine that holds no thread while it waits (for pages, the plan's
answer, tokens).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import replace
from typing import TypeVar

from pdspark.cache.req_pages import ReqPages
from pdspark.deadline import Deadline
from pdspark.engine.output_text import stream_text
from pdspark.errors import ErrorCode, NotSent, RequestFailed, Unanswered, WorkerGroupError
from pdspark.serving.decode_metrics import CHECKSUM, DecodeMetrics
from pdspark.serving.engine_client import EngineClient
from pdspark.serving.engine_loop import EngineLoop
from pdspark.serving.output_stream import OutputStream
from pdspark.serving.reservation_queue import Reservation
from pdspark.serving.transfer_destinations import TransferDestinations, local_destination
from pdspark.transfer.base import TransferBackend
from pdspark.transfer.compat import CompatDescriptor
from pdspark.transfer.plan import TransferPlan, TransferResult
from pdspark.transfer.transfer_plan import plan_nbytes
from pdspark.types import RequestOutput, SamplingParams

logger = logging.getLogger(__name__)
# submit_plan(prefill_address, plan, timeout_s) -> TransferResult (raises RequestFailed; Unanswered when the
# prefill worker did not answer; NotSent when the plan never left)
PlanSender = Callable[[str, TransferPlan, float], Awaitable[TransferResult]]
# abort_plan(prefill_address, request_id): ask the prefill worker to fail the transfer of `request_id`
PlanAborter = Callable[[str, str], Awaitable[object]]
T = TypeVar("T")
# Of the time left when the plan goes out, the share (at most `_ANSWER_MARGIN_MAX_S`) kept for the last write
# batch to land and the answer to come back: the prefill side starts no write after the rest has passed.
_ANSWER_MARGIN = 0.1
_ANSWER_MARGIN_MAX_S = 1.0
STALL_TIMEOUT_S = 120.0  # no new token for this long: the engine is stuck, end the stream


class _Stream:
    """One request on this worker: whether its engine request exists yet, and its abort signal."""

    def __init__(self) -> None:
        # The engine holds (or may hold) a request under our id: abort goes to the engine (the stream then ends with
        # an ABORT output), and the way out releases it.
        self.in_engine = False
        self.aborted = asyncio.get_running_loop().create_future()

    async def guard(self, aw: Awaitable[T], undo: Callable[[T], None] | None = None) -> T:
        """`await aw`, unless the request is aborted first: then `aw` is cancelled and ABORTED raised. `undo`
        takes back a result `aw` produced that will not be used (we were cancelled or aborted just as it came)."""
        task = asyncio.ensure_future(aw)
        try:
            done, _ = await asyncio.wait({task, self.aborted}, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:  # our caller went away: take `aw` with us
            _drop(task, undo)
            raise
        if task in done:
            return task.result()
        _drop(task, undo)
        raise RequestFailed(ErrorCode.ABORTED, "request aborted")


def _drop(task: asyncio.Future, undo: Callable | None) -> None:
    """Cancel `task` (it cleans up after itself: a withdrawn reservation, a cancelled call), or undo the result it
    already produced. A failure it already produced is read (and dropped): asyncio would log it as never
    retrieved.

    A cancelled task may still produce its result: Python 3.11's `asyncio.wait_for` returns the result of an
    awaitable that completed just as it was cancelled, swallowing the cancel (`EngineClient.reserve` awaits its
    reservation so). That late result is undone once the task ends: undone nowhere, it held a reservation's pages
    for good (the chaos test's prefill SIGKILL, with cancels arriving in batches over a `Calls` stream)."""
    if not task.done():
        task.cancel()
        task.add_done_callback(functools.partial(_undo, undo=undo))
    else:
        _undo(task, undo)


def _undo(task: asyncio.Future, undo: Callable | None) -> None:
    if not task.cancelled() and task.exception() is None and undo is not None:
        undo(task.result())


class DecodeWorker:
    def __init__(self, loop: EngineLoop, backend: TransferBackend, compat: CompatDescriptor, send_plan: PlanSender,
                 metrics: DecodeMetrics | None = None, max_waiting: int = 1024, executor: Executor | None = None,
                 abort_plan: PlanAborter | None = None, destinations: TransferDestinations | None = None):
        """`destinations`: per rank of a DP-attention group, where its transfers land (default: this process's
        `backend` and pools, one rank)."""
        self.engine = EngineClient(loop)
        self.backend = backend
        self.compat = compat
        self.send_plan = send_plan
        self.abort_plan = abort_plan
        self.metrics = metrics
        self.max_waiting = max_waiting
        # Fixed at start: the pools never move.
        self.destinations = (destinations if destinations is not None
                             else TransferDestinations(local_destination(backend, loop.engine)))
        self._executor = executor or ThreadPoolExecutor(2, thread_name_prefix="checksum")
        self._active: dict[str, _Stream] = {}
        self.waiting = 0  # requests waiting for destination pages
        self.transfers_in_flight = 0  # plans out: their SubmitPlan calls run
        self.stall_timeout_s = STALL_TIMEOUT_S
        # (rank, request slot) -> its pages per pool, until freed
        self._quarantined: dict[tuple[int, int], dict[str, int]] = {}
        usage = loop.engine.pool_usage()  # (a group's: every rank's pools)
        self.slots = usage["req_slots"].total  # request slots: fixed at start
        self.quarantined_pages = dict.fromkeys(usage, 0)  # per pool, as `KVCache.usage` names them
        self._count_quarantined({})  # every pool's gauge exists from the start
        self._tasks: set[asyncio.Task] = set()

    async def generate(self, request_id: str, transfer_id: str, prompt_ids: list[int], params: SamplingParams,
                       prefill_address: str, deadline: Deadline, prompt: str | None = None,
                       generated: list[int] | tuple[int, ...] = ()) -> AsyncIterator[RequestOutput]:
        """Yield cumulative outputs until the request finishes. Raises `RequestFailed` before the first one:
        OVERLOADED at once when the line for a slot and pages is full (`line_limit`), or when no room came by
        (nearly) `deadline`; ALREADY_EXISTS for an id in flight here; DEADLINE when the transfer did not come by
        `deadline`, or what the prefill side reported. Closing the generator (the caller went away) lets go of
        everything the request holds.

        `generated`: a migrated stream's tokens produced by an earlier decode worker; the transfer brings the cache
        of prompt + generated, and the outputs' `token_ids` start with them (`logprobs` only cover the new ones)."""
        if request_id in self._active:
            raise RequestFailed(ErrorCode.ALREADY_EXISTS, f"request id {request_id!r} is already in flight")
        if self.waiting >= self.line_limit():
            if self.metrics is not None:
                self.metrics.refused.inc()
            raise self._refusal()
        stream = self._active[request_id] = _Stream()
        # The cache to receive covers the context; the room to reserve is what is left to generate.
        context = [*prompt_ids, *generated]
        left = replace(params, max_tokens=max(1, params.max_tokens - len(generated)))
        try:
            reservation = await self._reserve(stream, context, left, deadline)
            result = await self._receive(stream, request_id, transfer_id, context, reservation, prefill_address,
                                         deadline)
            outputs = OutputStream(asyncio.get_running_loop())
            try:
                out = await stream.guard(self.engine.adopt(request_id, prompt_ids, params, reservation, result,
                                                           outputs.put, prompt, generated))
            except RequestFailed as e:
                self.engine.cancel_reservation(reservation)  # a no-op if the adopt ran after all
                # The adopt may have run (aborted as it did); ALREADY_EXISTS: the request under this id is not ours.
                stream.in_engine = e.code is not ErrorCode.ALREADY_EXISTS
                raise
            except BaseException:  # cancelled: the adopt may have run
                self.engine.cancel_reservation(reservation)
                stream.in_engine = True
                raise
            stream.in_engine = True
            if params.prompt_logprobs is not None:  # (computed by the prefill worker; sent once, first)
                out = replace(out, prompt_logprobs=[None, *result.prompt_logprobs])
            yield out
            while not out.finished:
                try:
                    out = await outputs.next(self.stall_timeout_s)
                except TimeoutError:
                    raise RequestFailed(ErrorCode.UNAVAILABLE, f"no token for {self.stall_timeout_s:.0f}s") from None
                yield out
        finally:
            # Normal end, failure, abort or the caller gone: let go of the engine's request (queued, in order
            # before anything a later request with this id queues).
            del self._active[request_id]
            if stream.in_engine:
                self.engine.release(request_id)

    @property
    def quarantined_slots(self) -> int:
        return self.quarantined_pages["req_slots"]

    def line_limit(self) -> int:
        """How many requests may wait for a slot and pages now: `max_waiting` times the share of the request slots
        that are not quarantined (at least 1 while one is not), 0 while all are."""
        return math.ceil(self.max_waiting * (self.slots - self.quarantined_slots) / self.slots)

    def _refusal(self) -> RequestFailed:
        quarantined = self.quarantined_slots
        if quarantined == self.slots:
            return RequestFailed(ErrorCode.OVERLOADED, f"all {self.slots} request slots of this decode worker are "
                                 "quarantined (transfers whose prefill worker did not answer, held until no write "
                                 "of theirs can land: their plans' deadline + the transfer engine's timeout)")
        share = f" with {quarantined} of its {self.slots} request slots quarantined" if quarantined else ""
        return RequestFailed(ErrorCode.OVERLOADED, f"{self.waiting} requests already wait for a slot and pages, the "
                             f"most this decode worker queues{share} (max_waiting_streams)")

    def stable_text_of(self, token_ids: list[int], stop_strings: Sequence[str] = ()) -> str:
        """The stable text a stream of `token_ids` (not finished) has sent: a trailing incomplete UTF-8 sequence and
        a tail that may start one of `stop_strings` held back (`output_text.stream_text`); "" without a
        tokenizer."""
        tokenizer = self.engine.tokenizer
        if tokenizer is None or not token_ids:
            return ""
        return stream_text(tokenizer.decode(token_ids), False, stop_strings)

    def abort(self, request_id: str) -> bool:
        """Stop a request now: before it runs, its `generate` raises ABORTED; once it runs, the engine aborts it
        and its stream ends with an ABORT output. False when it is not in flight here."""
        stream = self._active.get(request_id)
        if stream is None:
            return False
        if stream.in_engine:
            self.engine.abort(request_id)
        elif not stream.aborted.done():
            stream.aborted.set_result(None)
        return True

    async def _reserve(self, stream: _Stream, prompt_ids: list[int], params: SamplingParams,
                       deadline: Deadline) -> Reservation:
        # The wait for room ends the plan's answer margin before the deadline (OVERLOADED, `reservation_queue.no_room`):
        # the prefill worker fails the rendezvous at the deadline ("the plan did not arrive"), a failure the router
        # blames on the prefill worker, and whichever of the two reaches it first names the worker its retry avoids.
        # This worker's own shortage must win, or the retry comes back to this full worker.
        give_up_at = deadline.at - _answer_margin(deadline.remaining())
        self.waiting += 1
        try:
            return await stream.guard(self.engine.reserve(prompt_ids, params, give_up_at),
                                      undo=self.engine.cancel_reservation)
        finally:
            self.waiting -= 1

    async def _receive(self, stream: _Stream, request_id: str, transfer_id: str, prompt_ids: list[int],
                       reservation: Reservation, prefill_address: str, deadline: Deadline) -> TransferResult:
        remaining = deadline.remaining()
        rank = reservation.pages.rank  # (the rank of this worker's group whose pools the pages are in)
        dest = self.destinations[rank]
        plan = TransferPlan(
            transfer_id=transfer_id,
            request_id=request_id,
            session=dest.session,
            compat=self.compat,
            buffers=dest.buffers,
            destination_rank=rank,
            timeout_s=remaining - _answer_margin(remaining),
            **reservation.plan_fields,
        )
        sent_at = time.monotonic()
        call = asyncio.ensure_future(self.send_plan(prefill_address, plan, remaining))
        self.transfers_in_flight += 1
        call.add_done_callback(self._call_ended)
        try:
            # Shielded: giving up (an abort, our caller gone) must not cancel the call (see the module doc).
            result = await stream.guard(asyncio.shield(call))
        except BaseException:
            self._let_go(call, plan, reservation, prefill_address, sent_at)
            raise
        try:
            try:
                arrived = await asyncio.get_running_loop().run_in_executor(
                    self._executor, self.destinations.checksum, rank, plan)
            except WorkerGroupError as e:  # (the group is failing: its worker exits for a restart)
                raise RequestFailed(ErrorCode.UNAVAILABLE, f"transfer {transfer_id!r}: rank {rank} did not check "
                                    f"the cache that arrived: {e}") from e
            if arrived != result.checksum:
                if self.metrics is not None:
                    self.metrics.transfer_failures.labels(reason=CHECKSUM).inc()
                raise RequestFailed(ErrorCode.TRANSFER, f"transfer {transfer_id!r}: integrity check failed")
        except BaseException:
            self.engine.cancel_reservation(reservation)  # the prefill worker answered: nothing more lands
            raise
        return result  # its statistics are the prefill side's to count (it wrote the cache)

    # ---- a transfer's end -------------------------------------------------------------------------------------------
    def _call_ended(self, call: asyncio.Future) -> None:
        self.transfers_in_flight -= 1

    def _let_go(self, call: asyncio.Future, plan: TransferPlan, reservation: Reservation, prefill_address: str,
                sent_at: float) -> None:
        """The request ends without its transfer (failed, aborted, or its caller gone): free the reservation as
        the call's outcome allows, now or once the call ends."""
        if not call.done():
            if self.abort_plan is None:
                call.cancel()
            else:
                self._spawn(self.abort_plan(prefill_address, plan.request_id))
        call.add_done_callback(functools.partial(self._settle, plan=plan, reservation=reservation, sent_at=sent_at))

    def _settle(self, call: asyncio.Future, plan: TransferPlan, reservation: Reservation, sent_at: float) -> None:
        if _writes_over(call):
            self.engine.cancel_reservation(reservation)
            return
        # The prefill worker may still write: none of its batches starts after the plan's deadline, and one that
        # started lands within the backend's grace; or as soon as we answer again, if it is us who were stopped (a
        # write held up by us then lands on our resuming, which is also when we learn of this): the grace counts
        # from now at the earliest.
        until = max(sent_at + plan.timeout_s, time.monotonic()) + self.backend.write_grace_s(plan_nbytes(plan))
        counts = _page_counts(reservation.pages)
        self._quarantined[reservation.pages.place] = counts
        self._count_quarantined(counts, +1)
        logger.warning("transfer %s of request %s: no answer from the prefill worker (%s); its %d destination "
                       "pages (rank %d) stay quarantined for %.1fs", plan.transfer_id, plan.request_id,
                       _outcome(call), sum(counts.values()), reservation.pages.rank, until - time.monotonic())
        asyncio.get_running_loop().call_at(until, self._end_quarantine, reservation)

    def _end_quarantine(self, reservation: Reservation) -> None:
        self._count_quarantined(self._quarantined.pop(reservation.pages.place), -1)
        self.engine.cancel_reservation(reservation)

    def _count_quarantined(self, counts: dict[str, int], sign: int = 1) -> None:
        for pool, n in counts.items():
            self.quarantined_pages[pool] += sign * n
        if self.metrics is not None:
            for pool, n in self.quarantined_pages.items():
                self.metrics.quarantined_pages.labels(pool=pool).set(n)

    def _spawn(self, coro: Awaitable) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)  # a reference, so that the task is not collected while it runs
        task.add_done_callback(self._tasks.discard)
        task.add_done_callback(_log_failure)


def _answer_margin(remaining: float) -> float:
    """Of the time left when the plan goes out, what is kept for the last write to land and the answer to come
    back."""
    return min(_ANSWER_MARGIN_MAX_S, _ANSWER_MARGIN * remaining)


def _writes_over(call: asyncio.Future) -> bool:
    """Whether no write of the plan's can land any more: the prefill worker answered (a result, or a failure it
    reported, which it does only once its writes stopped), or the plan never left (`NotSent`, a `RequestFailed`
    that is no `Unanswered`: no call was made). Anything else (cancelled, `Unanswered`, an unexpected error) leaves
    its writes unknown."""
    if call.cancelled():
        return False
    e = call.exception()
    return e is None or isinstance(e, NotSent) or (isinstance(e, RequestFailed) and not isinstance(e, Unanswered))


def _outcome(call: asyncio.Future) -> str:
    return "cancelled" if call.cancelled() else str(call.exception())


def _page_counts(pages: ReqPages) -> dict[str, int]:
    """The pages a reservation holds, per pool (as `KVCache.usage` names them): it borrows none from the tree."""
    return {"full": len(pages.full_pages), "swa": sum(p is not None for p in pages.swa_pages),
            "c128": len(pages.c128_pages), "req_slots": 1}


def _log_failure(task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None:
        logger.info("asking the prefill worker to drop a transfer failed: %s", task.exception())
