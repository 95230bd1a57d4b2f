"""Capacity a decode worker cannot use counts as load at the router: its quarantined request slots (transfers whose
prefill worker never answered, held until no write can land) and the requests in its reservation queue come in its
load report (`GetLoad`), count in `WorkerInfo.load`, show in `/workers`, and steer the picking policies away from a
worker whose free slots are all quarantined. Against loopback gRPC servers that answer `GetLoad` only."""

from __future__ import annotations

import grpc

from pdspark.router.workers.policies import CacheAware, PowerOfTwo
from pdspark.router.workers.worker_registry import WorkerRegistry
from pdspark.testing.waiting import run_within
from pdspark.v1 import worker_pb2, worker_pb2_grpc

QUARANTINED = worker_pb2.LoadReport(running=0, waiting=0, quarantined_slots=4,
                                    quarantined_pages={"full": 12, "swa": 4, "c128": 6, "req_slots": 4})
QUEUED = worker_pb2.LoadReport(running=1, waiting=0, queued=3)
BUSY = worker_pb2.LoadReport(running=2, waiting=0)


class Reports(worker_pb2_grpc.DecodeWorkerServicer):
    def __init__(self, report: worker_pb2.LoadReport) -> None:
        self.report = report

    async def GetLoad(self, request, context):
        return self.report


async def _polled(*reports: worker_pb2.LoadReport) -> tuple[WorkerRegistry, list, list[grpc.aio.Server]]:
    registry, workers, servers = WorkerRegistry(), [], []
    for report in reports:
        server = grpc.aio.server()
        worker_pb2_grpc.add_DecodeWorkerServicer_to_server(Reports(report), server)
        address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
        await server.start()
        servers.append(server)
        w = registry.add("decode", address)
        assert await registry.poll_load(w)
        workers.append(w)
    return registry, workers, servers


async def _closed(registry: WorkerRegistry, servers: list[grpc.aio.Server]) -> None:
    for w in registry.workers.values():
        if w.channel is not None:
            await w.channel.close()
    for server in servers:
        await server.stop(None)


def test_quarantined_slots_and_queued_reservations_count_as_load_and_show_in_the_listing():
    async def scenario():
        registry, (quarantined, queued, busy), servers = await _polled(QUARANTINED, QUEUED, BUSY)
        await _closed(registry, servers)
        return quarantined, queued, busy

    quarantined, queued, busy = run_within(scenario())
    assert (quarantined.load, queued.load, busy.load) == (4, 4, 2)
    listed = quarantined.to_json()
    assert listed["load"] == 4 and listed["quarantined_slots"] == 4 and listed["queued"] == 0
    assert listed["quarantined_pages"] == {"full": 12, "swa": 4, "c128": 6, "req_slots": 4}
    assert queued.to_json()["queued"] == 3 and queued.to_json()["quarantined_slots"] == 0


def test_a_worker_whose_free_slots_are_all_quarantined_is_not_picked_over_one_with_room():
    async def scenario():
        registry, workers, servers = await _polled(QUARANTINED, BUSY)
        await _closed(registry, servers)
        return workers

    quarantined, busy = run_within(scenario())
    policy = PowerOfTwo(seed=7)
    assert {policy.select([quarantined, busy], [5, 6, 7]).address for _ in range(20)} == {busy.address}
    assert CacheAware().select([quarantined, busy], [5, 6, 7]).address == busy.address

