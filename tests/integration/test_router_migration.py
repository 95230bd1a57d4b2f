"""Stream migration in the router's dispatcher, on stub workers (the real-process rung is
tests/cluster/test_migration.py): a decode stream that breaks or stalls after tokens reached the client moves to
another pair carrying prompt + the tokens so far; the client sees every token once; the migrations are counted and
bounded; failures before the first token stay plain retries. Every case runs with the router's calls to the workers
made one gRPC call each and multiplexed on one stream per worker (`worker_calls`)."""

from __future__ import annotations

import json
import time

import aiohttp
import pytest

from pdspark.client import AsyncClient, ClientError
from pdspark.errors import ErrorCode
from pdspark.testing.time_scale import scaled
from pdspark.testing.waiting import run_within
from pdspark.testing.worker_stubs import CANCEL, HANG
from router_harness import RouterHarness

PROMPT = [5, 6, 7]


async def stream_ids(client: AsyncClient, **kw) -> list[int]:
    return [t async for chunk in client.stream(token_ids=PROMPT, max_tokens=8, **kw) for t in chunk.token_ids]


def test_a_stream_that_breaks_mid_way_continues_on_another_pair_with_the_tokens_so_far(worker_calls):
    async def scenario():
        async with await RouterHarness.start(worker_calls=worker_calls, prefills=2, decodes=2, tokens=8) as h, \
                AsyncClient(h.grpc_address, timeout=scaled(30)) as client:
            h.decode[0].breaks = [3]  # the first decode worker dies after 3 tokens
            assert await stream_ids(client) == list(range(8))  # nothing lost, nothing repeated
            (first,), (second,) = h.decode[0].calls, h.decode[1].calls
            assert first.generated_token_ids == () and second.generated_token_ids == (0, 1, 2)
            assert second.prompt_token_ids == tuple(PROMPT)
            # The new prefill computes the prompt and the tokens so far, under a new worker-side id.
            assert [c.prompt_token_ids for c in h.prefill[0].calls] == [tuple(PROMPT), (*PROMPT, 0, 1, 2)]
            assert second.request_id != first.request_id
            assert h.core.metrics.migrations._value.get() == 1 and h.core.metrics.retries._value.get() == 0

    run_within(scenario())


def test_http_sse_stream_survives_a_migration(worker_calls):
    async def scenario():
        async with await RouterHarness.start(worker_calls=worker_calls, decodes=2, tokens=6) as h, \
                aiohttp.ClientSession() as http:
            h.decode[0].breaks = [1]
            body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 6, "stream": True}
            texts = []
            async with http.post(h.http_url + "/v1/completions", json=body) as r:
                assert r.status == 200
                async for line in r.content:
                    if line.startswith(b"data: {"):
                        texts += [c["text"] for c in json.loads(line[6:])["choices"]]
            # Each stub chunk's text names the worker-side request it came from: 1 from the first pair, 5 after.
            first, second = h.decode[0].calls[0].request_id, h.decode[1].calls[0].request_id
            assert "".join(texts) == f"{first};" + f"{second};" * 5

    run_within(scenario())


def test_the_migrations_of_a_request_are_bounded(worker_calls):
    async def scenario():
        async with await RouterHarness.start(worker_calls=worker_calls, decodes=2, tokens=8, max_migrations=2) as h, \
                AsyncClient(h.grpc_address, timeout=scaled(30)) as client:
            for stub in h.decode:
                stub.breaks = [1, 1, 1]  # every stream dies after one token
            with pytest.raises(ClientError) as e:
                await stream_ids(client)
            assert e.value.error_code is ErrorCode.UNAVAILABLE and "max_migrations" in str(e.value)
            assert sum(len(s.calls) for s in h.decode) == 3  # the first pair, then two migrations
            assert h.core.metrics.migrations._value.get() == 2

    run_within(scenario())


def test_no_migration_when_disabled(worker_calls):
    async def scenario():
        async with await RouterHarness.start(worker_calls=worker_calls, decodes=2, tokens=8, max_migrations=0) as h, \
                AsyncClient(h.grpc_address, timeout=scaled(30)) as client:
            h.decode[0].breaks = [2]
            with pytest.raises(ClientError) as e:
                await stream_ids(client)
            assert e.value.error_code is ErrorCode.UNAVAILABLE
            assert len(h.decode[1].calls) == 0

    run_within(scenario())


