"""`AdmissionQueue`: bounded slots, a bounded FIFO queue, refusal at once beyond it, and a queued request leaves
on its deadline or its abort without losing or leaking a slot."""

from __future__ import annotations

import asyncio
import time

import pytest

from pdspark.errors import ErrorCode, RequestFailed
from pdspark.router.admission_queue import AdmissionQueue
from pdspark.testing.time_scale import scaled
from pdspark.testing.waiting import run_within


def test_slots_then_queue_then_refused_at_once():
    async def scenario():
        q = AdmissionQueue(max_in_flight=2, max_queued=1)
        held = [q.enter(), q.enter()]
        assert all(t.holding for t in held) and q.in_flight == 2
        waiting = q.enter()
        assert not waiting.holding and q.queued == 1
        with pytest.raises(RequestFailed) as e:
            q.enter()
        assert e.value.code is ErrorCode.OVERLOADED
        assert "max_in_flight 2" in e.value.message and "max_queued 1" in e.value.message
        held[0].release()
        assert await waiting.wait(scaled(1.0)) >= 0 and waiting.holding  # the slot passed to the waiter
        assert (q.in_flight, q.queued) == (2, 0)
        for t in (held[1], waiting):
            t.release()
            t.release()  # idempotent
        assert (q.in_flight, q.queued) == (0, 0)

    run_within(scenario(), 10)


def test_the_queue_is_first_in_first_out_and_newcomers_do_not_jump_it():
    async def scenario():
        q = AdmissionQueue(max_in_flight=1, max_queued=3)
        holder = q.enter()
        order: list[int] = []

        async def queued(i):
            ticket = q.enter()
            await ticket.wait(scaled(5))
            order.append(i)
            await asyncio.sleep(0)
            ticket.release()

        tasks = [asyncio.create_task(queued(i)) for i in range(3)]
        await asyncio.sleep(0)  # every task has entered the queue
        assert q.queued == 3
        holder.release()
        await asyncio.gather(*tasks)
        assert order == [0, 1, 2]
        assert (q.in_flight, q.queued) == (0, 0)

    run_within(scenario(), 10)


def test_a_queued_request_leaves_at_its_deadline_and_its_place_is_freed():
    async def scenario():
        q = AdmissionQueue(max_in_flight=1, max_queued=1)
        holder = q.enter()
        ticket = q.enter()
        own_deadline_s = 0.05  # the behaviour under test: the wait ends with DEADLINE when it passes (not a bound)
        t0 = time.perf_counter()
        with pytest.raises(RequestFailed) as e:
            await ticket.wait(own_deadline_s)
        waited = time.perf_counter() - t0
        assert e.value.code is ErrorCode.DEADLINE and 0.04 < waited < scaled(0.5)
        assert q.queued == 0
        q.enter().release()  # the queue has room again (it would raise OVERLOADED otherwise)
        holder.release()
        assert q.in_flight == 0

    run_within(scenario(), 10)


def test_abort_ends_a_queued_wait_and_a_cancelled_waiter_passes_its_slot_on():
    async def scenario():
        q = AdmissionQueue(max_in_flight=1, max_queued=2)
        holder = q.enter()
        aborted, cancelled = q.enter(), q.enter()
        assert aborted.abort(RequestFailed(ErrorCode.ABORTED, "by its caller"))
        with pytest.raises(RequestFailed) as e:
            await aborted.wait(scaled(1))
        assert e.value.code is ErrorCode.ABORTED and q.queued == 1
        waiter = asyncio.create_task(cancelled.wait(scaled(5)))
        await asyncio.sleep(0)
        holder.release()  # the slot goes to `cancelled`'s waiter ...
        waiter.cancel()  # ... whose caller goes away before it runs: the slot must not be lost
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert (q.in_flight, q.queued) == (0, 0)
        assert not holder.abort(RequestFailed(ErrorCode.ABORTED, "x"))  # not waiting: nothing to abort here

    run_within(scenario(), 10)


def test_a_zero_queue_refuses_as_soon_as_every_slot_is_held():
    async def scenario():
        q = AdmissionQueue(max_in_flight=1, max_queued=0)
        t = q.enter()
        with pytest.raises(RequestFailed) as e:
            q.enter()
        assert e.value.code is ErrorCode.OVERLOADED
        t.release()
        q.enter().release()

    run_within(scenario(), 10)
