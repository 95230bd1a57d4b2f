"""A whole role down: with one decode worker, its crash leaves no other worker to migrate a stream to. The request
waits (up to `max_role_outage_wait_s`, never past its deadline) for a worker of the role to answer health checks
again, then migrates there; the cluster-level rung (`pdspark up --decode 1`, SIGKILL) is in tests/cluster.
Stub workers behind the router's real dispatcher, health polling on."""

from __future__ import annotations

import asyncio
import time

import pytest

from pdspark.client import AsyncClient, ClientError
from pdspark.errors import ErrorCode, RequestFailed
from pdspark.testing.time_scale import scaled
from pdspark.testing.waiting import run_within, until
from pdspark.testing.worker_stubs import HOLD
from router_harness import RouterHarness

PROMPT = [5, 6, 7]


async def _stream_into(client: AsyncClient, received: list[int]) -> None:
    async for chunk in client.stream(token_ids=PROMPT, max_tokens=8):
        received.extend(chunk.token_ids)


def test_the_only_decode_worker_killed_mid_stream_the_stream_waits_for_its_restart_and_completes(worker_calls):
    async def scenario():
        async with await RouterHarness.start(worker_calls=worker_calls, decodes=1, tokens=8, poll=True) as h, \
                AsyncClient(h.grpc_address, timeout=scaled(60)) as client:
            decode = h.decode[0]
            decode.breaks = [(3, HOLD)]  # 3 tokens, then the stream waits (for a `release` that never comes)
            received: list[int] = []
            stream = asyncio.ensure_future(_stream_into(client, received))
            await until(lambda: len(received) == 3, 10, what="3 tokens streamed")
            await h.stop_worker(decode)  # the worker dies: its stream and every later call fail unanswered
            await until(lambda: h.sample("pdspark_router_role_outage_waits_total") == 1, 10,
                        what="the stream waiting for a decode worker")
            assert not stream.done()  # waiting, not failed: before, its retries on the dead address used it up
            await h.restart_worker(decode)  # back on its port, as `pdspark up` restarts a worker
            await asyncio.wait_for(stream, scaled(30))
            assert received == list(range(8))  # nothing lost, nothing repeated
            assert decode.calls[-1].generated_token_ids == (0, 1, 2)  # the stream moved on with the tokens so far
            assert h.core.metrics.migrations._value.get() == 1

    run_within(scenario())


def test_a_failure_the_worker_reported_is_not_waited_out(worker_calls):
    """A worker that answers with a failure of its own (here UNAVAILABLE) is alive: no wait, the retries go on at
    once as before (and run out)."""
    async def scenario():
        async with await RouterHarness.start(worker_calls=worker_calls, decodes=1, tokens=8, poll=True) as h, \
                AsyncClient(h.grpc_address, timeout=scaled(60)) as client:
            h.decode[0].mode = RequestFailed(ErrorCode.UNAVAILABLE, "restarting")
            with pytest.raises(ClientError) as e:
                await _stream_into(client, [])
            assert e.value.error_code is ErrorCode.UNAVAILABLE
            assert h.sample("pdspark_router_role_outage_waits_total") == 0

    run_within(scenario())


@pytest.mark.parametrize("wait_s", [0.0, 1.0])
def test_the_wait_is_bounded_by_max_role_outage_wait(worker_calls, wait_s):
    """A worker that never comes back: the request fails UNAVAILABLE after at most its attempts' waits, far short of
    its 60 s deadline; with 0 it does not wait at all."""
    async def scenario():
        async with await RouterHarness.start(worker_calls=worker_calls, decodes=1, tokens=8, poll=True,
                                             max_role_outage_wait_s=wait_s) as h, \
                AsyncClient(h.grpc_address, timeout=scaled(60)) as client:
            await h.stop_worker(h.decode[0])
            started = time.monotonic()
            with pytest.raises(ClientError) as e:
                await _stream_into(client, [])
            took = time.monotonic() - started
            assert e.value.error_code is ErrorCode.UNAVAILABLE
            waits = h.sample("pdspark_router_role_outage_waits_total")
            if wait_s == 0:
                assert waits == 0
            else:
                # One wait per failed attempt at most (max_attempts 3), each at most `wait_s`: far from the
                # request's 60 s deadline, which it must not wait out.
                assert waits >= 1
                assert took < scaled(3 * wait_s + 10), took

    run_within(scenario())
