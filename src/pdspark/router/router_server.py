"""`run_router`: the router process. HTTP (aiohttp) and gRPC (grpc.aio) on one asyncio loop (uvloop's), the worker
registry's health polling and DNS discovery (`--prefill-dns`/`--decode-dns`) beside them; one JSON ready line on stdout;
SIGTERM/SIGINT drain and stop; SIGHUP, or a change to a key file (checked every 2 s), reads the key files again (key
rotation without a restart). With
`--ssl-certfile`/`--ssl-keyfile` both public ports speak TLS (HTTPS; gRPC without client certificates: clients
authenticate with API keys); with `--tls-*` the calls to the workers use mutual TLS (`WorkerRegistry`). With
`--admin-port` the admin routes have an HTTP listener of their own (`start_http`), with the same TLS and keys."""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import signal
import ssl
import sys
from dataclasses import dataclass

import grpc
import uvloop
from aiohttp import web
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from pdspark.assets import resolve_model
from pdspark.config import RouterConfig, resolve_max_model_len
from pdspark.errors import ConfigError
from pdspark.model.model_config import ModelConfig
from pdspark.router.auth.auth_interceptor import AuthInterceptor
from pdspark.router.auth.shared_key_quota import SharedKeyQuota
from pdspark.router.dispatcher import Dispatcher
from pdspark.router.grpc_api import RouterServicer
from pdspark.router.http_api import Routes, build_app
from pdspark.router.peer_link import PeerLink
from pdspark.router.router_core import RouterCore
from pdspark.router.router_metrics import RouterMetrics
from pdspark.router.workers.dns_discovery import DnsDiscovery
from pdspark.router.workers.policies import make_policy
from pdspark.router.workers.worker_registry import WorkerInfo, WorkerRegistry
from pdspark.rpc import tracing
from pdspark.rpc.malformed_requests import MalformedRequestInterceptor
from pdspark.rpc.tls_credentials import PublicCertificate, public_server_credentials
from pdspark.v1 import router_pb2, router_pb2_grpc

logger = logging.getLogger(__name__)

ROUTER_SERVICE = router_pb2.DESCRIPTOR.services_by_name["Router"].full_name

# Clients (the SDK pings every 30 s on a long stream) may keep their connections alive; a ping more often than every
# 5 s is a strike, and a client past the strikes is sent away (gRPC's default policy, with a shorter interval).
SERVER_OPTIONS = (
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
)


def build_grpc_server(core: RouterCore) -> tuple[grpc.aio.Server, health.aio.HealthServicer]:
    """The router's gRPC server (no port yet): the `Router` service behind the key check, health and reflection
    open; undecodable requests are INVALID_ARGUMENT; requests over `max_body_bytes` are refused by gRPC itself
    (RESOURCE_EXHAUSTED), as HTTP refuses them."""
    options = (*SERVER_OPTIONS, ("grpc.max_receive_message_length", core.options.admission.max_body_bytes))
    # Malformed bytes are INVALID_ARGUMENT, not grpc's UNKNOWN; the key is checked before any handler runs.
    server = grpc.aio.server(options=options, interceptors=[MalformedRequestInterceptor(),
                                                            AuthInterceptor(core.keys, core.metrics)])
    router_pb2_grpc.add_RouterServicer_to_server(RouterServicer(core), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (ROUTER_SERVICE, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME), server)
    return server, health_servicer


def reload_keys(core: RouterCore) -> None:
    """SIGHUP, or a key file changed: the key files again; a file that cannot be read keeps the keys in use (and
    says why)."""
    try:
        core.keys.reload()
    except ConfigError as e:
        logger.error("keys not reloaded, the previous ones stay in use: %s", e)


# How often the key and certificate files are checked for a change (rotation without a SIGHUP: a Kubernetes Secret
# volume updates its files in place of the pod, which cannot be signalled). A rotated key or certificate is in use
# within this, plus the kubelet's sync.
KEY_WATCH_S = 2.0


async def watch_files(core: RouterCore, https: PublicCertificate | None = None) -> None:
    """Whenever their files change (inode, size or modification time): reload the keys; make new channels to the
    workers with the rotated client certificate (`WorkerRegistry.renew_channels`); load the rotated HTTPS pair.
    (The public gRPC port reads its pair at a handshake: `public_server_credentials`.)"""
    seen = core.keys.files_version()
    while True:
        await asyncio.sleep(KEY_WATCH_S)
        now = core.keys.files_version()
        if now != seen:
            seen = now
            logger.info("a key file changed: reading the keys again")
            reload_keys(core)
        core.registry.renew_channels()
        if https is not None:
            https.refresh()


def _warn_if_exposed(cfg: RouterConfig, core: RouterCore) -> None:
    if core.keys.development or core.keys.generation_needs_key:
        return
    logger.warning("the router listens on %s without API keys: anyone who can reach it can generate; set "
                   "--api-key-file or PDSPARK_API_KEY", cfg.host)


