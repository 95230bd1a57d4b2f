"""`ServiceChannel` / `serve_side_calls`: rank 0's side calls to a service another rank runs beside its engine. The
rank is played by a thread here (the channel only needs a pipe and something that becomes ready when the rank
exits); the decode-group cluster test runs it across real rank processes."""

from __future__ import annotations

import multiprocessing as mp
import threading
import time

import pytest

from pdspark.engine.rank_service import ServiceChannel, serve_side_calls
from pdspark.errors import WorkerGroupError
from pdspark.testing.time_scale import scaled


class Doubler:
    def __init__(self, fail_start: bool = False):
        self.fail_start = fail_start
        self.release = threading.Event()

    def start(self, engine) -> str:
        if self.fail_start:
            raise OSError("no transfer engine here")
        return f"session-of-{engine}"

    def call(self, name: str, *args):
        if name == "double":
            return 2 * args[0]
        if name == "hang":
            self.release.wait()
            return None
        raise ValueError(f"unknown call {name!r}")


class Rank:
    """A thread playing rank 1: its channel, and the end whose closing is its exit (kept open until then)."""

    def __init__(self, service: Doubler):
        ours, theirs = mp.Pipe()
        sentinel, self.alive = mp.Pipe(duplex=False)  # (the sentinel is readable once `alive` is closed)
        threading.Thread(target=_run, args=(service, theirs, self.alive), daemon=True).start()
        self.channel = ServiceChannel(1, ours, sentinel)


def _run(service, conn, exited) -> None:
    try:
        serve_side_calls(service, "rank1", conn)
    except OSError:
        exited.close()


def test_a_side_call_answers_and_a_failing_call_leaves_the_channel_usable():
    rank = Rank(Doubler())
    channel = rank.channel
    assert channel.receive_info(scaled(10)) == "session-of-rank1" == channel.info
    assert channel.call("double", 21, timeout_s=scaled(10)) == 42
    with pytest.raises(RuntimeError, match="rank 1: `nope` failed: ValueError: unknown call 'nope'"):
        channel.call("nope", timeout_s=scaled(10))
    assert channel.call("double", 4, timeout_s=scaled(10)) == 8
    rank.alive.close()


def test_a_rank_whose_service_fails_to_start_fails_the_group_start_naming_it():
    channel = Rank(Doubler(fail_start=True)).channel
    with pytest.raises(WorkerGroupError, match="rank 1 failed to start its service: OSError: no transfer engine"):
        channel.receive_info(scaled(10))


def test_a_rank_that_does_not_answer_is_an_error_at_the_deadline_and_the_channel_stays_broken():
    service = Doubler()
    rank = Rank(service)
    channel = rank.channel
    channel.receive_info(scaled(10))
    bound_s = 0.3  # the call's deadline (the behaviour under test)
    start = time.monotonic()
    with pytest.raises(WorkerGroupError, match="rank 1 did not hang within"):
        channel.call("hang", timeout_s=bound_s)
    assert bound_s <= time.monotonic() - start < bound_s + scaled(5)
    service.release.set()  # its late answer must not be taken for the next call's
    with pytest.raises(WorkerGroupError, match="service channel is broken"):
        channel.call("double", 1, timeout_s=scaled(10))
    rank.alive.close()


def test_a_rank_that_exits_ends_the_wait_at_once():
    service = Doubler()
    rank = Rank(service)
    rank.channel.receive_info(scaled(10))
    rank.alive.close()  # the rank's process is gone (its sentinel is ready)
    with pytest.raises(WorkerGroupError, match="rank 1 exited"):
        rank.channel.call("hang", timeout_s=scaled(60))
    service.release.set()
