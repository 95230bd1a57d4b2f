"""The decode worker's channels to prefill workers (`PrefillClients`) stay bounded as prefill addresses come and go:
a channel no call used for `idle_s` is closed and forgotten, one with a call on it is kept, and a call to a
forgotten address opens a new one. A plan that never left (the prefill worker unreachable) fails as `NotSent`, one
that reached it and got no answer as `Unanswered`. Against loopback gRPC servers; idleness on a test clock."""

from __future__ import annotations

import asyncio
import socket

import grpc
import pytest

from pdspark.errors import ErrorCode, NotSent, RequestFailed, Unanswered
from pdspark.serving.prefill_client import PrefillClients
from pdspark.testing.time_scale import scaled
from pdspark.testing.waiting import run_within, until
from pdspark.transfer.compat import SCHEMA_VERSION, CompatDescriptor
from pdspark.transfer.plan import BufferDesc, PoolKind, TransferPlan
from pdspark.v1 import worker_pb2, worker_pb2_grpc


class HeldAbort(worker_pb2_grpc.PrefillWorkerServicer):
    """Answers `Abort` at once, or for the request id "hold" once `release` is set."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.holding = 0

    async def Abort(self, request, context):
        if request.request_id == "hold":
            self.holding += 1
            await self.release.wait()
        return worker_pb2.AbortResponse(found=True)


def test_a_channel_unused_for_idle_s_is_closed_and_one_in_use_is_kept():
    async def scenario():
        servers, services, addresses = [], [], []
        for _ in range(3):
            server, service = grpc.aio.server(), HeldAbort()
            worker_pb2_grpc.add_PrefillWorkerServicer_to_server(service, server)
            addresses.append(f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}")
            await server.start()
            servers.append(server)
            services.append(service)
        a, b, c = addresses
        now = [0.0]
        clients = PrefillClients(idle_s=10.0, clock=lambda: now[0])
        try:
            assert await clients.abort(a, "r1")
            channel_a = clients._channels[a].channel
            now[0] = 5.0
            held = asyncio.ensure_future(clients.abort(b, "hold"))  # a call on b that outlives the idle time
            await until(lambda: services[1].holding, 5, "the held call on b")
            now[0] = 20.0  # a unused for 20 s; b's call still on
            assert await clients.abort(c, "r2")
            assert sorted(clients.addresses) == sorted([b, c])
            await until(lambda: channel_a.get_state() == grpc.ChannelConnectivity.SHUTDOWN, 5, "a's channel closed")
            services[1].release.set()
            assert await held  # the call on the kept channel was not cut
            now[0] = 30.0  # b's call ended at 20: b and c both unused for 10 s
            assert await clients.abort(a, "r3")  # a forgotten address: a new channel
            assert clients.addresses == [a]
            # Churn: however many addresses were used, only the recent ones keep a channel.
            for i in range(50):
                now[0] += 11.0
                assert await clients.abort(addresses[i % 3], f"r{i}")
                assert len(clients.addresses) == 1
        finally:
            await clients.close()
            for server in servers:
                await server.stop(None)

    run_within(scenario())


PAGE = 16
COMPAT = CompatDescriptor(SCHEMA_VERSION, "fp", ("sliding_attention",), 4, 16, 8, 4, "float32", "float32", PAGE, 1,
                          8, 16, 32, "", prefix_cache=False)
PLAN = TransferPlan(transfer_id="t", request_id="r", session="peer", compat=COMPAT,
                    buffers=(BufferDesc(PoolKind.C4_KV, 0, 0x1000, 64, 8),), prompt_len=40, full_pages=(5, 6, 7),
                    swa_pages=(), swa_first_page=0, c128_pages=(), req_slot=1, timeout_s=5.0)


class HeldPlan(worker_pb2_grpc.PrefillWorkerServicer):
    """Holds every `SubmitPlan` call (a prefill worker writing) until the test ends it."""

    def __init__(self) -> None:
        self.received = 0

    async def SubmitPlan(self, request, context):
        self.received += 1
        await asyncio.Event().wait()


def _closed_port() -> int:
    """A loopback port nothing listens on: a connection to it is refused."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_plan_for_an_unreachable_prefill_worker_is_never_sent():
    """Nothing listens: the plan cannot have reached a prefill worker, so the failure says so (`NotSent`), and the
    decode worker frees its pages at once instead of quarantining them."""
    async def scenario():
        clients = PrefillClients()
        try:
            with pytest.raises(NotSent) as e:
                await clients.submit_plan(f"127.0.0.1:{_closed_port()}", PLAN, scaled(10))
            return e.value
        finally:
            await clients.close()

    failure = run_within(scenario())
    assert failure.code is ErrorCode.UNAVAILABLE and "not sent" in failure.message


def test_a_plan_that_reached_the_prefill_worker_is_unanswered_when_it_dies_and_the_next_is_never_sent():
    """The plan was received (the prefill worker may be writing) when the worker went away: `Unanswered`, which
    the decode worker quarantines. The next plan for that address finds the connection gone and is never sent."""
    async def scenario():
        server, service = grpc.aio.server(), HeldPlan()
        worker_pb2_grpc.add_PrefillWorkerServicer_to_server(service, server)
        address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
        await server.start()
        clients = PrefillClients()
        try:
            call = asyncio.ensure_future(clients.submit_plan(address, PLAN, scaled(30)))
            await until(lambda: service.received == 1, 10, "the plan at the prefill worker")
            await server.stop(None)  # the prefill worker dies holding the plan
            with pytest.raises(RequestFailed) as sent:
                await call
            with pytest.raises(NotSent) as next_one:
                await clients.submit_plan(address, PLAN, scaled(10))
            return sent.value, next_one.value
        finally:
            await clients.close()

    sent, next_one = run_within(scenario())
    assert isinstance(sent, Unanswered) and not isinstance(sent, NotSent)
    assert next_one.code is ErrorCode.UNAVAILABLE
