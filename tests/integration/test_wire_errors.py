"""A failure raised inside a worker reaches the router, its HTTP API and the SDK with the same typed code, carried
as data (the `ErrorDetail` trailer), and the router retries and avoids workers by that code.

Real gRPC servicers, dispatcher, router APIs and SDK in one process; the workers behind the servicers are fakes
that fail (or answer) on cue, so no model runs. The router reaches the servicers one gRPC call each and multiplexed
on one stream per worker (`worker_calls`): the failures read the same.
"""

from __future__ import annotations

import asyncio
import json
import threading
import urllib.error
import urllib.request

import grpc
import pytest
from aiohttp import web

from pdspark.assets import resolve_model
from pdspark.client import Client, ClientError
from pdspark.errors import CapacityError, ErrorCode, RequestFailed
from pdspark.model.model_config import ModelConfig
from pdspark.router.dispatcher import Dispatcher
from pdspark.router.grpc_api import RouterServicer
from pdspark.router.http_api import build_app
from pdspark.router.router_core import RouterCore
from pdspark.router.router_metrics import RouterMetrics
from pdspark.router.workers.worker_registry import WorkerRegistry
from pdspark.serving.grpc_services import DecodeServicer, PrefillServicer
from pdspark.serving.reservation_queue import no_room
from pdspark.testing.time_scale import scaled
from pdspark.transfer.plan import TransferResult, TransferStats
from pdspark.types import FinishReason, RequestOutput
from pdspark.v1 import router_pb2_grpc, worker_pb2_grpc
from router_harness import LowestAddress

UNREACHABLE = "127.0.0.1:1"  # sorts before every real 127.0.0.1 port: `LowestAddress` tries it first
# A message that starts like another code's name: the code must come from the trailer, not from this text.
MISLEADING = "DEADLINE: this text is not the code"


class FakePrefillWorker:
    in_flight = 0
    engine = None  # GetLoad is not called here

    async def prefill(self, request_id, transfer_id, prompt_ids, params, deadline, trace=None, num_generated=0):
        return TransferResult(transfer_id, first_token=7, num_cached_tokens=0, checksum=0, stats=TransferStats())

    def abort(self, request_id):
        return False


class FakeDecodeWorker:
    """Fails each `generate` with `failure` (when the prefill worker is one of `fail_with`, if given), else
    generates one token and finishes."""

    transfers_in_flight = 0

    def __init__(self):
        self.failure: Exception | None = None
        self.fail_with: set[str] | None = None
        self.calls: list[str] = []  # prefill address of each generate

    async def generate(self, request_id, transfer_id, prompt_ids, params, prefill_address, deadline, generated=()):
        self.calls.append(prefill_address)
        if self.failure is not None and (self.fail_with is None or prefill_address in self.fail_with):
            raise self.failure
        yield RequestOutput(request_id, None, prompt_ids, token_ids=[7], finished=True,
                            finish_reason=FinishReason.LENGTH)

    def abort(self, request_id):
        return False

    def stable_text_of(self, token_ids, stop_strings=()):
        return ""


