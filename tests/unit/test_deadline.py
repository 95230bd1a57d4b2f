"""Deadlines cross the wire as relative timeouts: each side turns one into a deadline on its own monotonic clock on
receipt (the earlier of the message's timeout and the call's own), and passes on what is left."""

from __future__ import annotations

import time

import pytest

from pdspark.deadline import DEFAULT_TIMEOUT_S, Deadline
from pdspark.rpc import convert
from pdspark.v1 import worker_pb2


def remaining_after_receipt(timeout_s: float, call_remaining_s: float | None) -> float:
    t0 = time.monotonic()
    deadline = Deadline.on_receipt(timeout_s, call_remaining_s)
    return deadline.at - t0


@pytest.mark.parametrize("timeout_s, call_s, expected", [
    (2.0, None, 2.0),  # the message's timeout
    (0.0, 3.0, 3.0),  # none given: the call's deadline
    (2.0, 0.5, 0.5),  # the earlier of the two
    (0.5, 2.0, 0.5),
    (0.0, None, DEFAULT_TIMEOUT_S),  # neither: still bounded
    (2.0, -1.0, 0.0),  # the call's deadline already passed: expired on arrival, never negative
])
def test_a_relative_timeout_becomes_a_local_deadline_on_receipt(timeout_s, call_s, expected):
    assert remaining_after_receipt(timeout_s, call_s) == pytest.approx(expected, abs=0.05)


def test_a_deadline_counts_down_and_expires():
    deadline = Deadline.after(0.2)
    assert not deadline.expired and 0.1 < deadline.remaining() <= 0.2
    assert Deadline.after(0).expired and Deadline.after(-5).remaining() == 0.0
    assert deadline.earlier(Deadline.after(5)) is deadline


@pytest.mark.parametrize("seconds, ms", [(2.5, 2500), (0.0004, 1), (-3.0, 1), (1e9, 2**32 - 1)])
def test_timeouts_travel_as_whole_milliseconds(seconds, ms):
    # Never 0 (that means "none given") and never more than a uint32 holds.
    assert convert.timeout_to_ms(seconds) == ms
    assert convert.timeout_from_ms(ms) == pytest.approx(ms / 1000)


def test_no_wall_clock_deadline_is_left_on_the_wire():
    for message in (worker_pb2.PrefillRequest, worker_pb2.GenerateRequest, worker_pb2.TransferPlan):
        fields = message.DESCRIPTOR.fields_by_name
        assert "timeout_ms" in fields and "deadline_unix_s" not in fields
    with pytest.raises(ValueError):
        worker_pb2.GenerateRequest(deadline_unix_s=1.0)  # reserved: an old sender's field is no longer read
