"""API keys through the router's real HTTP and gRPC front ends, on stub workers (`RouterHarness`): generation
needs an API key, `/workers` an admin key, worker addresses reach admins only, each key has its own in-flight
limit, keys never show in a log line or in /metrics, and the gRPC API holds requests to HTTP's bounds."""

from __future__ import annotations

import asyncio
import contextlib
import logging

import aiohttp
import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdspark.client import AsyncClient, ClientError
from pdspark.errors import ErrorCode, RequestFailed
from pdspark.router.router_server import reload_keys
from pdspark.testing.time_scale import scaled
from pdspark.testing.waiting import run_within, until
from pdspark.testing.worker_stubs import HOLD
from pdspark.v1 import common_pb2, router_pb2, router_pb2_grpc
from router_harness import RouterHarness

CLIENT, CLIENT2, ADMIN = "client-key-0123456789", "client-key-abcdefghij", "admin-key-0123456789"
WRONG = "wrong-key-0123456789"
KEYS = dict(api_key=(CLIENT, CLIENT2), admin_api_key=(ADMIN,))
BODY = {"prompt": [5, 6, 7], "max_tokens": 4}
GENERATION = [("POST", "/v1/completions", BODY),
              ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
              ("GET", "/v1/models", None),
              ("POST", "/generate", {"input_ids": [5, 6, 7]})]


