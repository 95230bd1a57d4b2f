"""Deadlines through the router's real front ends, on stub workers that record the timeout each call carried:
one deadline per request (the caller's timeout, or the router's default), shared by every attempt, on every call
to a worker; a worker that never answers ends the request with DEADLINE in bounded time, both legs cancelled. The
cases on the calls to the workers run with those calls made one gRPC call each and multiplexed (`worker_calls`)."""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import grpc
import pytest

from pdspark.client import AsyncClient, ClientError
from pdspark.errors import ErrorCode, RequestFailed
from pdspark.testing.time_scale import scaled
from pdspark.testing.waiting import run_within, until
from pdspark.testing.worker_stubs import HANG, OK, Delayed
from pdspark.v1 import router_pb2, router_pb2_grpc
from router_harness import RouterHarness

PROMPT = dict(token_ids=[5, 6, 7], max_tokens=4)
SLACK_S = scaled(0.3)  # how late past its timeout a request may end (scheduling on a shared 2-core machine)
# How far above the router's deadline a worker may read its call's timeout: gRPC rounds a deadline up when it puts
# it on the wire (+0.6 and +9.5 ms seen).
WIRE_S = 0.02


def test_a_decode_that_never_answers_ends_the_request_at_the_routers_timeout_with_both_legs_cancelled(worker_calls):
    async def scenario():
        async with await RouterHarness.start(worker_calls=worker_calls, request_timeout_s=0.5) as h, \
                AsyncClient(h.grpc_address, timeout=scaled(30)) as client:
            h.prefill[0].mode = h.decode[0].mode = HANG
            t0 = time.perf_counter()
            with pytest.raises(ClientError) as e:
                await client.generate(**PROMPT)
            took = time.perf_counter() - t0
            # The router's own deadline (the client's, 30 s scaled, is far away): its DEADLINE, reported as data.
            assert e.value.error_code is ErrorCode.DEADLINE and e.value.code == "DEADLINE_EXCEEDED"
            assert 0.5 <= took < 0.5 + SLACK_S, f"ended after {took:.3f} s"
            (decode_call,), (prefill_call,) = h.decode[0].calls, h.prefill[0].calls
            # The client's is capped.
            assert decode_call.timeout_s <= 0.5 + WIRE_S and prefill_call.timeout_s <= 0.5 + WIRE_S
            rid = decode_call.request_id
            await until(lambda: h.decode[0].cancelled == [rid] and h.prefill[0].cancelled == [rid], 1,
                        "both legs cancelled")
            await until(lambda: h.prefill[0].aborted == [rid], 1, "the prefill worker told to drop it")
            assert not h.core.live and h.core.admission.in_flight == 0
            print(f"\nDEADLINE after {took * 1e3:.0f} ms for a 500 ms timeout")

    run_within(scenario())