@dataclass
class GroupMember:
    """This process's place in a router group (`router_group`): its line to the others, the shared per-key counts,
    and the worker changes asked before it started (replayed before it serves)."""

    link: PeerLink
    key_quota: SharedKeyQuota
    worker_ops: list[dict]

    @property
    def index(self) -> int:
        return self.link.index


def build_core(cfg: RouterConfig, member: GroupMember | None = None) -> RouterCore:
    path = resolve_model(cfg.model)
    model_cfg = ModelConfig.from_dir(path)
    registry = WorkerRegistry(health_interval_s=cfg.health.health_interval_s,
                              health_timeout_s=cfg.health.health_timeout_s,
                              load_interval_s=cfg.health.load_interval_s, tls=cfg.tls,
                              multiplexed=cfg.worker_calls == "multiplexed",
                              renew_drain_s=cfg.admission.request_timeout_s)
    for role, addresses in (("prefill", cfg.prefill), ("decode", cfg.decode)):
        for address in addresses:
            registry.add(role, address)
    metrics = RouterMetrics()
    group = member is not None
    dispatcher = Dispatcher(registry, make_policy(cfg.prefill_policy, group), make_policy(cfg.decode_policy, group),
                            transfer_timeout_s=cfg.transfer_timeout_s, max_attempts=cfg.max_attempts,
                            max_migrations=cfg.max_migrations, max_role_outage_wait_s=cfg.max_role_outage_wait_s,
                            metrics=metrics)
    name = cfg.served_model_name or (cfg.model if "/" not in cfg.model else path.rstrip("/").split("/")[-1])
    max_len = resolve_max_model_len(cfg.max_model_len, model_cfg.max_position_embeddings)
    if member is None:
        return RouterCore(path, name, max_len, registry, dispatcher, metrics, cfg)
    return RouterCore(path, name, max_len, registry, dispatcher, metrics, cfg, member.key_quota, member.link)


def build_discovery(cfg: RouterConfig, core: RouterCore) -> DnsDiscovery | None:
    """The DNS discovery of `--prefill-dns`/`--decode-dns` (None without either): it admits and retires workers
    as `POST`/`DELETE /workers` do (metrics series, the policies' memory)."""
    discovery = cfg.discovery
    if not discovery.dns_targets:
        return None

    def admitted(w: WorkerInfo) -> None:
        core.metrics.worker_added(w.role, w.name)

    def retired(w: WorkerInfo) -> None:
        core.metrics.worker_removed(w.role, w.name)
        core.dispatcher.prefill_policy.forget(w.address)
        core.dispatcher.decode_policy.forget(w.address)

    return DnsDiscovery(core.registry, discovery.dns_targets, discovery.dns_interval_s, discovery.hosts_file,
                        admitted, retired)


def _public_tls(cfg: RouterConfig) -> tuple[PublicCertificate | None, grpc.ServerCredentials | None]:
    """HTTPS certificate and gRPC credentials of the public ports (None, None: plain text)."""
    if cfg.ssl_certfile is None or cfg.ssl_keyfile is None:
        return None, None
    return (PublicCertificate(cfg.ssl_certfile, cfg.ssl_keyfile),
            public_server_credentials(cfg.ssl_certfile, cfg.ssl_keyfile))


@dataclass
class HttpListeners:
    """The router's HTTP listeners: every route on `port`; or, with `--admin-port`, the admin routes on
    `admin_port` and the others on `port`."""

    runners: list[web.AppRunner]
    port: int
    admin_port: int | None = None

    async def cleanup(self) -> None:
        for runner in self.runners:
            await runner.cleanup()


async def start_http(core: RouterCore, cfg: RouterConfig, ssl_context: ssl.SSLContext | None,
                     member: GroupMember | None = None) -> HttpListeners:
    """Listen on `cfg`'s host and ports (0: any free one): HTTPS with `ssl_context`, aiohttp's access log with
    `--access-log`; the admin routes on a listener of their own with `--admin-port`. A group's `member`
    listens beside the others (SO_REUSEPORT); the admin port is process 0's alone."""
    split = cfg.admin_port is not None
    reuse = member is not None
    runner, port = await _listen(core, cfg, "public" if split else "all", cfg.port, ssl_context, reuse_port=reuse)
    listeners = HttpListeners([runner], port)
    if cfg.admin_port is not None and (member is None or member.index == 0):
        try:
            # The router's own metrics target, in the admin routes' Prometheus discovery, is on the main port.
            runner, listeners.admin_port = await _listen(core, cfg, "admin", cfg.admin_port, ssl_context,
                                                         metrics_port=port, reuse_port=reuse)
        except BaseException:
            await listeners.cleanup()
            raise
        listeners.runners.append(runner)
    return listeners


