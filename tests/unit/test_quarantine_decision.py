"""Whether a decode worker quarantines the pages of a transfer that failed (`decode_worker._writes_over`): only
when the plan may have reached the prefill worker and no answer says its writes stopped. A plan that never left
(`NotSent`: the prefill worker was unreachable when it was due) cannot be written, so its pages are freed at once,
like those of a failure the prefill worker reported; one that ended unanswered after it was sent, or was
cancelled, may still be written and is quarantined as before."""

from __future__ import annotations

import asyncio

import pytest

from pdspark.errors import ErrorCode, NotSent, RequestFailed, Unanswered
from pdspark.serving.decode_worker import _writes_over


def _ended(outcome: str) -> asyncio.Future:
    future = asyncio.get_running_loop().create_future()
    if outcome == "not_sent":
        future.set_exception(NotSent(ErrorCode.UNAVAILABLE, "prefill worker unreachable; the plan was not sent"))
    elif outcome == "unanswered":
        future.set_exception(Unanswered(ErrorCode.UNAVAILABLE, "the prefill worker's lease lapsed"))
    elif outcome == "unanswered_deadline":
        future.set_exception(Unanswered(ErrorCode.DEADLINE, "no answer before the deadline"))
    elif outcome == "reported":
        future.set_exception(RequestFailed(ErrorCode.TRANSFER, "the prefill worker's writes failed"))
    elif outcome == "unexpected":
        future.set_exception(RuntimeError("a bug on the way"))
    elif outcome == "cancelled":
        future.cancel()
    else:
        future.set_result("result")
    return future


@pytest.mark.parametrize("outcome, over", [
    ("not_sent", True), ("reported", True), ("answered", True),
    ("unanswered", False), ("unanswered_deadline", False), ("cancelled", False), ("unexpected", False)])
def test_only_a_plan_that_may_have_arrived_without_an_answer_is_quarantined(outcome, over):
    async def decide() -> bool:
        call = _ended(outcome)
        try:
            return _writes_over(call)
        finally:
            if not call.cancelled():
                call.exception()  # read: asyncio would log an unread failure

    assert asyncio.run(decide()) is over
