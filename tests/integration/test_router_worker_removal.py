"""A worker removed (`DELETE /workers`) or retired (DNS discovery's `retire`) while requests are on it, on stub
workers behind the router's real dispatcher and HTTP front end: its attempts end as a worker marked down ends them
(retried on another pair before the first token, migrated after it), its channel is closed only then, and no call
goes to the closed channel (the client never sees its stream dropped, a 500 or an error event). Every case runs with
the router's calls to the workers made one gRPC call each and multiplexed on one stream per worker
(`worker_calls`)."""

from __future__ import annotations

import asyncio
import json
import logging

import aiohttp

from pdspark.testing.time_scale import scaled
from pdspark.testing.waiting import run_within, until
from pdspark.testing.worker_stubs import HANG, HOLD
from router_harness import RouterHarness

PROMPT = [5, 6, 7]
ADMIN = "admin-key-0123456789"  # `/workers` takes an admin key; generation needs none (no client keys)
# The request's own timeout, far beyond what the cases take: a request left hanging fails on it instead of stalling
# the test until the transfer timeout.
REQUEST_TIMEOUT_S = scaled(10)


async def sse_texts(s: aiohttp.ClientSession, h: RouterHarness, max_tokens: int, on_chunk=None) -> list[str]:
    """A streamed completion; the text of each chunk (the stub decode's request id: whose token it is). Asserts
    HTTP 200, no error event, and `[DONE]` last. `on_chunk(texts)` is awaited after each chunk."""
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": max_tokens, "stream": True}
    texts: list[str] = []
    events: list[str] = []
    async with s.post(h.http_url + "/v1/completions", json=body) as r:
        assert r.status == 200, await r.text()
        async for line in r.content:
            if not line.startswith(b"data: "):
                continue
            event = line[6:].decode().strip()
            events.append(event)
            if event.startswith("{"):
                parsed = json.loads(event)
                assert "error" not in parsed, parsed
                texts += [c["text"] for c in parsed["choices"]]
                if on_chunk is not None:
                    await on_chunk(texts)
    assert events and events[-1] == "[DONE]", events
    return texts


async def delete_worker(s: aiohttp.ClientSession, h: RouterHarness, address: str) -> None:
    async with s.delete(h.http_url + "/workers", params={"address": address},
                        headers={"Authorization": f"Bearer {ADMIN}"}) as r:
        assert r.status == 200, await r.text()



def router_errors(caplog) -> list[logging.LogRecord]:
    """What the router logged at ERROR (pdspark's loggers, and aiohttp's for a handler that raised). Not grpc's own
    asyncio noise: its poller of an earlier test's closed event loop may log "Event loop is closed" during any later
    test of the process."""
    return [r for r in caplog.records if r.levelno >= logging.ERROR and r.name.startswith(("pdspark", "aiohttp"))]

def test_a_decode_worker_deleted_mid_stream_migrates_the_stream(worker_calls, caplog):
    async def scenario():
        async with await RouterHarness.start(worker_calls=worker_calls, prefills=2, decodes=2, tokens=8,
                                             request_timeout_s=REQUEST_TIMEOUT_S, admin_api_key=(ADMIN,)) as h, \
                aiohttp.ClientSession() as s:
            h.decode[0].breaks = [(2, HOLD)]  # two tokens, then the stream waits (a long generation)
            gone = h.address[id(h.decode[0])]

            async def remove_after_two(texts: list[str]) -> None:
                if len(texts) == 2:
                    await delete_worker(s, h, gone)

            texts = await sse_texts(s, h, 8, remove_after_two)
            first, second = h.decode[0].calls[0].request_id, h.decode[1].calls[0].request_id
            assert texts == [f"{first};"] * 2 + [f"{second};"] * 6  # every token once, the rest from the other
            assert h.decode[1].calls[0].generated_token_ids == (0, 1)
            assert h.sample("pdspark_router_migrations_total") == 1
            assert gone not in h.registry.workers
            await until(lambda: not h.core.dispatcher.active and not h.core.live, 5, "the request over")
            assert not router_errors(caplog), caplog.text

    caplog.set_level(logging.WARNING)
    run_within(scenario())


def test_a_prefill_worker_deleted_mid_prefill_is_retried_on_the_other(worker_calls, caplog):
    async def scenario():
        async with await RouterHarness.start(worker_calls=worker_calls, prefills=2, decodes=2, tokens=4,
                                             request_timeout_s=REQUEST_TIMEOUT_S, admin_api_key=(ADMIN,)) as h, \
                aiohttp.ClientSession() as s:
            hung = h.prefill[0]
            gone = h.address[id(hung)]
            hung.mode = HANG  # the prefill never answers while it is registered ...
            h.decode[0].hang_with = {gone}  # ... and the decode waits for its transfer
            request = asyncio.ensure_future(sse_texts(s, h, 4))
            await until(lambda: hung.calls and h.decode[0].calls, 5, "the first attempt on both workers")
            await delete_worker(s, h, gone)
            texts = await request
            (first,) = hung.calls
            await until(lambda: hung.cancelled == [first.request_id], 5, "the removed worker's call ended")
            assert hung.aborted == []  # nothing is sent on the closed channel
            retry = h.decode[0].calls[1].request_id
            assert texts == [f"{retry};"] * 4
            assert [c.request_id for c in h.prefill[1].calls] == [retry]  # retried on the other prefill worker
            assert h.sample("pdspark_router_retries_total") == 1
            assert h.sample("pdspark_router_migrations_total") == 0
            await until(lambda: not h.core.dispatcher.active and not h.core.live, 5, "the request over")
            assert not router_errors(caplog), caplog.text

    caplog.set_level(logging.WARNING)
    run_within(scenario())


def test_a_retired_worker_closed_with_a_stream_still_on_it_migrates_the_stream(worker_calls, caplog):
    """`retire` (DNS discovery's, for an address that vanished) lets the calls on a worker go on for `drain_s`; one
    still running then ends as a worker down's."""
    async def scenario():
        async with await RouterHarness.start(worker_calls=worker_calls, prefills=2, decodes=2, tokens=8,
                                             request_timeout_s=REQUEST_TIMEOUT_S, admin_api_key=(ADMIN,)) as h, \
                aiohttp.ClientSession() as s:
            h.decode[0].breaks = [(2, HOLD)]  # two tokens, then the stream outlives the drain
            gone = h.address[id(h.decode[0])]

            async def retire_after_two(texts: list[str]) -> None:
                if len(texts) == 2:
                    h.registry.retire(gone, drain_s)

            texts = await sse_texts(s, h, 8, retire_after_two)
            first, second = h.decode[0].calls[0].request_id, h.decode[1].calls[0].request_id
            assert texts == [f"{first};"] * 2 + [f"{second};"] * 6
            assert h.sample("pdspark_router_migrations_total") == 1
            await until(lambda: not h.core.dispatcher.active and not h.core.live, 5, "the request over")
            assert not router_errors(caplog), caplog.text

    drain_s = 0.2  # the retired worker's drain, the behaviour under test (not a bound)
    caplog.set_level(logging.WARNING)
    run_within(scenario())