async def _listen(core: RouterCore, cfg: RouterConfig, routes: Routes, port: int, ssl_context: ssl.SSLContext | None,
                  metrics_port: int | None = None, reuse_port: bool = False) -> tuple[web.AppRunner, int]:
    """`build_app(core, routes)` listening on `port`: its runner, and the port it got."""
    app = build_app(core, routes, metrics_port)
    runner = (web.AppRunner(app, handler_cancellation=True) if cfg.access_log
              else web.AppRunner(app, handler_cancellation=True, access_log=None))
    await runner.setup()
    try:
        site = web.TCPSite(runner, cfg.host, port, ssl_context=ssl_context, reuse_port=reuse_port or None)
        await site.start()
    except BaseException:
        await runner.cleanup()
        raise
    return runner, site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]


def answer_peers(core: RouterCore, link: PeerLink) -> None:
    """What this process of a group does when another (or itself) asks the group (`PeerLink.ask`)."""

    async def publish_gauges(args: dict) -> None:
        core.publish_gauges()

    async def abort(args: dict) -> bool:
        return core.abort(args["request_id"])

    async def add_worker(args: dict) -> dict:
        return await core.apply_worker_change("add_worker", args)

    async def remove_worker(args: dict) -> dict:
        return await core.apply_worker_change("remove_worker", args)

    link.handlers.update(publish_gauges=publish_gauges, abort=abort, add_worker=add_worker,
                         remove_worker=remove_worker)


async def serve(cfg: RouterConfig, stop: asyncio.Event, member: GroupMember | None = None) -> None:
    core = build_core(cfg, member)
    if member is None or member.index == 0:
        _warn_if_exposed(cfg, core)
    asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, reload_keys, core)
    # Read before anything listens: a bad certificate path is a configuration error at start.
    https, grpc_credentials = _public_tls(cfg)
    ssl_context = https.context if https is not None else None
    if member is not None:
        for op in member.worker_ops:  # what the group changed before this process started, in its order
            await core.apply_worker_change(op["op"], op["args"])
        answer_peers(core, member.link)
        member.link.lost = stop.set  # the supervisor is gone: stop too
        member.link.start()
    listeners = await start_http(core, cfg, ssl_context, member)
    http_port = listeners.port
    server, health_servicer = build_grpc_server(core)
    grpc_address = f"{cfg.host}:{cfg.grpc_port}"
    grpc_port = (server.add_insecure_port(grpc_address) if grpc_credentials is None
                 else server.add_secure_port(grpc_address, grpc_credentials))
    await server.start()
    for name in ("", ROUTER_SERVICE):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    poller = asyncio.create_task(core.registry.poll_forever())
    file_watch = asyncio.create_task(watch_files(core, https))
    discovery = build_discovery(cfg, core)
    discoverer = asyncio.create_task(discovery.run()) if discovery is not None else None
    public_tls = ssl_context is not None
    scheme = "https" if public_tls else "http"
    admin = ({} if listeners.admin_port is None else
             {"admin": f"{scheme}://{cfg.host}:{listeners.admin_port}", "admin_port": listeners.admin_port})
    ready = {"role": "router", "http": f"{scheme}://{cfg.host}:{http_port}", "grpc": f"{cfg.host}:{grpc_port}",
             "http_port": http_port, "grpc_port": grpc_port, **admin, "model": core.served_name, "tls": public_tls,
             "worker_tls": cfg.tls.enabled}
    # What start-up made (the app, its routes, the tokenizer, the gRPC stack) lives as long as the process: out of the
    # collector's generations, so the full collections that requests trigger do not walk it again and again. A request
    # allocates many short-lived container objects, nearly all freed by their reference counts: a youngest generation
    # of 20,000 (700 by default) is collected far less often (router CPU a request ~4% lower over 4 rounds).
    gc.collect()
    gc.freeze()
    gc.set_threshold(20000, 20, 20)
    if member is None:
        print(json.dumps({"event": "ready", **ready}), flush=True)
    else:  # the supervisor prints the group's one line
        member.link.send({"kind": "ready", **ready})
    await stop.wait()
    logger.info("router stopping")
    for name in ("", ROUTER_SERVICE):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    poller.cancel()
    file_watch.cancel()
    if discoverer is not None:
        discoverer.cancel()
    await server.stop(5)
    await listeners.cleanup()
    core.prompt_work.close()
    if member is not None:
        member.link.stop()


def run_router(cfg: RouterConfig, member: GroupMember | None = None) -> int:
    """The router in this process: alone (`--processes 1`), or as `member` of a group (`router_group`, which
    runs `--processes` > 1)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    tracing.configure(cfg.otlp_endpoint, "pdspark-router")

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        # A group's process stops when its supervisor says (SIGTERM), not on a terminal's Ctrl-C to them all.
        for sig in (signal.SIGTERM,) if member is not None else (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await serve(cfg, stop, member)

    # uvloop: the loop's own work (callbacks, socket reads and writes) in C; grpc.aio runs on it as on asyncio's.
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(main())
    return 0