class AioServers:
    """The workers' grpc.aio servers (as in a worker process), on an asyncio loop of their own thread."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.servers: list = []

    def serve(self, servicer, add) -> str:
        async def start() -> int:
            server = grpc.aio.server()
            add(servicer, server)
            port = server.add_insecure_port("127.0.0.1:0")
            await server.start()
            self.servers.append(server)
            return port

        return f"127.0.0.1:{asyncio.run_coroutine_threadsafe(start(), self.loop).result(scaled(30))}"

    def close(self) -> None:
        async def stop() -> None:
            for server in self.servers:
                await server.stop(None)

        asyncio.run_coroutine_threadsafe(stop(), self.loop).result(scaled(30))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(scaled(10))


class InProcessRouter:
    """The router's gRPC and HTTP front ends over a real dispatcher, on an asyncio loop of their own thread."""

    def __init__(self, prefill: list[str], decode: list[str], worker_calls: str = "per-request"):
        path = resolve_model("dsv4-tiny")
        # No health polling: every registered worker counts as healthy.
        self.registry = WorkerRegistry(multiplexed=worker_calls == "multiplexed")
        for role, addresses in (("prefill", prefill), ("decode", decode)):
            for address in addresses:
                self.registry.add(role, address)
        metrics = RouterMetrics()
        dispatcher = Dispatcher(self.registry, LowestAddress(), LowestAddress(), transfer_timeout_s=5,
                                max_attempts=3, metrics=metrics)
        max_len = min(4096, ModelConfig.from_dir(path).max_position_embeddings)
        self.core = RouterCore(path, "tiny", max_len, self.registry, dispatcher, metrics)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.grpc_address, self.http_url = self._run(self._start())

    def _run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(scaled(30))

    async def _start(self) -> tuple[str, str]:
        self.server = grpc.aio.server()
        router_pb2_grpc.add_RouterServicer_to_server(RouterServicer(self.core), self.server)
        port = self.server.add_insecure_port("127.0.0.1:0")
        await self.server.start()
        self.runner = web.AppRunner(build_app(self.core))
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        http_port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        return f"127.0.0.1:{port}", f"http://127.0.0.1:{http_port}"

    async def _stop(self) -> None:
        await self.server.stop(1)
        await self.runner.cleanup()
        for w in self.registry.workers.values():
            if w.channel is not None:
                await w.channel.close()

    def close(self) -> None:
        self._run(self._stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(scaled(10))

    def post_completion(self) -> tuple[int, dict]:
        body = json.dumps({"prompt": [5, 6, 7], "max_tokens": 4}).encode()
        req = urllib.request.Request(self.http_url + "/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=scaled(30)) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())


@pytest.fixture(scope="module")
def workers():
    decode = FakeDecodeWorker()
    servers = AioServers()
    addresses = {}
    for name, servicer, add in (
        ("p1", PrefillServicer(FakePrefillWorker()), worker_pb2_grpc.add_PrefillWorkerServicer_to_server),
        ("p2", PrefillServicer(FakePrefillWorker()), worker_pb2_grpc.add_PrefillWorkerServicer_to_server),
        ("d", DecodeServicer(decode), worker_pb2_grpc.add_DecodeWorkerServicer_to_server),
    ):
        addresses[name] = servers.serve(servicer, add)
    yield decode, addresses
    servers.close()


@pytest.fixture
def decode(workers):
    fake, _ = workers
    fake.failure, fake.fail_with, fake.calls = None, None, []
    return fake


@pytest.fixture(scope="module")
def router(workers, worker_calls):
    _, addr = workers
    r = InProcessRouter([addr["p1"]], [addr["d"]], worker_calls)
    yield r
    r.close()


@pytest.mark.parametrize("code", list(ErrorCode))
def test_a_worker_failure_reaches_the_sdk_and_http_with_its_code(router, decode, code):
    decode.failure = RequestFailed(code, MISLEADING)
    with Client(router.grpc_address, timeout=scaled(30)) as client, pytest.raises(ClientError) as e:
        client.generate(token_ids=[5, 6, 7], max_tokens=4)
    assert e.value.error_code is code
    assert e.value.code == code.grpc_status
    assert MISLEADING in e.value.message
    # The router retried exactly the retryable codes, on as many pairs as it may try; a full worker is not tried
    # again, and here it is the only decode worker.
    assert len(decode.calls) == (3 if code.retryable and code is not ErrorCode.OVERLOADED else 1)

    status, body = router.post_completion()
    assert status == code.http_status
    assert body["error"]["code"] == code.value and body["error"]["type"] == code.openai_type
    assert MISLEADING in body["error"]["message"]


def test_an_engine_error_in_a_worker_keeps_its_meaning(router, decode):
    decode.failure = CapacityError("request needs 9 pages of 16 tokens; the pool has 4 in all")
    with Client(router.grpc_address, timeout=scaled(30)) as client, pytest.raises(ClientError) as e:
        client.generate(token_ids=[5, 6, 7], max_tokens=4)
    assert e.value.error_code is ErrorCode.CAPACITY and "pages" in e.value.message
    assert len(decode.calls) == 1  # a request that can never fit is not retried


def test_the_finish_reason_reaches_the_sdk_and_http(router, decode):
    with Client(router.grpc_address, timeout=scaled(30)) as client:
        result = client.generate(token_ids=[5, 6, 7], max_tokens=4)
    assert result.finish_reason is FinishReason.LENGTH and result.token_ids == [7]
    status, body = router.post_completion()
    assert status == 200 and body["choices"][0]["finish_reason"] == "length"


def test_a_reported_failure_retries_on_another_prefill_worker(workers, decode, worker_calls):
    _, addr = workers
    first, second = sorted([addr["p1"], addr["p2"]])
    decode.failure, decode.fail_with = RequestFailed(ErrorCode.TRANSFER, "the prefill side failed to write"), {first}
    r = InProcessRouter([first, second], [addr["d"]], worker_calls)
    try:
        with Client(r.grpc_address, timeout=scaled(30)) as client:
            result = client.generate(token_ids=[5, 6, 7], max_tokens=4)
    finally:
        r.close()
    assert result.finish_reason is FinishReason.LENGTH
    assert decode.calls == [first, second]  # the decode worker reported it: the prefill worker was avoided


def test_an_unreachable_decode_worker_is_avoided_on_retry(workers, decode, worker_calls):
    _, addr = workers
    r = InProcessRouter([addr["p1"]], [UNREACHABLE, addr["d"]], worker_calls)
    try:
        with Client(r.grpc_address, timeout=scaled(30)) as client:
            result = client.generate(token_ids=[5, 6, 7], max_tokens=4)
    finally:
        r.close()
    # The first pick failed in the transport (no ErrorDetail): the decode worker itself was avoided.
    assert result.finish_reason is FinishReason.LENGTH and decode.calls == [addr["p1"]]


def test_a_decode_worker_without_room_for_the_cache_is_avoided_on_retry(workers, decode, worker_calls):
    """A decode worker that found no room for the prompt's cache before the deadline reports its own shortage
    (`reservation_queue.no_room`): the retry goes to another decode worker, not back to the full one (the failure
    used to read as the transfer's, so only the prefill worker was avoided)."""
    _, addr = workers
    other = FakeDecodeWorker()
    servers = AioServers()
    try:
        spare_address = servers.serve(DecodeServicer(other), worker_pb2_grpc.add_DecodeWorkerServicer_to_server)
        fakes = {addr["d"]: decode, spare_address: other}
        full, spare = sorted(fakes)  # `LowestAddress` picks the full one first
        fakes[full].failure = no_room()
        r = InProcessRouter([addr["p1"]], [full, spare], worker_calls)
        try:
            with Client(r.grpc_address, timeout=scaled(30)) as client:
                result = client.generate(token_ids=[5, 6, 7], max_tokens=4)
        finally:
            r.close()
    finally:
        servers.close()
    assert result.finish_reason is FinishReason.LENGTH
    assert fakes[full].calls == [addr["p1"]] and fakes[spare].calls == [addr["p1"]]
