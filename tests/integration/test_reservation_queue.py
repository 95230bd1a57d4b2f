"""Destination pages for transferred prompts: requests wait in line (no polling) and get pages when some are
released; nothing is ever handed to a caller who has gone; request ids are unique while in flight."""

from __future__ import annotations

import asyncio
import gc
import time

import pytest

from conftest import MIXED
from helpers import GREEDY
from pdspark import SamplingParams
from pdspark.engine.factory import create_engine
from pdspark.errors import ErrorCode, InvalidRequestError, RequestFailed
from pdspark.serving.decode_worker import _Stream
from pdspark.serving.engine_loop import EngineLoop
from pdspark.serving.reservation_queue import ReservationQueue, ReservationTicket
from pdspark.testing.time_scale import scaled

# One request slot: a second reservation must wait for the first to be let go.
OPTS = dict(page_size=16, max_model_len=128, max_num_seqs=1, enable_prefix_cache=False)
PARAMS = SamplingParams(max_tokens=4, **GREEDY)


@pytest.fixture
def engine(checkpoints):
    path, _ = checkpoints(MIXED)
    return create_engine(str(path), **OPTS)


@pytest.fixture
def loop(engine):
    loop = EngineLoop(engine)
    loop.start()
    yield loop
    loop.stop()


def used(engine) -> dict[str, int]:
    return {name: n for name, (n, _) in engine.kv.usage().items() if n}


def test_a_waiting_ticket_is_granted_when_pages_are_released_and_a_withdrawn_one_never(engine, loop):
    queue = ReservationQueue(engine)
    loop.add_ticker(queue.grant)
    deadline = time.monotonic() + scaled(30)
    first, second, third = (ReservationTicket([5 + i] * 40, PARAMS, deadline) for i in range(3))
    for ticket in (first, second, third):
        loop.call(queue.offer, ticket)
    reservation = first.future.result(scaled(5))
    assert not second.future.done() and len(queue) == 2  # the one slot is taken: both wait
    loop.call(queue.withdraw, third)  # its caller gave up while waiting
    loop.call(queue.cancel, reservation)  # pages released: the loop hands them to the next in line
    granted = second.future.result(scaled(5))
    assert not third.future.done() and len(queue) == 0
    loop.call(queue.cancel, granted)
    loop.call(queue.cancel, granted)  # a second clean-up of the same reservation frees nothing twice
    assert loop.call(used, engine) == {}
    loop.call(engine.check_integrity)


def test_a_reservation_granted_to_a_caller_who_left_is_freed(engine, loop):
    queue = ReservationQueue(engine)
    ticket = ReservationTicket([5] * 40, PARAMS, time.monotonic() + scaled(30))
    loop.call(queue.offer, ticket)
    assert ticket.future.result(scaled(5)).pages.slot == 0 and loop.call(used, engine)
    loop.call(queue.withdraw, ticket)  # the caller went away as its pages came: they go back, not to waste
    assert loop.call(used, engine) == {}


def test_a_ticket_past_its_deadline_fails_in_line(engine, loop):
    queue = ReservationQueue(engine)
    loop.add_ticker(queue.grant)
    holder = ReservationTicket([5] * 40, PARAMS, time.monotonic() + scaled(30))
    own_deadline_s = 0.2  # the behaviour under test: the ticket fails in line when it passes (not a bound)
    late = ReservationTicket([6] * 40, PARAMS, time.monotonic() + own_deadline_s)
    loop.call(queue.offer, holder)
    loop.call(queue.offer, late)
    with pytest.raises(RequestFailed) as e:
        late.future.result(scaled(5))
    # The decode worker's own shortage, not the transfer's: the router avoids this worker on the retry.
    assert e.value.code is ErrorCode.OVERLOADED and "no room" in e.value.message
    loop.call(queue.cancel, holder.future.result(scaled(5)))
    assert loop.call(used, engine) == {}


