"""`WorkerRegistry`: the prefill and decode workers the router knows, their health and load.

Workers come from flags or are added/removed at run time. A background task checks each one every `interval_s`:
gRPC health checking plus `GetLoad` (which also reports the worker's metrics URL). A worker that fails
`max_failures` checks in a row is marked unhealthy and skipped by the policies until a check succeeds again.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdspark.v1 import worker_pb2, worker_pb2_grpc

logger = logging.getLogger(__name__)
ROLES = ("prefill", "decode")


@dataclass
class WorkerInfo:
    role: str
    address: str
    metrics_url: str = ""
    healthy: bool = True
    reported_load: int = 0  # running + waiting requests, from the worker's last GetLoad
    in_flight: int = 0  # requests this router has on the worker right now
    failures: int = 0
    last_check: float = 0.0
    channel: grpc.aio.Channel | None = field(default=None, repr=False)

    @property
    def load(self) -> int:
        return max(self.reported_load, self.in_flight)

    def to_json(self) -> dict:
        return {"role": self.role, "address": self.address, "healthy": self.healthy, "load": self.load,
                "in_flight": self.in_flight, "metrics_url": self.metrics_url}


class WorkerRegistry:
    def __init__(self, interval_s: float = 2.0, max_failures: int = 2, check_timeout_s: float = 2.0):
        self.interval_s = interval_s
        self.max_failures = max_failures
        self.check_timeout_s = check_timeout_s
        self.workers: dict[str, WorkerInfo] = {}

    def add(self, role: str, address: str, metrics_url: str = "") -> WorkerInfo:
        if role not in ROLES:
            raise ValueError(f"unsupported worker role {role!r}; allowed: {', '.join(ROLES)}")
        if address in self.workers:
            raise ValueError(f"worker {address} is already registered")
        w = WorkerInfo(role, address, metrics_url)
        self.workers[address] = w
        return w

    def remove(self, address: str) -> WorkerInfo:
        w = self.workers.pop(address)
        if w.channel is not None:
            asyncio.ensure_future(w.channel.close())
        return w

    def healthy(self, role: str) -> list[WorkerInfo]:
        return [w for w in self.workers.values() if w.role == role and w.healthy]

    def channel(self, w: WorkerInfo) -> grpc.aio.Channel:
        if w.channel is None:
            w.channel = grpc.aio.insecure_channel(w.address)
        return w.channel

    def prefill_stub(self, w: WorkerInfo) -> worker_pb2_grpc.PrefillWorkerStub:
        return worker_pb2_grpc.PrefillWorkerStub(self.channel(w))

    def decode_stub(self, w: WorkerInfo) -> worker_pb2_grpc.DecodeWorkerStub:
        return worker_pb2_grpc.DecodeWorkerStub(self.channel(w))

    async def check(self, w: WorkerInfo) -> bool:
        try:
            health = health_pb2_grpc.HealthStub(self.channel(w))
            reply = await health.Check(health_pb2.HealthCheckRequest(service=""), timeout=self.check_timeout_s)
            stub = self.prefill_stub(w) if w.role == "prefill" else self.decode_stub(w)
            load = await stub.GetLoad(worker_pb2.LoadRequest(), timeout=self.check_timeout_s)
            ok = reply.status == health_pb2.HealthCheckResponse.SERVING
            w.reported_load = load.running + load.waiting
            w.metrics_url = w.metrics_url or load.metrics_url  # a URL given at registration wins
        except (grpc.aio.AioRpcError, asyncio.TimeoutError):
            ok = False
        w.failures = 0 if ok else w.failures + 1
        if ok and not w.healthy:
            logger.info("%s worker %s is healthy again", w.role, w.address)
        if not ok and w.healthy and w.failures >= self.max_failures:
            logger.warning("%s worker %s failed %d health checks; marking it unhealthy", w.role, w.address,
                           w.failures)
        w.healthy = ok or (w.healthy and w.failures < self.max_failures)
        w.last_check = time.time()
        return ok

    async def poll_forever(self) -> None:
        while True:
            await asyncio.gather(*(self.check(w) for w in list(self.workers.values())), return_exceptions=True)
            await asyncio.sleep(self.interval_s)
