"""`RouterHarness`: stub workers (`worker_stubs`) behind the router's real dispatcher and gRPC and HTTP front ends,
all on the running event loop, so a test drives clients, router and workers from one coroutine."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os

import aiohttp
import grpc

from helpers import sample_value
from pdspark.assets import resolve_model
from pdspark.config import RouterConfig, resolve_max_model_len
from pdspark.model.model_config import ModelConfig
from pdspark.options import build
from pdspark.router.dispatcher import Dispatcher
from pdspark.router.router_core import RouterCore
from pdspark.router.router_metrics import RouterMetrics
from pdspark.router.router_server import HttpListeners, build_grpc_server, start_http
from pdspark.router.workers.worker_registry import WorkerRegistry
from pdspark.testing.worker_stubs import StubDecode, StubHealth, StubPrefill, serve_stub


async def serve_front_ends(core: RouterCore) -> tuple[grpc.aio.Server, str, HttpListeners, str]:
    """The router's gRPC and HTTP front ends over `core`, each on a free loopback port (the admin routes on one of
    their own when `core`'s options have an `admin_port`): (gRPC server, its address, the HTTP listeners, the main
    one's URL). The caller stops both (`server.stop`, `listeners.cleanup`)."""
    server, _ = build_grpc_server(core)
    address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    await server.start()
    listeners = await start_http(core, dataclasses.replace(core.options, host="127.0.0.1", port=0), None)
    return server, address, listeners, f"http://127.0.0.1:{listeners.port}"


class LowestAddress:
    """A policy that picks the lowest address: what a retry avoids is the only thing that changes the pick."""

    def select(self, workers, prompt_ids):
        return min(workers, key=lambda w: w.address)

    def forget(self, address):
        pass


class RouterHarness:
    """`prefill[i]`/`decode[i]` are sorted by address: index 0 is the worker picked first."""

    def __init__(self) -> None:
        self.prefill: list[StubPrefill] = []
        self.decode: list[StubDecode] = []
        self.health: dict[int, StubHealth] = {}  # id(stub) -> its health service
        self.address: dict[int, str] = {}  # id(stub) -> its address
        self._servers: dict[int, grpc.aio.Server] = {}  # id(stub) -> its server
        self._poller: asyncio.Task | None = None

    @classmethod
    async def start(cls, prefills: int = 1, decodes: int = 1, tokens: int = 4, poll: bool = False,
                    **options) -> RouterHarness:
        """`options`: `RouterConfig` options (flat: `api_key=("k",)`; `max_model_len` as the router resolves it;
        `admin_port=0`: the admin routes on a port of their own, at `admin_url`); `poll`: run the registry's health
        and load polling. `worker_calls` not given: `PDSPARK_WORKER_CALLS` decides, else the option's default, as in
        a router process (so that one variable runs every router test, harness and processes, over either
        transport)."""
        if calls := os.environ.get("PDSPARK_WORKER_CALLS"):
            options.setdefault("worker_calls", calls)
        h = cls()
        served = []
        for stub in [StubPrefill() for _ in range(prefills)] + [StubDecode(tokens) for _ in range(decodes)]:
            server, health, address = await serve_stub(stub)
            h._servers[id(stub)] = server
            h.health[id(stub)], h.address[id(stub)] = health, address
            served.append(stub)
        h.prefill = sorted((s for s in served if isinstance(s, StubPrefill)), key=lambda s: h.address[id(s)])
        h.decode = sorted((s for s in served if isinstance(s, StubDecode)), key=lambda s: h.address[id(s)])
        cfg = build(RouterConfig, options)
        h.registry = WorkerRegistry(health_interval_s=cfg.health.health_interval_s,
                                    health_timeout_s=cfg.health.health_timeout_s,
                                    load_interval_s=cfg.health.load_interval_s,
                                    multiplexed=cfg.worker_calls == "multiplexed")
        for s in h.prefill:
            h.registry.add("prefill", h.address[id(s)])
        for s in h.decode:
            h.registry.add("decode", h.address[id(s)])
        path = resolve_model("dsv4-tiny")
        metrics = RouterMetrics()
        dispatcher = Dispatcher(h.registry, LowestAddress(), LowestAddress(), transfer_timeout_s=cfg.transfer_timeout_s,
                                max_attempts=cfg.max_attempts, max_migrations=cfg.max_migrations,
                                max_role_outage_wait_s=cfg.max_role_outage_wait_s, metrics=metrics)
        max_len = resolve_max_model_len(cfg.max_model_len, ModelConfig.from_dir(path).max_position_embeddings)
        h.core = RouterCore(path, "tiny", max_len, h.registry, dispatcher, metrics, cfg)
        h.router, h.grpc_address, h.listeners, h.http_url = await serve_front_ends(h.core)
        # With `admin_port`: where the admin routes are (else on `http_url`).
        h.admin_url = (f"http://127.0.0.1:{h.listeners.admin_port}" if h.listeners.admin_port is not None
                       else h.http_url)
        if poll:
            h._poller = asyncio.create_task(h.registry.poll_forever())
        return h

    def worker(self, stub) -> object:
        """The registry's `WorkerInfo` of `stub`."""
        return self.registry.workers[self.address[id(stub)]]

    async def stop_worker(self, stub) -> None:
        """Kill `stub`'s server (a worker that died)."""
        await self._servers[id(stub)].stop(None)

    async def restart_worker(self, stub) -> None:
        """Serve `stub` again at its address after `stop_worker` (a worker restarted on its port), with a fresh
        health service."""
        port = int(self.address[id(stub)].rpartition(":")[2])
        self._servers[id(stub)], self.health[id(stub)], _ = await serve_stub(stub, port)

    async def close(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
        await self.router.stop(None)
        await self.listeners.cleanup()
        self.core.prompt_work.close()
        for w in self.registry.workers.values():
            if w.channel is not None:
                await w.channel.close()
        for server in self._servers.values():
            await server.stop(None)

    def sample(self, name: str, **labels) -> float | None:
        """The router's metric sample `name` with `labels` (None when it has none)."""
        return sample_value(self.core.metrics.registry, name, **labels)

    async def __aenter__(self) -> RouterHarness:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()


async def completion(h: RouterHarness, body: dict | None = None, session: aiohttp.ClientSession | None = None) -> dict:
    """A completion through the router's HTTP API (`body`: by default 4 tokens after a 3-token prompt; `session`: by
    default one of its own), which must answer 200; its JSON body."""
    async with contextlib.AsyncExitStack() as stack:
        s = session or await stack.enter_async_context(aiohttp.ClientSession())
        async with s.post(h.http_url + "/v1/completions", json=body or {"prompt": [5, 6, 7], "max_tokens": 4}) as r:
            assert r.status == 200, await r.text()
            return await r.json()
