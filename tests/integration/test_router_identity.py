"""Request identity through the router's real front ends, on stub workers that stream the request id they were
sent: the router names each request itself; a client's id is a label, so two requests with one label stay two
requests; only the router's id, told to the request's own caller, aborts it."""

from __future__ import annotations

import asyncio
import uuid

import aiohttp
import pytest

from pdspark.client import AsyncClient, Client, ClientError
from pdspark.client.client import REQUEST_ID_KEY as SDK_REQUEST_ID_KEY
from pdspark.client.client import RETRY_AFTER_KEY as SDK_RETRY_AFTER_KEY
from pdspark.errors import ErrorCode
from pdspark.router.grpc_api import REQUEST_ID_KEY, RETRY_AFTER_KEY
from pdspark.testing.time_scale import scaled
from pdspark.testing.waiting import run_within, until, wait_until
from pdspark.testing.worker_stubs import HOLD
from router_harness import RouterHarness

PROMPT = dict(token_ids=[5, 6, 7], max_tokens=4)


def test_the_sdk_reads_the_keys_the_router_writes():
    assert (SDK_REQUEST_ID_KEY, SDK_RETRY_AFTER_KEY) == (REQUEST_ID_KEY, RETRY_AFTER_KEY)


def test_two_concurrent_streams_with_one_label_get_their_own_tokens():
    async def scenario():
        async with await RouterHarness.start() as h, AsyncClient(h.grpc_address, timeout=scaled(30)) as a, \
                AsyncClient(h.grpc_address, timeout=scaled(30)) as b:
            h.decode[0].mode = HOLD
            streams = [a.stream(request_id="same-label", **PROMPT), b.stream(request_id="same-label", **PROMPT)]

            async def collect(stream):
                return [chunk async for chunk in stream]

            tasks = [asyncio.create_task(collect(s)) for s in streams]
            await until(lambda: h.decode[0].running == 2, 5, "both requests at the decode worker")
            h.decode[0].release.set()
            results = await asyncio.gather(*tasks)
            ids = [await s.request_id() for s in streams]
            assert ids[0] != ids[1] and "same-label" not in ids
            for rid, chunks in zip(ids, results):
                assert {c.request_id for c in chunks} == {rid}
                assert {c.client_request_id for c in chunks} == {"same-label"}
                # The stub streams the id it was sent: each request got the tokens made for it, and all of them.
                assert "".join(c.text for c in chunks) == f"{rid};" * 4
            assert sorted(c.request_id for c in h.decode[0].calls) == sorted(ids)

    run_within(scenario())


def test_a_label_from_another_connection_cannot_abort_and_the_routers_id_can():
    async def scenario():
        async with await RouterHarness.start() as h, AsyncClient(h.grpc_address, timeout=scaled(30)) as owner, \
                AsyncClient(h.grpc_address, timeout=scaled(30)) as other:
            h.decode[0].mode = HOLD
            stream = owner.stream(request_id="victim", **PROMPT)
            rid = await stream.request_id()
            await until(lambda: h.decode[0].running == 1, 5, "the request at the decode worker")
            # Neither the label nor a guess reaches it.
            assert not await other.abort("victim")
            assert not await other.abort(uuid.uuid4().hex)
            assert h.decode[0].running == 1 and h.decode[0].cancelled == [] and rid in h.core.live
            # The router's id does: the caller's (or whoever it handed the id to).
            assert await other.abort(rid)
            with pytest.raises(ClientError) as e:
                _ = [c async for c in stream]
            assert e.value.error_code is ErrorCode.ABORTED and "aborted by its caller" in e.value.message
            await until(lambda: h.decode[0].cancelled == [rid], 1, "the decode leg cancelled")
            assert not h.core.live and h.core.admission.in_flight == 0

    run_within(scenario())


def test_the_owners_cancel_ends_its_request_on_the_workers():
    async def scenario():
        async with await RouterHarness.start() as h, AsyncClient(h.grpc_address, timeout=scaled(30)) as client:
            h.decode[0].mode = HOLD
            stream = client.stream(request_id="mine", **PROMPT)
            rid = await stream.request_id()
            await until(lambda: h.decode[0].running == 1, 5, "the request at the decode worker")
            await stream.cancel()
            took = await until(lambda: h.decode[0].cancelled == [rid] and not h.core.live, 1, "cancelled")
            assert h.core.admission.in_flight == 0
            print(f"\ncancel reached the decode stub in {took * 1e3:.0f} ms")

    run_within(scenario())


def test_the_sync_sdks_cancel_ends_its_request_on_the_workers():
    async def scenario():
        async with await RouterHarness.start() as h:
            h.decode[0].mode = HOLD

            def start_and_cancel():
                with Client(h.grpc_address, timeout=scaled(30)) as client:
                    stream = client.stream(request_id="mine", **PROMPT)
                    rid = stream.request_id()
                    # The stub's count, read from this thread: an int, atomic.
                    wait_until(lambda: h.decode[0].running == 1, 5, "the request at the decode worker",
                               interval_s=0.01)
                    stream.cancel()
                    return rid

            rid = await asyncio.wait_for(asyncio.to_thread(start_and_cancel), scaled(5))
            await until(lambda: h.decode[0].cancelled == [rid] and not h.core.live, 1, "cancelled")

    run_within(scenario())


def test_a_queued_request_is_aborted_where_it_waits():
    async def scenario():
        async with await RouterHarness.start(max_in_flight=1, max_queued=4) as h, \
                AsyncClient(h.grpc_address, timeout=scaled(30)) as client:
            h.decode[0].mode = HOLD
            first = asyncio.create_task(client.generate(**PROMPT))
            await until(lambda: h.decode[0].running == 1, 5, "the first request at the decode worker")
            queued = client.stream(**PROMPT)
            rid = await queued.request_id()  # told at once, while it waits for a slot
            await until(lambda: h.core.admission.queued == 1, 5, "the second request queued")
            assert await client.abort(rid)
            with pytest.raises(ClientError) as e:
                _ = [c async for c in queued]
            assert e.value.error_code is ErrorCode.ABORTED
            assert h.core.admission.queued == 0 and len(h.decode[0].calls) == 1  # it never reached a worker
            h.decode[0].release.set()
            assert len((await first).token_ids) == 4

    run_within(scenario())


def test_http_labels_are_echoed_and_never_become_the_request_id():
    async def scenario():
        async with await RouterHarness.start() as h, aiohttp.ClientSession() as s:
            h.decode[0].mode = HOLD

            async def generate():
                async with s.post(h.http_url + "/generate", json={"input_ids": [5, 6, 7], "rid": "mine"},
                                  headers={"X-Request-Id": "label-1"}) as r:
                    return r.status, r.headers.get("X-Request-Id"), await r.json()

            tasks = [asyncio.create_task(generate()) for _ in range(2)]
            await until(lambda: h.decode[0].running == 2, 5, "both requests at the decode worker")
            h.decode[0].release.set()
            replies = await asyncio.gather(*tasks)
            ids = [body["meta_info"]["id"] for _, _, body in replies]
            assert ids[0] != ids[1] and not {"mine", "label-1"} & set(ids)
            for (status, echoed, body), rid in zip(replies, ids):
                assert status == 200 and echoed == "label-1" and body["text"] == f"{rid};" * 4
            # An OpenAI request's label can be its `user`; its id is the router's, and so is the workers'.
            async with s.post(h.http_url + "/v1/completions",
                              json={"prompt": [5, 6, 7], "max_tokens": 4, "user": "someone"}) as r:
                body = await r.json()
            assert body["id"] == h.decode[0].calls[-1].request_id != "someone"

    run_within(scenario())
