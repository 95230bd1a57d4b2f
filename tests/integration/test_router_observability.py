"""The router's metrics and Prometheus service discovery through its real HTTP and gRPC front ends, on stub workers
(`RouterHarness`): `/prometheus/targets` lists every metrics endpoint by name and takes what `GET /workers` takes;
streams count their inter-token latency per token; 429s count by reason; per-worker series live from registration
to removal; an invalid gRPC request is counted."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from pdspark.client import AsyncClient, ClientError
from pdspark.errors import ErrorCode, RequestFailed
from pdspark.testing.time_scale import scaled
from pdspark.testing.waiting import run_within, until
from pdspark.testing.worker_stubs import HOLD
from router_harness import RouterHarness

CLIENT, ADMIN = "client-key-0123456789", "admin-key-0123456789"
BODY = {"prompt": [5, 6, 7], "max_tokens": 4}


async def get(s: aiohttp.ClientSession, url: str, key: str | None = None):
    async with s.get(url, headers={"Authorization": f"Bearer {key}"} if key else {}) as r:
        return r.status, await r.json()


def test_prometheus_targets_lists_the_router_and_every_worker_by_name():
    async def scenario():
        # A development router (no keys, loopback): the list is open, as GET /workers is.
        async with await RouterHarness.start(decodes=2, poll=True, load_interval_s=0.1) as h, \
                aiohttp.ClientSession() as s:
            await until(lambda: all(w.metrics_url for w in h.registry.workers.values()), 10, "load reports")
            status, groups = await get(s, h.http_url + "/prometheus/targets")
            assert status == 200
            router = groups[0]
            assert router == {"targets": [h.http_url.removeprefix("http://")], "labels": {
                "role": "router", "model": "tiny", "instance": "router", "__scheme__": "http",
                "__metrics_path__": "/metrics"}}
            # The stubs report http://stub/metrics.
            workers = sorted(groups[1:], key=lambda g: g["labels"]["instance"])
            assert [(g["labels"]["role"], g["labels"]["instance"]) for g in workers] == [
                ("decode", "decode-1"), ("decode", "decode-2"), ("prefill", "prefill-0")]
            assert all(g["targets"] == ["stub"] and g["labels"]["model"] == "tiny"
                       and g["labels"]["__metrics_path__"] == "/metrics" for g in workers)
            # A worker that has not reported its metrics URL yet is left out until it has.
            h.registry.workers[h.address[id(h.decode[1])]].metrics_url = ""
            h.decode[1].load_mode = "hang"
            _, groups = await get(s, h.http_url + "/prometheus/targets")
            assert sorted(g["labels"]["instance"] for g in groups) == ["decode-1", "prefill-0", "router"]

    run_within(scenario())


def test_prometheus_targets_takes_an_admin_key_as_listing_workers_does():
    async def scenario():
        async with await RouterHarness.start(api_key=(CLIENT,), admin_api_key=(ADMIN,)) as h, \
                aiohttp.ClientSession() as s:
            url = h.http_url + "/prometheus/targets"
            assert (await get(s, url))[0] == 401
            assert (await get(s, url, "wrong-key-0123456789"))[0] == 401
            assert (await get(s, url, CLIENT))[0] == 403  # an API key never sees worker addresses
            assert (await get(s, url, ADMIN))[0] == 200
            async with s.get(h.http_url + "/metrics") as r:
                assert r.status == 200  # /metrics stays open: scrapers carry no key
        async with await RouterHarness.start(api_key=(CLIENT,)) as h, aiohttp.ClientSession() as s:
            # No admin key configured: nobody may list the workers, so nobody gets the targets.
            status, payload = await get(s, h.http_url + "/prometheus/targets", CLIENT)
            assert status == 403 and "admin" in payload["error"]["message"]
            assert h.sample("pdspark_router_auth_failures_total", api="http", reason="forbidden") == 1

    run_within(scenario())


def test_a_stream_counts_ttft_once_and_each_later_token_once():
    async def scenario():
        async with await RouterHarness.start(tokens=5) as h, aiohttp.ClientSession() as s:
            h.decode[0].delay_s = 0.02
            async with s.post(h.http_url + "/v1/completions", json={**BODY, "max_tokens": 5, "stream": True}) as r:
                assert r.status == 200
                await r.read()
            assert h.sample("pdspark_router_time_to_first_token_seconds_count") == 1
            assert h.sample("pdspark_router_inter_token_latency_seconds_count") == 4
            mean = h.sample("pdspark_router_inter_token_latency_seconds_sum") / 4
            assert 0.015 < mean < 0.5, mean
            assert h.sample("pdspark_router_requests_total", api="completions", outcome="ok") == 1
            assert h.sample("pdspark_router_completion_tokens_total") == 5

    run_within(scenario())


def test_per_worker_series_live_from_registration_to_removal():
    async def scenario():
        async with await RouterHarness.start(admin_api_key=(ADMIN,)) as h, aiohttp.ClientSession() as s:
            # Workers given at start have their series before any request picked them.
            assert h.sample("pdspark_router_worker_selected_total", worker_role="prefill", worker="prefill-0") == 0
            assert h.sample("pdspark_router_worker_selected_total", worker_role="decode", worker="decode-1") == 0
            headers = {"Authorization": f"Bearer {ADMIN}"}
            async with s.post(h.http_url + "/workers", json={"role": "decode", "address": "127.0.0.1:1"},
                              headers=headers) as r:
                assert r.status == 201 and (await r.json())["name"] == "decode-2"
            assert h.sample("pdspark_router_worker_selected_total", worker_role="decode", worker="decode-2") == 0
            async with s.delete(h.http_url + "/workers", params={"address": "127.0.0.1:1"}, headers=headers) as r:
                assert r.status == 200
            assert h.sample("pdspark_router_worker_selected_total", worker_role="decode", worker="decode-2") is None
            async with s.post(h.http_url + "/v1/completions", json=BODY) as r:
                assert r.status == 200
            assert h.sample("pdspark_router_worker_selected_total", worker_role="decode", worker="decode-1") == 1

    run_within(scenario())


def test_429s_count_by_reason():
    async def scenario():
        async with await RouterHarness.start(max_in_flight=1, max_queued=0, api_key=(CLIENT,),
                                             max_in_flight_per_key=1) as h, aiohttp.ClientSession() as s:
            auth = {"Authorization": f"Bearer {CLIENT}"}
            h.decode[0].mode = HOLD
            async def post() -> int:
                async with s.post(h.http_url + "/v1/completions", json=BODY, headers=auth) as r:
                    return r.status

            held = asyncio.create_task(post())
            await until(lambda: h.decode[0].running == 1, 5, "one request held")
            assert await post() == 429  # the key's one request is in the router
            h.core.key_quota.limit = 5
            assert await post() == 429  # the router's one slot is taken, and it queues none
            h.decode[0].release.set()
            assert await held == 200
            h.decode[0].mode = RequestFailed(ErrorCode.OVERLOADED, "decode queue full")
            assert await post() == 429  # the only decode worker is full
            assert [h.sample("pdspark_router_rejected_requests_total", reason=reason)
                    for reason in ("key_limit", "queue_full", "workers_full")] == [1, 1, 1]
            assert h.sample("pdspark_router_requests_total", api="completions", outcome="overloaded") == 3

    run_within(scenario())


def test_an_invalid_grpc_request_is_counted():
    async def scenario():
        async with await RouterHarness.start() as h:
            async with AsyncClient(h.grpc_address, timeout=scaled(10)) as client:
                with pytest.raises(ClientError):
                    await client.generate(token_ids=[5, 6], max_tokens=2, temperature=1e9)
            assert h.sample("pdspark_router_requests_total", api="grpc", outcome="invalid") == 1

    run_within(scenario())


def test_a_router_replica_lists_itself_by_its_own_name_and_address():
    """Several routers behind one Service: each names itself (`--instance-name`, the pod's name in the chart) and
    lists its own address (`--advertise-host`, the pod's IP), not the Service address the scraper called."""
    async def scenario():
        async with await RouterHarness.start(instance_name="rel-pdspark-router-abc12",
                                             advertise_host="127.0.0.1") as h, aiohttp.ClientSession() as s:
            port = h.http_url.rsplit(":", 1)[1]
            status, groups = await get(s, h.http_url.replace("127.0.0.1", "localhost") + "/prometheus/targets")
            assert status == 200
            assert groups[0]["targets"] == [f"127.0.0.1:{port}"]
            assert groups[0]["labels"]["instance"] == "rel-pdspark-router-abc12"

    run_within(scenario())
