"""`run_worker`: the composition of one prefill or decode worker process.

engine (+ draft) -> engine loop thread -> transfer backend with every pool registered -> worker -> gRPC server
(worker service, standard health checking, reflection) + Prometheus `/metrics`. Prints one JSON "ready" line on
stdout (with the ports actually bound) and serves until SIGTERM/SIGINT, then drains and stops.
"""

from __future__ import annotations

import json
import logging
import signal
import sys
import threading
import time
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import start_http_server

from pdspark.config import WorkerConfig
from pdspark.engine.factory import create_engine
from pdspark.serving.decode_worker import DecodeWorker
from pdspark.serving.engine_descriptor import describe_engine
from pdspark.serving.engine_loop import EngineLoop
from pdspark.serving.grpc_services import DecodeServicer, PrefillServicer
from pdspark.serving.metrics import WorkerMetrics
from pdspark.serving.prefill_client import PrefillClients
from pdspark.serving.prefill_worker import PrefillWorker
from pdspark.transfer.backend import create_backend
from pdspark.transfer.transfer_plan import registered_regions
from pdspark.v1 import worker_pb2, worker_pb2_grpc

logger = logging.getLogger(__name__)
_METRICS_EVERY_S = 0.5


class WorkerServer:
    def __init__(self, cfg: WorkerConfig):
        self.cfg = cfg
        engine = create_engine(cfg.model, progress=False, config=cfg.engine)
        self.loop = EngineLoop(engine)
        self.backend = create_backend(cfg.transfer_backend, host=cfg.advertise_host, protocol=cfg.transfer_protocol)
        for addr, nbytes in registered_regions(engine.kv.pools):
            self.backend.register(addr, nbytes)
        self.metrics = WorkerMetrics(cfg.role)
        compat = describe_engine(engine)
        self.grpc = grpc.server(futures.ThreadPoolExecutor(max_workers=cfg.grpc_threads))
        if cfg.role == "prefill":
            self.worker = PrefillWorker(self.loop, self.backend, compat, self.metrics)
            self.servicer: PrefillServicer | DecodeServicer = PrefillServicer(self.worker)
            worker_pb2_grpc.add_PrefillWorkerServicer_to_server(self.servicer, self.grpc)
            service = worker_pb2.DESCRIPTOR.services_by_name["PrefillWorker"].full_name
            in_flight = lambda: self.worker.in_flight  # noqa: E731
        else:
            self.worker = DecodeWorker(self.loop, self.backend, compat, PrefillClients().submit_plan, self.metrics)
            self.servicer = DecodeServicer(self.worker)
            worker_pb2_grpc.add_DecodeWorkerServicer_to_server(self.servicer, self.grpc)
            service = worker_pb2.DESCRIPTOR.services_by_name["DecodeWorker"].full_name
            in_flight = lambda: self.worker.transfers_in_flight  # noqa: E731
        self.health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.grpc)
        reflection.enable_server_reflection(
            (service, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME), self.grpc
        )
        self.port = self.grpc.add_insecure_port(f"{cfg.host}:{cfg.port}")
        self._last_metrics = 0.0
        self.loop.add_ticker(lambda: self._sample_metrics(in_flight))
        self.service = service

    def _sample_metrics(self, in_flight) -> None:
        now = time.monotonic()
        if now - self._last_metrics >= _METRICS_EVERY_S:
            self._last_metrics = now
            self.metrics.sample_engine(self.loop.engine, in_flight())

    def start(self) -> dict:
        self.loop.start()
        self.grpc.start()
        metrics_port = None  # null on the ready line: no metrics server
        if self.cfg.metrics_port is not None:
            server, _ = start_http_server(self.cfg.metrics_port, addr=self.cfg.host, registry=self.metrics.registry)
            metrics_port = server.server_port
            # Reported in GetLoad: the router lists it in /workers without being told.
            self.servicer.metrics_url = f"http://{self.cfg.advertise_host}:{metrics_port}/metrics"
        for name in ("", self.service):
            self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        return {
            "event": "ready",
            "role": self.cfg.role,
            "address": f"{self.cfg.advertise_host}:{self.port}",
            "grpc_port": self.port,
            "metrics_port": metrics_port,
            "transfer_session": self.backend.session_id,
        }

    def stop(self, grace_s: float = 5.0) -> None:
        for name in ("", self.service):
            self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        self.grpc.stop(grace_s).wait(grace_s + 1)
        self.loop.stop()
        self.backend.close()


def run_worker(cfg: WorkerConfig) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    server = WorkerServer(cfg)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    print(json.dumps(server.start()), flush=True)
    stop.wait()
    logger.info("%s worker stopping", cfg.role)
    server.stop()
    return 0