def test_a_stalled_stream_on_a_worker_that_stops_answering_health_checks_migrates_within_two_seconds(worker_calls):
    async def scenario():
        async with await RouterHarness.start(worker_calls=worker_calls, decodes=2, tokens=8, poll=True) as h, \
                AsyncClient(h.grpc_address, timeout=scaled(30)) as client:
            h.decode[0].breaks = [(2, HANG)]  # two tokens, then the stream stalls ...
            received: list[int] = []
            stalled_at = None
            async for chunk in client.stream(token_ids=PROMPT, max_tokens=8):
                received += chunk.token_ids
                if len(received) == 2:
                    stalled_at = time.monotonic()
                    h.health[id(h.decode[0])].mode = HANG  # ... and the worker stops answering (SIGSTOP)
            assert received == list(range(8))
            assert stalled_at is not None
            took = time.monotonic() - stalled_at
            assert took < scaled(2.0), f"the stalled stream moved after {took:.2f} s"
            assert h.decode[1].calls[0].generated_token_ids == (0, 1)
            print(f"\nstalled stream migrated after {took * 1e3:.0f} ms")

    run_within(scenario())


def test_a_failure_before_the_first_token_is_a_retry_not_a_migration(worker_calls):
    async def scenario():
        async with await RouterHarness.start(worker_calls=worker_calls, decodes=2, tokens=4) as h, \
                AsyncClient(h.grpc_address, timeout=scaled(30)) as client:
            h.decode[0].breaks = [0]
            assert await stream_ids(client) == list(range(4))
            calls = h.decode[0].calls + h.decode[1].calls
            assert len(calls) == 2 and all(c.generated_token_ids == () for c in calls)
            assert h.core.metrics.retries._value.get() == 1 and h.core.metrics.migrations._value.get() == 0

    run_within(scenario())


@pytest.mark.parametrize("after", [3, 0])
def test_a_stream_cancelled_on_the_workers_side_is_migrated_or_retried_not_ended(worker_calls, after):
    """A decode stream that ends CANCELLED without the router asking (a proxy between them reset it, or the worker's
    side cancelled it) failed on the worker's side, unlike a cancel of the router's own or its client's: after
    tokens reached the client it migrates to the other pair, before them it is retried there. What reaches the
    router: per-request, the call's own CANCELLED status; multiplexed, its `Calls` stream's (`CANCEL`)."""

    async def scenario():
        async with await RouterHarness.start(worker_calls=worker_calls, decodes=2, tokens=8) as h, \
                AsyncClient(h.grpc_address, timeout=scaled(30)) as client:
            h.decode[0].breaks = [(after, CANCEL)]
            assert await stream_ids(client) == list(range(8))  # nothing lost, nothing repeated
            (first,), (second,) = h.decode[0].calls, h.decode[1].calls
            assert first.generated_token_ids == () and second.generated_token_ids == tuple(range(after))
            migrated = 1 if after else 0
            assert h.sample("pdspark_router_migrations_total") == migrated
            assert h.sample("pdspark_router_retries_total") == 1 - migrated

    run_within(scenario())


def test_a_prefill_leg_cancelled_on_the_workers_side_is_retried_on_another_pair(worker_calls):
    """The same for a prefill leg: its CANCELLED (the call's, or its `Calls` stream's) is a retry elsewhere."""

    async def scenario():
        async with await RouterHarness.start(worker_calls=worker_calls, prefills=2, tokens=4) as h, \
                AsyncClient(h.grpc_address, timeout=scaled(30)) as client:
            h.prefill[0].mode = CANCEL
            # Paired with it, the decode stream waits for its transfer (until the failed leg ends the attempt).
            h.decode[0].hang_with = {h.address[id(h.prefill[0])]}
            assert await stream_ids(client) == list(range(4))
            assert len(h.prefill[0].calls) == len(h.prefill[1].calls) == 1
            assert h.sample("pdspark_router_retries_total") == 1
            assert h.sample("pdspark_router_migrations_total") == 0

    run_within(scenario())
