"""Admission and backpressure through the router's real HTTP and gRPC front ends, on stub workers: a flood beyond
the queue is refused at once (429 + Retry-After / RESOURCE_EXHAUSTED), the queued requests are served, the router
serves normally right after; a full worker sends the request to another pair, and when all are full the client
gets 429."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest

from pdspark.client import AsyncClient, ClientError
from pdspark.errors import ErrorCode, RequestFailed
from pdspark.testing.time_scale import scaled
from pdspark.testing.waiting import run_within, until
from pdspark.testing.worker_stubs import HOLD
from router_harness import RouterHarness

BODY = {"prompt": [5, 6, 7], "max_tokens": 4}


async def post(session: aiohttp.ClientSession, h: RouterHarness, path="/v1/completions", body=None):
    """(status, headers, JSON body or SSE text, seconds taken)."""
    t0 = time.perf_counter()
    async with session.post(h.http_url + path, json=body or BODY) as r:
        if r.content_type == "application/json":
            payload = await r.json()
        else:
            payload = await r.text()
        return r.status, r.headers, payload, time.perf_counter() - t0


def test_a_flood_beyond_the_queue_gets_429_at_once_and_the_router_serves_right_after():
    async def scenario():
        async with await RouterHarness.start(max_in_flight=2, max_queued=2) as h, aiohttp.ClientSession() as s:
            h.decode[0].mode = HOLD
            held = [asyncio.create_task(post(s, h)) for _ in range(4)]
            await until(lambda: h.decode[0].running == 2 and h.core.admission.queued == 2, 5, "2 held + 2 queued")
            # Every kind of request the HTTP API takes, streamed or not, is refused the same way.
            flood = [(path, {**body, "stream": stream}) for path, body in
                     (("/v1/completions", BODY), ("/generate", {"input_ids": [5, 6, 7]}),
                      ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}))
                     for stream in (False, True)] * 5
            refused = await asyncio.gather(*(post(s, h, path, body) for path, body in flood))
            for status, headers, payload, _ in refused:
                assert status == 429 and headers["Retry-After"] == "1"
                assert payload["error"]["type"] == "rate_limit_error" and payload["error"]["code"] == "overloaded"
                assert "max_queued 2" in payload["error"]["message"]
            slowest = max(r[3] for r in refused)
            assert slowest < scaled(0.5), f"a refusal took {slowest:.3f} s"
            print(f"\n{len(refused)} refusals, slowest {slowest * 1e3:.1f} ms")
            assert len(h.decode[0].calls) == 2  # nothing refused reached a worker
            # Busy is not unhealthy: /health stays 200 and shows the load.
            async with s.get(h.http_url + "/health") as r:
                health = await r.json()
            assert r.status == 200 and (health["in_flight"], health["queued"]) == (2, 2)
            async with s.get(h.http_url + "/metrics") as r:
                text = await r.text()
            assert "pdspark_router_requests_queued 2.0" in text and "pdspark_router_requests_in_flight 2.0" in text
            assert 'pdspark_router_requests_total{api="completions",outcome="overloaded"} 10.0' in text

            h.decode[0].release.set()
            served = await asyncio.gather(*held)
            assert [r[0] for r in served] == [200] * 4
            assert [len(r[2]["choices"][0]["text"].split(";")) - 1 for r in served] == [4] * 4
            status, _, payload, _ = await post(s, h)
            assert status == 200 and payload["usage"]["completion_tokens"] == 4
            assert (h.core.admission.in_flight, h.core.admission.queued) == (0, 0)

    run_within(scenario())


def test_a_full_router_answers_grpc_with_resource_exhausted_and_retry_after():
    async def scenario():
        async with await RouterHarness.start(max_in_flight=1, max_queued=0) as h, \
                AsyncClient(h.grpc_address, timeout=scaled(30)) as client:
            h.decode[0].mode = HOLD
            held = asyncio.create_task(client.generate(token_ids=[5, 6, 7], max_tokens=4))
            await until(lambda: h.decode[0].running == 1, 5, "one request at the decode worker")
            t0 = time.perf_counter()
            with pytest.raises(ClientError) as e:
                await client.generate(token_ids=[5, 6, 7], max_tokens=4)
            took = time.perf_counter() - t0
            assert e.value.code == "RESOURCE_EXHAUSTED" and e.value.error_code is ErrorCode.OVERLOADED
            assert e.value.error_code.retryable and e.value.retry_after_s == 1.0 and took < scaled(0.5)
            h.decode[0].release.set()
            assert len((await held).token_ids) == 4
            assert len((await client.generate(token_ids=[5, 6, 7], max_tokens=4)).token_ids) == 4

    run_within(scenario())


def test_queue_time_counts_against_the_request_timeout():
    async def scenario():
        async with await RouterHarness.start(max_in_flight=1, max_queued=4) as h, aiohttp.ClientSession() as s:
            h.decode[0].mode = HOLD
            held = asyncio.create_task(post(s, h))
            await until(lambda: h.decode[0].running == 1, 5, "one request at the decode worker")
            async with s.post(h.http_url + "/v1/completions", json=BODY, headers={"X-Request-Timeout": "0.2"}) as r:
                assert r.status == 504 and (await r.json())["error"]["code"] == "deadline"
            assert h.core.admission.queued == 0 and len(h.decode[0].calls) == 1  # it never reached a worker
            h.decode[0].release.set()
            assert (await held)[0] == 200

    run_within(scenario())


def test_a_full_decode_worker_sends_the_request_to_another_pair():
    async def scenario():
        async with await RouterHarness.start(decodes=2) as h, aiohttp.ClientSession() as s:
            h.decode[0].mode = RequestFailed(ErrorCode.OVERLOADED, "decode queue full")
            status, _, payload, _ = await post(s, h)
            assert status == 200 and payload["usage"]["completion_tokens"] == 4
            assert len(h.decode[0].calls) == 1 and len(h.decode[1].calls) == 1

    run_within(scenario())


def test_every_worker_full_is_429_after_one_try_each():
    async def scenario():
        async with await RouterHarness.start(decodes=2) as h, aiohttp.ClientSession() as s:
            for d in h.decode:
                d.mode = RequestFailed(ErrorCode.OVERLOADED, "decode queue full")
            status, headers, payload, took = await post(s, h)
            assert status == 429 and headers["Retry-After"] == "1" and payload["error"]["type"] == "rate_limit_error"
            assert "decode queue full" in payload["error"]["message"] and took < scaled(0.5)
            assert [len(d.calls) for d in h.decode] == [1, 1]

    run_within(scenario())


def test_a_full_prefill_worker_fails_its_pair_at_once_and_another_prefill_serves():
    async def scenario():
        async with await RouterHarness.start(prefills=2, transfer_timeout_s=30) as h, aiohttp.ClientSession() as s:
            h.prefill[0].mode = RequestFailed(ErrorCode.OVERLOADED, "prefill queue full")
            # A real decode worker would wait for the transfer the refused prefill never starts.
            h.decode[0].hang_with = {h.address[id(h.prefill[0])]}
            status, _, payload, took = await post(s, h)
            assert status == 200 and payload["usage"]["completion_tokens"] == 4
            assert took < scaled(2), f"the pair waited {took:.1f} s for a prefill that had refused"
            # The response can reach the client (the last token) before the second prefill call reaches its worker.
            await until(lambda: len(h.prefill[1].calls) == 1, 5, "the second attempt's prefill call")
            (first,), (second,) = ([c.request_id for c in p.calls] for p in h.prefill)
            assert payload["id"] == first  # the router's id of the request is the response's
            # Each attempt reaches the workers under its own id: no clash with the first one's leftovers.
            assert second == first + "-1" and h.decode[0].calls[-1].request_id == second
            # The first attempt's decode leg (if its call got there before the router cancelled it) was cancelled.
            assert h.decode[0].cancelled == [c.request_id for c in h.decode[0].calls[:-1]]

    run_within(scenario())
