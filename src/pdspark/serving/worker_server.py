"""`run_worker`: the composition of one prefill or decode worker process.

engine (+ draft) -> engine loop thread -> transfer backend with every pool registered -> worker -> grpc.aio server
(worker service, standard health checking, reflection; keepalive; mutual TLS with `--tls-*`: only peers with a
certificate of the cluster's CA, each RPC only from the role that makes it) + a plain HTTP port with Prometheus
`/metrics` and the kubelet's `/health` and `/live` (`probe_server`). Prints one JSON
"ready" line on stdout (with the ports actually bound) and serves until SIGTERM/SIGINT, then drains and stops.

Threads: the main thread runs the asyncio loop (every gRPC handler, every rendezvous and stream); the engine loop
thread runs the engine; a small transfer executor reads and writes cache pages (Mooncake calls block); the
metrics server has its own thread. None of them waits on another without a deadline.
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import signal
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import cast

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from pdspark.config import WorkerConfig
from pdspark.engine.engine import Engine
from pdspark.engine.engine_group import start_engine_group
from pdspark.engine.factory import create_engine
from pdspark.engine.lockstep import LockstepEngine
from pdspark.errors import ConfigError, WorkerGroupError
from pdspark.rpc import tracing
from pdspark.rpc.keepalive import SERVER_OPTIONS
from pdspark.rpc.malformed_requests import MalformedRequestInterceptor
from pdspark.rpc.peer_roles import PeerRoleInterceptor
from pdspark.rpc.tls_credentials import PeerCredentials, server_credentials
from pdspark.serving.decode_metrics import DecodeMetrics
from pdspark.serving.decode_worker import DecodeWorker
from pdspark.serving.engine_descriptor import describe_engine
from pdspark.serving.engine_loop import EngineLoop, StepObserver, exit_for_group_failure
from pdspark.serving.group_metrics import GroupCollector, OneProcessGroup
from pdspark.serving.grpc_services import DecodeServicer, PrefillServicer
from pdspark.serving.prefill_client import PrefillClients
from pdspark.serving.prefill_metrics import PrefillMetrics
from pdspark.serving.prefill_worker import PrefillWorker
from pdspark.serving.probe_server import LIVE_STALE_S, ProbeServer
from pdspark.serving.transfer_destinations import DestinationService, TransferDestinations, local_destination
from pdspark.serving.transfer_writer import TRANSFER_THREADS
from pdspark.transfer.backend import create_backend
from pdspark.transfer.transfer_plan import registered_regions
from pdspark.v1 import worker_pb2, worker_pb2_grpc

logger = logging.getLogger(__name__)
_METRICS_EVERY_S = 0.5
# How often an idle worker group checks that its other ranks answer (`LockstepEngine.ping`): a rank that hangs while
# there is no work is then noticed within this + the group's timeout, not at the next request's first step.
_PING_EVERY_S = 1.0
_GIL_SWITCH_S = 0.001


class WorkerServer:
    def __init__(self, cfg: WorkerConfig):
        """Load the engine and build the worker (slow: the model loads); `start` then serves it."""
        self.cfg = cfg
        self.group: LockstepEngine | None = None
        par = cfg.engine.parallel
        destination_service: DestinationService | None = None
        if par.ep_size > 1:
            if cfg.role == "decode" and not par.dp_attention:
                raise ConfigError(f"`ep_size` is {par.ep_size} for a decode worker without `dp_attention`; allowed: "
                                  "`dp_attention` on (a decode group's ranks each own whole requests) or ep_size 1")
            if cfg.role == "prefill" and par.dp_attention:
                raise ConfigError("`dp_attention` for a prefill worker; allowed: off (a prefill group runs its "
                                  "batch on every rank; decode groups run DP-attention)")
            if cfg.role == "decode":
                if cfg.transfer_backend == "inprocess":
                    raise ConfigError("`transfer_backend` 'inprocess' for a decode group; allowed: 'mooncake' (each "
                                      "rank receives into its own process's memory)")
                # Each other rank receives transfers into its own pools, through its own transfer engine.
                destination_service = DestinationService(cfg.transfer_backend, cfg.advertise_host,
                                                         cfg.transfer_protocol, cfg.transfer_device)
            # Rank 0 here, the other ranks child processes (`engine/lockstep.py`, `engine/data_parallel.py`): the
            # Engine API over the group. Only rank 0 serves gRPC; in a prefill group only rank 0 writes transfers.
            self.group = start_engine_group(cfg.model, False, cfg.engine, {}, rank_service=destination_service)
            self.group.watch(exit_for_group_failure)
            engine = cast(Engine, self.group)
        else:
            engine = create_engine(cfg.model, progress=False, config=cfg.engine)
        self.metrics: PrefillMetrics | DecodeMetrics = (
            PrefillMetrics() if cfg.role == "prefill" else DecodeMetrics(engine.scheduler.num_drafts))
        # Every rank's step and collective figures, and whether it runs (a one-process worker: rank 0 alone).
        observer: StepObserver = self.metrics.engine
        if self.group is not None:
            self.metrics.registry.register(GroupCollector(self.group))
        else:
            observer = OneProcessGroup(then=self.metrics.engine)
            self.metrics.registry.register(GroupCollector(observer))
        self.loop = EngineLoop(engine, observer=observer)
        self.backend = create_backend(cfg.transfer_backend, host=cfg.advertise_host, protocol=cfg.transfer_protocol,
                                      device=cfg.transfer_device)
        for addr, nbytes in registered_regions(engine.kv.pools):  # (rank 0's; the other ranks register theirs)
            self.backend.register(addr, nbytes)
        self.executor = ThreadPoolExecutor(TRANSFER_THREADS, thread_name_prefix="transfer")
        compat = describe_engine(engine)
        self.prefill_clients: PrefillClients | None = None
        self._health_task: asyncio.Task | None = None
        self._published: int | None = None  # the status the health service was last given
        self._stopping = False
        self._beat = time.monotonic()  # the asyncio loop's last heartbeat (`/live`)
        self._heartbeat: asyncio.Task | None = None
        self.probes: ProbeServer | None = None
        if isinstance(self.metrics, PrefillMetrics):
            prefill = PrefillWorker(self.loop, self.backend, compat, self.metrics, max_pending=cfg.max_pending_prefills,
                                    executor=self.executor, early_prefills=cfg.early_prefills,
                                    transfer_threads=TRANSFER_THREADS)  # the executor's: all stuck -> NOT_SERVING
            self.metrics.stuck_transfers.set_function(lambda: prefill.stuck_transfers)
            prefill.on_serving.append(self._serving_changed)
            self.worker: PrefillWorker | DecodeWorker = prefill
            self.service = worker_pb2.DESCRIPTOR.services_by_name["PrefillWorker"].full_name
        else:
            # Under mutual TLS the decode worker calls prefill workers with its own certificate.
            self.prefill_clients = PrefillClients(PeerCredentials(cfg.tls) if cfg.tls.enabled else None)
            destinations = None
            if self.group is not None:
                destinations = TransferDestinations(local_destination(self.backend, engine), self.group.rank_services,
                                                    par.dist_timeout_s + 1.0)
            self.worker = DecodeWorker(self.loop, self.backend, compat, self.prefill_clients.submit_plan, self.metrics,
                                       max_waiting=cfg.max_waiting_streams, executor=self.executor,
                                       abort_plan=self.prefill_clients.abort, destinations=destinations)
            self.service = worker_pb2.DESCRIPTOR.services_by_name["DecodeWorker"].full_name
            decode = self.worker
            self.metrics.waiting_for_pages.set_function(lambda: decode.waiting)
        # Read at scrape time: the worker's own counts (asyncio thread) are the one source.
        self.metrics.transfers_in_flight.set_function(self._in_flight)
        self._last_metrics = 0.0
        self.loop.add_ticker(self._sample_metrics)
        self._pinged = time.monotonic()
        if self.group is not None:
            self.loop.add_ticker(self._check_ranks)

    def _in_flight(self) -> int:
        w = self.worker
        return w.in_flight if isinstance(w, PrefillWorker) else w.transfers_in_flight

    def _check_ranks(self) -> None:
        """(Ticker) While the group is idle, its ranks must still answer; one that does not fails it as a step
        would (exit for a restart)."""
        now = time.monotonic()
        if self.group is None or self.loop.engine.has_unfinished or now - self._pinged < _PING_EVERY_S:
            return
        self._pinged = now
        try:
            self.group.ping()
        except WorkerGroupError as e:
            exit_for_group_failure(str(e))

    def _sample_metrics(self) -> None:
        now = time.monotonic()
        if now - self._last_metrics >= _METRICS_EVERY_S:
            self._last_metrics = now
            self.metrics.sample_engine(self.loop.engine, self.loop.load)

    async def start(self) -> dict:
        """Start the engine loop and serve (on the running asyncio loop); returns the ready line's fields."""
        tls = self.cfg.tls.enabled
        # Bytes that are no message of their RPC's type: INVALID_ARGUMENT, not grpc's UNKNOWN.
        interceptors: list[grpc.aio.ServerInterceptor] = [MalformedRequestInterceptor()]
        if tls:
            interceptors.append(PeerRoleInterceptor())
        self.grpc = grpc.aio.server(options=SERVER_OPTIONS, interceptors=interceptors)
        if isinstance(self.worker, PrefillWorker):
            self.servicer: PrefillServicer | DecodeServicer = PrefillServicer(self.worker, self.metrics)
            worker_pb2_grpc.add_PrefillWorkerServicer_to_server(self.servicer, self.grpc)
        else:
            self.servicer = DecodeServicer(self.worker, self.metrics)
            worker_pb2_grpc.add_DecodeWorkerServicer_to_server(self.servicer, self.grpc)
        if self.group is not None:  # (its ranks' states in every load report: the router's /workers)
            self.servicer.rank_states = self.group.rank_states
        # Health answers from the asyncio loop, never behind the engine: a busy worker is still SERVING. A prefill
        # worker whose transfer threads are all stuck is NOT_SERVING until one is free (`PrefillWorker.serving`).
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.grpc)
        reflection.enable_server_reflection(
            (self.service, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME),
            self.grpc)
        address = f"{self.cfg.host}:{self.cfg.port}"
        # NOTE: with TLS, no plain-text port at all: a client without a certificate of the CA fails the handshake
        # (the health service too, so a probe must present one).
        self.port = (self.grpc.add_secure_port(address, server_credentials(self.cfg.tls)) if tls
                     else self.grpc.add_insecure_port(address))
        self.loop.start()
        await self.grpc.start()
        metrics_port = None  # null on the ready line: no metrics server
        if self.cfg.metrics_port is not None:
            self.probes = ProbeServer(self.metrics.registry, self._ready, self._alive)
            metrics_port = self.probes.start(self.cfg.host, self.cfg.metrics_port)
            self._heartbeat = asyncio.get_running_loop().create_task(self._beat_every_second())
            # Reported in GetLoad: the router lists it in /workers without being told.
            self.servicer.metrics_url = f"http://{self.cfg.advertise_host}:{metrics_port}/metrics"
        await self._publish_health()
        return {
            "event": "ready",
            "role": self.cfg.role,
            "address": f"{self.cfg.advertise_host}:{self.port}",
            "grpc_port": self.port,
            "metrics_port": metrics_port,
            "transfer_session": self.backend.session_id,
            "tls": tls,
        }

    def _serving_changed(self) -> None:
        """(asyncio thread) The health service follows the worker, through one task at a time."""
        if self._published is not None and (self._health_task is None or self._health_task.done()):
            self._health_task = asyncio.get_running_loop().create_task(self._publish_health())

    def _ready(self) -> bool:
        """(probe thread) `/health`: what the gRPC health service says now."""
        return not self._stopping and self._published == health_pb2.HealthCheckResponse.SERVING

    def _alive(self) -> bool:
        """(probe thread) `/live`: the asyncio loop turned within `LIVE_STALE_S`."""
        return time.monotonic() - self._beat < LIVE_STALE_S

    async def _beat_every_second(self) -> None:
        while True:
            self._beat = time.monotonic()
            await asyncio.sleep(1.0)

    def _health_status(self) -> int:
        if isinstance(self.worker, PrefillWorker) and not self.worker.serving:
            return health_pb2.HealthCheckResponse.NOT_SERVING
        return health_pb2.HealthCheckResponse.SERVING

    async def _publish_health(self) -> None:
        # Until what was published is what holds now: a flip while `set` waited (for a Watch call) is not lost.
        while (status := self._health_status()) != self._published:
            for name in ("", self.service):
                await self.health.set(name, status)
            self._published = status

    async def drain(self) -> None:
        """Stop taking new work (SIGUSR1, the pod's preStop): NOT_SERVING for good, so the routers' health checks
        send nothing new here; running calls go on until `stop`."""
        if not self._stopping:
            logger.info("%s worker draining: NOT_SERVING, running calls go on", self.cfg.role)
        # (a status set later, a stuck transfer thread freed, is ignored)
        self._stopping = True
        await self.health.enter_graceful_shutdown()

    async def stop(self, grace_s: float | None = None) -> None:
        """Drain, let running calls finish for `grace_s` (default `--drain-timeout-s`), then stop everything."""
        grace_s = self.cfg.drain_timeout_s if grace_s is None else grace_s
        await self.drain()
        # New calls on the routers' `Calls` streams are refused as the server refuses new gRPC calls in its grace.
        self.servicer.calls.stop_taking_calls()
        await self.grpc.stop(grace_s)
        if self.prefill_clients is not None:
            await self.prefill_clients.close()
        self.loop.stop()
        if self.group is not None:
            self.group.close()  # (after the loop: no step is under way)
        self.executor.shutdown(wait=False, cancel_futures=True)
        if isinstance(self.worker, PrefillWorker):
            self.worker.close()
        self.backend.close()
        if self._heartbeat is not None:
            self._heartbeat.cancel()
        if self.probes is not None:
            self.probes.close()


async def _serve(server: WorkerServer) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    # The pod's preStop: stop taking new work before SIGTERM comes (the routers notice within their health poll).
    loop.add_signal_handler(signal.SIGUSR1, lambda: asyncio.ensure_future(server.drain()))
    print(json.dumps(await server.start()), flush=True)
    await stop.wait()
    logger.info("%s worker stopping", server.cfg.role)
    await server.stop()


def run_worker(cfg: WorkerConfig) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    tracing.configure(cfg.otlp_endpoint, f"pdspark-{cfg.role}")
    server = WorkerServer(cfg)
    # NOTE: latency of the asyncio thread (health and load calls answer within 100 ms under any load). The engine
    # thread runs Python between kernels; a shorter GIL switch interval (5 ms by default) hands the GIL to a woken
    # asyncio thread sooner. Freezing what the model load allocated keeps full garbage collections (which stop
    # every thread) from walking the model's objects again and again.
    sys.setswitchinterval(_GIL_SWITCH_S)
    gc.collect()
    gc.freeze()
    asyncio.run(_serve(server))
    return 0