def auth(key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"} if key else {}


async def call(s: aiohttp.ClientSession, h: RouterHarness, method: str, path: str, body=None,
               key: str | None = None) -> tuple[int, dict, dict | str]:
    async with s.request(method, h.http_url + path, json=body, headers=auth(key)) as r:
        payload = await r.json() if r.content_type == "application/json" else await r.text()
        return r.status, dict(r.headers), payload


def assert_error(status: int, payload, want_status: int, code: str, openai_type: str) -> str:
    assert status == want_status, payload
    err = payload["error"]
    assert (err["code"], err["type"]) == (code, openai_type) and set(err) == {"message", "type", "param", "code"}
    return err["message"]


def test_generation_needs_an_api_key_and_probes_do_not():
    async def scenario():
        async with await RouterHarness.start(**KEYS) as h, aiohttp.ClientSession() as s:
            for method, path, body in GENERATION:
                for key in (None, WRONG, "", "Basic " + CLIENT):
                    status, headers, payload = await call(s, h, method, path, body, key)
                    assert_error(status, payload, 401, "unauthenticated", "authentication_error")
                    assert headers["WWW-Authenticate"] == "Bearer"
                for key in (CLIENT, CLIENT2, ADMIN):  # an admin key may generate too
                    status, _, payload = await call(s, h, method, path, body, key)
                    assert status == 200, (path, payload)
            # Before its body is read, and before it is found missing: a caller without a key learns nothing.
            status, _, payload = await call(s, h, "POST", "/v1/completions", {"prompt": 12})
            assert status == 401
            status, _, payload = await call(s, h, "POST", "/v1/nothing", {})
            assert status == 401
            assert (await call(s, h, "POST", "/v1/nothing", {}, CLIENT))[0] == 404
            for path in ("/health", "/metrics", "/openapi.json"):
                assert (await call(s, h, "GET", path))[0] == 200, path
            doc = (await call(s, h, "GET", "/openapi.json"))[2]
            assert doc["paths"]["/v1/completions"]["post"]["security"] == [{"apiKey": []}]

    run_within(scenario())


def test_only_an_admin_key_lists_registers_and_removes_workers():
    async def scenario():
        async with await RouterHarness.start(**KEYS) as h, aiohttp.ClientSession() as s:
            new = {"role": "decode", "address": "127.0.0.1:1"}
            for method, body in (("GET", None), ("POST", new), ("DELETE", None)):
                path = "/workers" if method != "DELETE" else "/workers?address=127.0.0.1:1"
                status, _, payload = await call(s, h, method, path, body)
                assert_error(status, payload, 401, "unauthenticated", "authentication_error")
                status, _, payload = await call(s, h, method, path, body, CLIENT)
                assert "admin key" in assert_error(status, payload, 403, "permission_denied", "permission_error")
            assert "127.0.0.1:1" not in h.registry.workers
            status, _, listed = await call(s, h, "GET", "/workers", key=ADMIN)
            assert status == 200 and [w["name"] for w in listed] == ["prefill-0", "decode-1"]
            assert [w["address"] for w in listed] == list(h.registry.workers)
            status, _, added = await call(s, h, "POST", "/workers", new, ADMIN)
            assert status == 201 and added["name"] == "decode-2" and "127.0.0.1:1" in h.registry.workers
            status, _, payload = await call(s, h, "DELETE", "/workers?address=127.0.0.1:1", key=ADMIN)
            assert status == 200 and "127.0.0.1:1" not in h.registry.workers
            # An admin's mistakes are OpenAI error objects too.
            async with s.post(h.http_url + "/workers", data=b"{",
                              headers={**auth(ADMIN), "Content-Type": "application/json"}) as r:
                assert r.status == 400 and (await r.json())["error"]["code"] == "invalid_json"
            status, _, payload = await call(s, h, "DELETE", "/workers?address=nowhere:1", key=ADMIN)
            assert status == 404 and payload["error"]["param"] == "address"

    run_within(scenario())


@pytest.mark.parametrize("options, listable", [
    ({}, True),  # a development router: no key at all, on loopback
    ({"host": "0.0.0.0"}, False),  # reachable from elsewhere
    ({"api_key": (CLIENT,)}, False),  # keys, but no admin key
])
def test_without_an_admin_key_worker_administration_is_off(options, listable):
    async def scenario():
        async with await RouterHarness.start(**options) as h, aiohttp.ClientSession() as s:
            key = CLIENT if "api_key" in options else None
            status, _, payload = await call(s, h, "POST", "/workers", {"role": "decode", "address": "127.0.0.1:1"},
                                            key)
            message = assert_error(status, payload, 403, "permission_denied", "permission_error")
            assert "is off" in message and "--admin-api-key" in message
            status, _, payload = await call(s, h, "GET", "/workers", key=key)
            assert status == (200 if listable else 403)
            status, _, payload = await call(s, h, "POST", "/generate", {"input_ids": [5]}, key)
            assert status == 200 and bool(payload["meta_info"]["decode_worker"]) == listable

    run_within(scenario())


def test_worker_addresses_reach_admins_only():
    async def scenario():
        async with await RouterHarness.start(**KEYS) as h, aiohttp.ClientSession() as s, \
                AsyncClient(h.grpc_address, timeout=scaled(30), api_key=CLIENT) as client, \
                AsyncClient(h.grpc_address, timeout=scaled(30), api_key=ADMIN) as admin:
            prefill, decode = h.address[id(h.prefill[0])], h.address[id(h.decode[0])]
            _, _, hidden = await call(s, h, "POST", "/generate", {"input_ids": [5]}, CLIENT)
            _, _, shown = await call(s, h, "POST", "/generate", {"input_ids": [5]}, ADMIN)
            assert (hidden["meta_info"]["prefill_worker"], hidden["meta_info"]["decode_worker"]) == ("", "")
            assert (shown["meta_info"]["prefill_worker"], shown["meta_info"]["decode_worker"]) == (prefill, decode)
            async with s.post(h.http_url + "/generate", json={"input_ids": [5], "stream": True},
                              headers=auth(CLIENT)) as r:
                streamed = await r.text()
            assert decode not in streamed and prefill not in streamed and '"decode_worker": ""' in streamed
            stub = router_pb2_grpc.RouterStub(client._channel)
            for key, want in ((CLIENT, ""), (ADMIN, decode)):
                request = router_pb2.RouterGenerateRequest(token_ids=router_pb2.TokenIds(ids=[5]))
                chunks = [c async for c in stub.Generate(request, metadata=(("authorization", f"Bearer {key}"),))]
                assert {c.decode_worker for c in chunks} == {want}
            # A failure's message names the worker by its name for a client, by its address for an admin.
            h.decode[0].mode = RequestFailed(ErrorCode.CAPACITY, "no room beside 10.1.2.3:7000")
            _, _, failed = await call(s, h, "POST", "/v1/completions", BODY, CLIENT)
            message = failed["error"]["message"]
            assert "decode-1" in message and "<address>" in message and decode not in message and "10.1" not in message
            with pytest.raises(ClientError) as e:
                await client.generate(token_ids=[5], max_tokens=2)
            assert "decode-1" in e.value.message and decode not in e.value.message
            with pytest.raises(ClientError) as e:
                await admin.generate(token_ids=[5], max_tokens=2)
            assert decode in e.value.message
            # /metrics, which anyone may read, names workers, never their addresses.
            _, _, metrics = await call(s, h, "GET", "/metrics")
            assert 'worker="decode-1"' in metrics and decode not in metrics and prefill not in metrics

    run_within(scenario())


def test_each_api_key_has_its_own_in_flight_limit():
    async def scenario():
        async with await RouterHarness.start(max_in_flight_per_key=2, **KEYS) as h, aiohttp.ClientSession() as s, \
                AsyncClient(h.grpc_address, timeout=scaled(30), api_key=CLIENT) as grpc_client:
            h.decode[0].mode = HOLD
            held = [asyncio.create_task(call(s, h, "POST", "/v1/completions", BODY, CLIENT)) for _ in range(2)]
            await until(lambda: h.decode[0].running == 2, 5, "two requests of one key at the decode worker")
            status, headers, payload = await call(s, h, "POST", "/v1/completions", BODY, CLIENT)
            message = assert_error(status, payload, 429, "overloaded", "rate_limit_error")
            assert headers["Retry-After"] == "1" and "max_in_flight_per_key 2" in message
            with pytest.raises(ClientError) as e:
                await grpc_client.generate(token_ids=[5], max_tokens=2)
            assert e.value.code == "RESOURCE_EXHAUSTED" and e.value.retry_after_s == 1
            other = asyncio.create_task(call(s, h, "POST", "/v1/completions", BODY, CLIENT2))  # another key: served
            await until(lambda: h.decode[0].running == 3, 5, "the other key's request at the decode worker")
            h.decode[0].release.set()
            assert [(await t)[0] for t in (*held, other)] == [200, 200, 200]
            assert (await call(s, h, "POST", "/v1/completions", BODY, CLIENT))[0] == 200  # its slots came back
            assert h.core.key_quota._held == {}

    run_within(scenario())


def test_the_grpc_api_needs_a_key_and_health_does_not(monkeypatch):
    async def scenario():
        async with await RouterHarness.start(**KEYS) as h:
            for key in ("", WRONG):
                async with AsyncClient(h.grpc_address, timeout=scaled(30), api_key=key) as c:
                    with pytest.raises(ClientError) as e:
                        await c.generate(token_ids=[5], max_tokens=2)
                    assert (e.value.code, e.value.error_code) == ("UNAUTHENTICATED", ErrorCode.UNAUTHENTICATED)
                    assert not e.value.error_code.retryable and WRONG not in e.value.message
                    assert not await c.abort("x")
            for key in (CLIENT, ADMIN):
                async with AsyncClient(h.grpc_address, timeout=scaled(30), api_key=key) as c:
                    assert (await c.generate(token_ids=[5], max_tokens=2)).completion_tokens == 4
            monkeypatch.setenv("PDSPARK_API_KEY", f"{CLIENT2},{CLIENT}")  # the router's list: the first key is used
            async with AsyncClient(h.grpc_address, timeout=scaled(30)) as c:
                assert (await c.generate(token_ids=[5], max_tokens=2)).completion_tokens == 4
            async with grpc.aio.insecure_channel(h.grpc_address) as channel:
                stub = router_pb2_grpc.RouterStub(channel)
                with pytest.raises(grpc.aio.AioRpcError) as raw:
                    await stub.Abort(router_pb2.RouterAbortRequest(request_id="x"))
                assert raw.value.code() == grpc.StatusCode.UNAUTHENTICATED
                health = health_pb2_grpc.HealthStub(channel)
                reply = await health.Check(health_pb2.HealthCheckRequest())
                assert reply.status == health_pb2.HealthCheckResponse.SERVING

    run_within(scenario())


@pytest.mark.parametrize("sampling, field", [
    (common_pb2.SamplingParams(stop=["a"] * 17), "stop"),
    (common_pb2.SamplingParams(stop=["a" * 1025]), "stop"),
    (common_pb2.SamplingParams(stop_token_ids=list(range(65))), "stop_token_ids"),
    (common_pb2.SamplingParams(stop_token_ids=[10**6]), "stop_token_ids"),
    (common_pb2.SamplingParams(seed=-1), "seed"),
    (common_pb2.SamplingParams(temperature=float("inf")), "temperature"),
    (common_pb2.SamplingParams(top_k=2**31 - 1, max_tokens=10**9), "max_tokens"),
    (common_pb2.SamplingParams(logprobs=21), "logprobs"),
    (common_pb2.SamplingParams(presence_penalty=2.5), "presence_penalty"),
    (common_pb2.SamplingParams(min_tokens=20, max_tokens=4), "min_tokens"),
    (common_pb2.SamplingParams(logit_bias={10**6: 1.0}), "logit_bias"),
    (common_pb2.SamplingParams(banned_token_ids=[10**6]), "banned_token_ids"),
])
def test_the_grpc_api_holds_requests_to_https_bounds(sampling, field):
    async def scenario():
        async with await RouterHarness.start(max_body_bytes=64 << 10) as h, \
                grpc.aio.insecure_channel(h.grpc_address) as channel:
            stub = router_pb2_grpc.RouterStub(channel)
            request = router_pb2.RouterGenerateRequest(token_ids=router_pb2.TokenIds(ids=[5]), sampling=sampling)
            with pytest.raises(grpc.aio.AioRpcError) as e:
                [c async for c in stub.Generate(request)]
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and field in e.value.details()
            # A message over the size limit is refused by gRPC before it is parsed.
            big = router_pb2.RouterGenerateRequest(text="x" * (65 << 10))
            with pytest.raises(grpc.aio.AioRpcError) as e:
                [c async for c in stub.Generate(big)]
            assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert not h.decode[0].calls

    run_within(scenario())


def test_no_key_reaches_a_log_line_or_metrics(caplog, tmp_path):
    async def scenario():
        key_file = tmp_path / "keys"
        key_file.write_text(CLIENT + "\n")
        key_file.chmod(0o600)
        async with await RouterHarness.start(api_key_file=str(key_file), admin_api_key=(ADMIN,)) as h, \
                aiohttp.ClientSession() as s:
            for key in (CLIENT, ADMIN, WRONG, None):
                await call(s, h, "POST", "/v1/completions", BODY, key)
                await call(s, h, "POST", "/workers", {"role": "decode", "address": "127.0.0.1:9"}, key)
                async with AsyncClient(h.grpc_address, timeout=scaled(30), api_key=key or "") as c:
                    with contextlib.suppress(ClientError):
                        await c.generate(token_ids=[5], max_tokens=2)
            # Rotation: a new key in the file, the old one out; a file left unreadable keeps the keys in use.
            key_file.write_text(CLIENT2 + "\n")
            reload_keys(h.core)
            assert (await call(s, h, "POST", "/v1/completions", BODY, CLIENT))[0] == 401
            assert (await call(s, h, "POST", "/v1/completions", BODY, CLIENT2))[0] == 200
            key_file.unlink()
            reload_keys(h.core)
            assert (await call(s, h, "POST", "/v1/completions", BODY, CLIENT2))[0] == 200
            _, _, metrics = await call(s, h, "GET", "/metrics")
            assert 'pdspark_router_auth_failures_total{api="http",reason="invalid_key"} 3.0' in metrics
            assert 'pdspark_router_auth_failures_total{api="grpc",reason="missing_key"} 1.0' in metrics
            return metrics

    with caplog.at_level(logging.DEBUG):
        metrics = run_within(scenario())
    assert "keys not reloaded" in caplog.text
    logged = caplog.text + "".join(str(r.args) for r in caplog.records)
    for key in (CLIENT, CLIENT2, ADMIN, WRONG):
        assert key not in logged and key not in metrics
