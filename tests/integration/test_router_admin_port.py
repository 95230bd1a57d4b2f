"""`--admin-port`: the router's admin routes (`/workers`, `/prometheus/targets`) on a listener of their own, with the
main port's keys and TLS, and gone (404) from the main port; unset, everything stays on the main port. `POST
/workers` takes host:port addresses only (router harness, stub workers)."""

from __future__ import annotations

import dataclasses
import ssl
from typing import Any

import aiohttp
import pytest

from pdspark.router.router_server import start_http
from pdspark.rpc.throwaway_ca import ThrowawayCA
from pdspark.rpc.tls_credentials import PublicCertificate
from pdspark.testing.waiting import run_within
from router_harness import RouterHarness

ADMIN_ROUTES = [("GET", "/workers"), ("POST", "/workers"), ("DELETE", "/workers"), ("GET", "/prometheus/targets")]
CLIENT, ADMIN = "client-key-0123456789", "admin-key-0123456789"


async def call(s: aiohttp.ClientSession, url: str, method: str, path: str, body=None, key: str | None = ADMIN,
               **kw) -> tuple[int, Any]:
    """(status, JSON body or text); with the admin key unless `key` says otherwise."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with s.request(method, url + path, json=body, headers=headers, **kw) as r:
        return r.status, await r.json() if r.content_type == "application/json" else await r.text()


def test_the_admin_routes_answer_on_the_admin_port_only():
    async def scenario():
        async with await RouterHarness.start(admin_port=0, admin_api_key=(ADMIN,)) as h, aiohttp.ClientSession() as s:
            assert h.admin_url != h.http_url
            worker = h.address[id(h.prefill[0])]
            # Not on the main port: every admin route is an unknown one there.
            for method, path in ADMIN_ROUTES:
                status, payload = await call(s, h.http_url, method, path, {"role": "decode", "address": "h:1"})
                assert status == 404 and payload["error"]["code"] == "not_found", (method, path, payload)
            # On the admin port: all of them.
            status, workers = await call(s, h.admin_url, "GET", "/workers")
            assert status == 200 and {w["address"] for w in workers} == set(h.registry.workers)
            status, added = await call(s, h.admin_url, "POST", "/workers", {"role": "decode", "address": "127.0.0.1:5"})
            assert status == 201 and added["address"] == "127.0.0.1:5"
            status, removed = await call(s, h.admin_url, "DELETE", "/workers?address=127.0.0.1:5")
            assert status == 200 and removed["address"] == "127.0.0.1:5"
            status, targets = await call(s, h.admin_url, "GET", "/prometheus/targets")
            assert status == 200
            # The router's own metrics are on the main port still, where its target points.
            router = next(g for g in targets if g["labels"]["role"] == "router")
            assert router["targets"] == [h.http_url.removeprefix("http://")]
            status, text = await call(s, h.http_url, "GET", "/metrics")
            assert status == 200 and "pdspark_router_requests_total" in text
            # The public routes stay on the main port, and only there.
            status, body = await call(s, h.http_url, "POST", "/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 2})
            assert status == 200 and body["usage"]["completion_tokens"] == 4, body  # what a stub streams
            for method, path in [("POST", "/v1/completions"), ("GET", "/health"), ("GET", "/metrics")]:
                status, _ = await call(s, h.admin_url, method, path, {"prompt": [5]})
                assert status == 404, (method, path)
            assert worker in h.registry.workers

    run_within(scenario(), 60)


def test_without_an_admin_port_the_admin_routes_stay_on_the_main_port():
    async def scenario():
        async with await RouterHarness.start(admin_api_key=(ADMIN,)) as h, aiohttp.ClientSession() as s:
            assert h.listeners.admin_port is None and len(h.listeners.runners) == 1
            for method, path in ADMIN_ROUTES:
                body = {"role": "decode", "address": "127.0.0.1:6"} if method == "POST" else None
                path += "?address=127.0.0.1:6" if method == "DELETE" else ""
                status, payload = await call(s, h.http_url, method, path, body)
                assert status in (200, 201), (method, path, payload)

    run_within(scenario(), 60)


def test_the_admin_port_takes_the_same_keys():
    async def scenario():
        async with await RouterHarness.start(admin_port=0, api_key=(CLIENT,), admin_api_key=(ADMIN,)) as h, \
                aiohttp.ClientSession() as s:
            for key, want in ((None, 401), (CLIENT, 403), (ADMIN, 200)):
                status, payload = await call(s, h.admin_url, "GET", "/workers", key=key)
                assert status == want, (key, payload)
            # On the main port an admin route is unknown, whoever asks.
            for key in (None, CLIENT, ADMIN):
                for method, path in ADMIN_ROUTES:
                    status, _ = await call(s, h.http_url, method, path, key=key)
                    assert status == 404, (key, method, path)

    run_within(scenario(), 60)


def test_the_admin_port_speaks_the_main_ports_tls(tmp_path):
    ca = ThrowawayCA(tmp_path)
    cert = ca.issue("router", "router", ("127.0.0.1",))
    client_tls = ssl.create_default_context(cafile=ca.ca_path)

    async def scenario():
        async with await RouterHarness.start(admin_api_key=(ADMIN,)) as h, aiohttp.ClientSession() as s:
            cfg = dataclasses.replace(h.core.options, port=0, admin_port=0)
            listeners = await start_http(h.core, cfg, PublicCertificate(cert.cert, cert.key).context)
            try:
                admin, main = f"https://127.0.0.1:{listeners.admin_port}", f"https://127.0.0.1:{listeners.port}"
                status, workers = await call(s, admin, "GET", "/workers", ssl=client_tls)
                assert status == 200 and workers
                status, _ = await call(s, main, "GET", "/health", ssl=client_tls)
                assert status == 200
                with pytest.raises(aiohttp.ClientError):  # no plain text there
                    await call(s, admin.replace("https", "http"), "GET", "/workers")
            finally:
                await listeners.cleanup()

    run_within(scenario(), 60)


@pytest.mark.parametrize("address, status", [
    ("nohost", 400), ("h:0", 400), ("h:99999", 400), ("h:x", 400), ("::1:5", 400),
    ("127.0.0.1:5", 201), ("[::1]:5", 201), ("worker-0.svc:50051", 201),
])
def test_a_worker_is_added_by_host_and_port_only(address, status):
    async def scenario():
        async with await RouterHarness.start(admin_port=0, admin_api_key=(ADMIN,), health_timeout_s=0.2) as h, \
                aiohttp.ClientSession() as s:
            got, payload = await call(s, h.admin_url, "POST", "/workers", {"role": "decode", "address": address})
            assert got == status, payload
            if status == 400:
                err = payload["error"]
                assert (err["param"], err["code"]) == ("address", "invalid_address"), err
                assert "host:port" in err["message"] and repr(address) in err["message"], err
                assert address not in h.registry.workers
            else:
                assert payload["address"] == address and address in h.registry.workers

    run_within(scenario(), 60)


def test_adding_a_registered_address_again_is_a_conflict_on_the_address_and_a_bad_role_names_the_role():
    async def scenario():
        async with await RouterHarness.start(admin_port=0, admin_api_key=(ADMIN,), health_timeout_s=0.2) as h, \
                aiohttp.ClientSession() as s:
            taken = next(iter(h.registry.workers))
            got, payload = await call(s, h.admin_url, "POST", "/workers", {"role": "decode", "address": taken})
            assert got == 409 and (payload["error"]["param"], payload["error"]["code"]) == ("address", "already_exists")
            got, payload = await call(s, h.admin_url, "POST", "/workers", {"role": "encode", "address": "h:5"})
            assert got == 400 and payload["error"]["param"] == "role", payload
            assert "prefill, decode" in payload["error"]["message"] and "h:5" not in h.registry.workers

    run_within(scenario(), 60)