def test_an_attempt_whose_stream_ended_waits_for_its_prefill_leg_instead_of_aborting_it(worker_calls):
    """The decode stub needs no transfer, so its last token comes before a slow prefill leg answers. The attempt
    ends when the caller stops at the last chunk: it must wait for that leg's answer (bounded), not leave the leg to
    whenever the garbage collector finalizes the attempt, which cancelled and aborted a call about to succeed."""
    async def scenario():
        async with await RouterHarness.start(worker_calls=worker_calls) as h, \
                aiohttp.ClientSession() as s:
            h.prefill[0].mode = Delayed(0.5, OK)  # far longer than 4 stub tokens take to reach the client
            async with s.post(h.http_url + "/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 4}) as r:
                assert r.status == 200, await r.text()
            # The non-streamed reply is sent once the request is over, attempt included.
            (call,) = h.prefill[0].calls
            assert h.prefill[0].answered == [call.request_id]
            assert h.prefill[0].cancelled == [] and h.prefill[0].aborted == []
            assert not h.core.dispatcher.active and not h.core.live

    run_within(scenario())


def test_a_prefill_worker_holds_a_leg_until_it_answered_a_decode_worker_until_its_stream_ended(worker_calls):
    """The router's books (`in_flight` in /workers, which load-aware routing and the failure matrix read): a prefill
    worker that answered its leg no longer holds the request, while the decode stream goes on."""
    async def scenario():
        async with await RouterHarness.start(worker_calls=worker_calls, request_timeout_s=2.0) as h, \
                AsyncClient(h.grpc_address, timeout=scaled(30)) as client:
            h.decode[0].mode = HANG  # the stream never ends: only the router's timeout does
            prefill, decode = (next(w for w in h.core.registry.workers.values() if w.role == role)
                               for role in ("prefill", "decode"))
            request = asyncio.ensure_future(client.generate(**PROMPT))
            await until(lambda: h.prefill[0].answered, 5, "the prefill leg answered")
            await until(lambda: prefill.in_flight == 0, 1, "the prefill worker's leg off the books")
            assert decode.in_flight == 1
            with pytest.raises(ClientError):
                await request
            assert (prefill.in_flight, decode.in_flight) == (0, 0)

    run_within(scenario())


def test_every_call_carries_what_is_left_of_the_callers_timeout(worker_calls):
    async def scenario():
        async with await RouterHarness.start(worker_calls=worker_calls) as h, \
                AsyncClient(h.grpc_address, timeout=caller_s) as client:
            await client.generate(**PROMPT)
            # The last token can reach the client before the prefill call reaches its worker.
            await until(lambda: h.prefill[0].calls, 5, "the prefill call")
            for call in (h.decode[0].calls[0], h.prefill[0].calls[0]):
                # The SDK's timeout, not the router's 600 s default, less what the call took to get there.
                assert caller_s - scaled(1.0) < call.timeout_s <= caller_s + WIRE_S

    caller_s = 5.0  # the caller's timeout, the behaviour under test (not a bound)

    run_within(scenario())


def test_retries_share_one_deadline(worker_calls):
    async def scenario():
        async with await RouterHarness.start(worker_calls=worker_calls, request_timeout_s=1.0) as h, \
                AsyncClient(h.grpc_address, timeout=scaled(30)) as client:
            # The first attempt fails retryably after 0.4 s; the second never answers.
            h.decode[0].script = [Delayed(0.4, RequestFailed(ErrorCode.UNAVAILABLE, "restarting")), HANG]
            t0 = time.perf_counter()
            with pytest.raises(ClientError) as e:
                await client.generate(**PROMPT)
            took = time.perf_counter() - t0
            assert e.value.error_code is ErrorCode.DEADLINE
            assert 1.0 <= took < 1.0 + SLACK_S, f"ended after {took:.3f} s: the retry got a fresh timeout"
            first, second = h.decode[0].calls
            assert first.timeout_s <= 1.0 + WIRE_S and second.timeout_s <= 1.0 - 0.4 + 0.05  # not 1 s again
            print(f"\nretry carried {second.timeout_s * 1e3:.0f} ms of the 1000 ms timeout; ended at "
                  f"{took * 1e3:.0f} ms")

    run_within(scenario())


def test_the_http_stream_has_a_deadline_too():
    async def scenario():
        async with await RouterHarness.start(tokens=3) as h, aiohttp.ClientSession() as s:
            h.decode[0].delay_s = 30  # the first token at once, the next one far beyond the timeout
            body = {"prompt": [5, 6, 7], "max_tokens": 4, "stream": True}
            t0 = time.perf_counter()
            async with s.post(h.http_url + "/v1/completions", json=body, headers={"X-Request-Timeout": "0.5"}) as r:
                events = [line.removeprefix("data: ") for line in (await r.text()).split("\n\n") if line]
            took = time.perf_counter() - t0
            assert r.status == 200 and events[-1] == "[DONE]"
            assert json.loads(events[-2])["error"]["code"] == "deadline"
            assert 0.5 <= took < 0.5 + SLACK_S
            rid = h.decode[0].calls[0].request_id
            await until(lambda: h.decode[0].cancelled == [rid], 1, "the decode leg cancelled")

            # Refused before its first token: a plain 504, not a 200 stream.
            h.decode[0].mode = HANG
            async with s.post(h.http_url + "/v1/completions", json=body, headers={"X-Request-Timeout": "0.3"}) as r:
                assert r.status == 504 and (await r.json())["error"]["code"] == "deadline"

    run_within(scenario())


@pytest.mark.parametrize("value", ["0", "-1", "soon", "nan", "inf"])
def test_a_bad_timeout_header_is_a_400_naming_it(value):
    async def scenario():
        async with await RouterHarness.start() as h, aiohttp.ClientSession() as s:
            async with s.post(h.http_url + "/v1/completions", json={"prompt": [5], "max_tokens": 1},
                              headers={"X-Request-Timeout": value}) as r:
                assert r.status == 400 and "X-Request-Timeout" in (await r.json())["error"]["message"]
            assert h.decode[0].calls == []

    run_within(scenario())


@pytest.mark.parametrize("value", [-1.0, float("nan"), float("inf")])
def test_a_bad_grpc_timeout_is_invalid_argument(value):
    async def scenario():
        async with await RouterHarness.start() as h, grpc.aio.insecure_channel(h.grpc_address) as channel:
            request = router_pb2.RouterGenerateRequest(token_ids=router_pb2.TokenIds(ids=[5]), timeout_s=value)
            with pytest.raises(grpc.aio.AioRpcError) as e:
                _ = [c async for c in router_pb2_grpc.RouterStub(channel).Generate(request, timeout=scaled(10))]
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "timeout_s" in e.value.details()
            assert h.decode[0].calls == []

    run_within(scenario())