@pytest.mark.parametrize("leaves", ["withdrawn", "expired"])
def test_a_ticket_behind_a_blocked_head_that_left_is_granted_without_pages_released(checkpoints, leaves):
    """The queue skips retrying while the pools' page counts are those at which its head last did not fit. Once
    that head left (its caller gave up, or its deadline passed), the next one, which may need fewer pages, is tried
    at once: no page needs to be released first."""
    path, _ = checkpoints(MIXED)
    engine = create_engine(str(path), **{**OPTS, "max_num_seqs": 3, "num_full_pages": 8})
    loop = EngineLoop(engine)
    loop.start()
    try:
        queue = ReservationQueue(engine)
        loop.add_ticker(queue.grant)
        deadline = time.monotonic() + scaled(30)
        own_deadline_s = 0.3  # the behaviour under test: the blocked head's own deadline (not a bound)
        holder = ReservationTicket([5] * 80, PARAMS, deadline)  # 5 of the 8 full pages
        big = ReservationTicket([6] * 112, PARAMS, time.monotonic() + own_deadline_s if leaves == "expired"
                                else deadline)  # 7 pages: waits for the holder
        small = ReservationTicket([7] * 32, PARAMS, deadline)  # 2 pages: would fit now, but waits in line
        for ticket in (holder, big, small):
            loop.call(queue.offer, ticket)
        holding = holder.future.result(scaled(5))
        assert not big.future.done() and not small.future.done() and len(queue) == 2
        if leaves == "withdrawn":
            loop.call(queue.withdraw, big)
        granted = small.future.result(scaled(5))  # the holder still holds its pages
        assert granted.pages.slot != holding.pages.slot
        if leaves == "expired":
            assert big.future.done() and isinstance(big.future.exception(), RequestFailed)
        for reservation in (holding, granted):
            loop.call(queue.cancel, reservation)
        assert loop.call(used, engine) == {}
    finally:
        loop.stop()


def test_a_ticket_for_a_prompt_that_never_fits_is_refused_at_once(engine, loop):
    queue = ReservationQueue(engine)
    with pytest.raises(InvalidRequestError, match="max_model_len"):  # it would wait for nothing
        loop.call(queue.offer, ReservationTicket([5] * 200, PARAMS, time.monotonic() + scaled(30)))
    assert len(queue) == 0


def test_a_result_that_arrives_as_its_caller_is_cancelled_is_taken_back():
    """`_Stream.guard`: the awaited reservation is granted in the same loop iteration as the caller goes away;
    nobody will use it, so it is undone rather than leaked."""

    async def scenario() -> list:
        undone: list = []
        stream = _Stream()
        granted = asyncio.get_running_loop().create_future()
        caller = asyncio.ensure_future(stream.guard(granted, undo=undone.append))
        await asyncio.sleep(0)  # the caller is now waiting in `guard`
        granted.set_result("pages")
        caller.cancel()
        with pytest.raises(asyncio.CancelledError):
            await caller
        return undone

    assert asyncio.run(scenario()) == ["pages"]


def test_a_failure_that_arrives_as_its_caller_is_cancelled_is_read_not_left_to_the_collector():
    """`_Stream.guard`: the awaited call (the plan sent to a prefill worker that just died) fails in the same loop
    iteration as the caller goes away (the router cancelled the stream: the prefill leg failed too). Its failure
    is of no use to anyone, but left unread asyncio logs it, with a traceback, as "never retrieved"."""

    async def scenario() -> list:
        unread: list = []
        asyncio.get_running_loop().set_exception_handler(lambda loop, context: unread.append(context["message"]))
        stream = _Stream()
        call = asyncio.get_running_loop().create_future()
        caller = asyncio.ensure_future(stream.guard(call))
        await asyncio.sleep(0)
        call.set_exception(RequestFailed(ErrorCode.UNAVAILABLE, "prefill worker gone"))
        caller.cancel()
        with pytest.raises(asyncio.CancelledError):
            await caller
        del call, caller
        gc.collect()
        return unread

    assert asyncio.run(scenario()) == []


def test_the_engine_refuses_a_request_id_in_flight(engine):
    engine.add_request([5] * 20, PARAMS, request_id="x")
    with pytest.raises(RequestFailed) as e:
        engine.add_request([6] * 20, PARAMS, request_id="x")
    assert e.value.code is ErrorCode.ALREADY_EXISTS and "'x'" in e.value.message
    while engine.has_unfinished:
        engine.step()
    with pytest.raises(RequestFailed) as e:  # finished but not yet released: still in flight
        engine.adopt("x", [6] * 20, PARAMS, pages=None, first_token=7)  # type: ignore[arg-type]
    assert e.value.code is ErrorCode.ALREADY_EXISTS
    engine.release("x")
    engine.add_request([6] * 20, PARAMS, request_id="x")  # once forgotten, the id is free again
