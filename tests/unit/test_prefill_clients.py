"""The decode worker's channels to prefill workers (`PrefillClients`) stay bounded as prefill addresses come and go:
a channel no call used for `idle_s` is closed and forgotten, one with a call on it is kept, and a call to a
forgotten address opens a new one. Against loopback gRPC servers; idleness on a test clock."""

from __future__ import annotations

import asyncio

import grpc

from pdspark.serving.prefill_client import PrefillClients
from pdspark.testing.waiting import run_within, until
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
