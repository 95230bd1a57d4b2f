"""`_Stream.guard` (the decode worker's wait on a reservation, a transfer, an adopt): a caller that goes away takes
the awaited work with it, and a result that work still produces is undone, never left holding pages."""

from __future__ import annotations

import asyncio

import pytest

from pdspark.errors import ErrorCode, RequestFailed
from pdspark.serving.decode_worker import _Stream


async def _stubborn(started: asyncio.Event) -> str:
    """Produces its result although cancelled, as Python 3.11's `asyncio.wait_for` does when the awaited future
    completes just as the cancel comes (the decode worker's reservation arriving as its caller goes away)."""
    started.set()
    try:
        await asyncio.sleep(30)
    except asyncio.CancelledError:
        return "reservation"
    raise AssertionError("not cancelled")


async def _settled(task: asyncio.Future) -> None:
    with pytest.raises((asyncio.CancelledError, RequestFailed)):
        await task
    for _ in range(3):  # the awaited task's own end, and its done callbacks
        await asyncio.sleep(0)


def test_a_result_produced_after_the_caller_left_is_undone():
    async def scenario() -> list[str]:
        stream, undone, started = _Stream(), [], asyncio.Event()
        guarded = asyncio.ensure_future(stream.guard(_stubborn(started), undo=undone.append))
        await started.wait()
        guarded.cancel()
        await _settled(guarded)
        return undone

    assert asyncio.run(scenario()) == ["reservation"]


def test_a_result_produced_after_an_abort_is_undone():
    async def scenario() -> tuple[list[str], RequestFailed]:
        stream, undone, started = _Stream(), [], asyncio.Event()
        guarded = asyncio.ensure_future(stream.guard(_stubborn(started), undo=undone.append))
        await started.wait()
        stream.aborted.set_result(None)
        await _settled(guarded)
        return undone, guarded.exception()

    undone, failure = asyncio.run(scenario())
    assert undone == ["reservation"] and failure.code is ErrorCode.ABORTED


def test_a_result_that_is_used_is_not_undone():
    async def scenario() -> tuple[str, list[str]]:
        stream, undone = _Stream(), []
        result = await stream.guard(asyncio.sleep(0, "reservation"), undo=undone.append)
        await asyncio.sleep(0)
        return result, undone

    assert asyncio.run(scenario()) == ("reservation", [])
