"""The router's HTTP application in-process, over a fake dispatcher (no workers, no model): what the HTTP layer
does with a request, its errors and its schema, measured without the rest of the cluster."""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass, field

from aiohttp import web

from pdspark.assets import resolve_model
from pdspark.config import RouterConfig
from pdspark.errors import ErrorCode, RequestFailed
from pdspark.model.model_config import ModelConfig
from pdspark.options import build
from pdspark.router.http_api import build_app
from pdspark.router.pair_attempt import DispatchChunk
from pdspark.router.router_core import RouterCore
from pdspark.router.router_metrics import RouterMetrics
from pdspark.router.workers.worker_registry import WorkerRegistry
from pdspark.rpc import convert
from pdspark.testing.time_scale import scaled
from pdspark.types import FinishReason, SamplingParams
from pdspark.v1 import worker_pb2

# Prompts that start with these token ids make the fake dispatcher fail unexpectedly (a bug, not a `RequestFailed`):
# before its first chunk, or after it.
FAIL_AT_ONCE = 13
FAIL_MID_STREAM = 14
HANG_AFTER_FIRST = 15  # one chunk, then nothing until the request is cancelled (`FakeDispatcher.hung_closed`)


@dataclass
class FakeDispatcher:
    """Answers every request with `min(max_tokens, 3)` chunks of one token ("a", id 7) each.

    Each request first goes through what the real dispatcher and a worker do with it on the wire (the decode
    worker's protobuf request, and back to `SamplingParams`), so a value the wire cannot carry fails here as it
    would in a cluster: the HTTP layer must have refused it."""

    requests: list[tuple[list[int], SamplingParams]] = field(default_factory=list)
    hung_closed: threading.Event = field(default_factory=threading.Event)

    async def generate(self, request_id, prompt_ids, params, deadline=None, aborted=None, trace=None):
        msg = worker_pb2.GenerateRequest(request_id=request_id, transfer_id="t", prompt_token_ids=prompt_ids,
                                         sampling=convert.sampling_to_pb(params), prefill_address="p:1")
        self.requests.append((list(msg.prompt_token_ids), convert.sampling_from_pb(msg.sampling)))
        so = params.structured_outputs
        if so is not None and "REFUSE" in so.spec:  # a worker's compiler refusing it
            raise RequestFailed(ErrorCode.INVALID_REQUEST, f"invalid `structured_outputs.{so.kind}`: no such thing")
        if prompt_ids[0] == FAIL_AT_ONCE:
            raise RuntimeError("a bug before the first token")
        if prompt_ids[0] == HANG_AFTER_FIRST:
            try:
                yield DispatchChunk([7], "a", [], False, None, 1, 0, "p:1", "d:1")
                await asyncio.Event().wait()
            finally:
                self.hung_closed.set()
            return
        n = min(params.max_tokens, 3)
        for i in range(n):
            if i == 1 and prompt_ids[0] == FAIL_MID_STREAM:
                raise RuntimeError("a bug after the first token")
            last = i == n - 1
            yield DispatchChunk([7], "a", [], last, FinishReason.LENGTH if last else None, i + 1, 0, "p:1", "d:1")


class RouterApp:
    """`build_app` served on 127.0.0.1 from a thread of its own (so blocking clients, the openai SDK and
    schemathesis can call it)."""

    def __init__(self, max_model_len: int = 256, **options):
        """`options`: `RouterConfig` fields (keys, limits)."""
        path = resolve_model("dsv4-tiny")
        registry = WorkerRegistry()  # no health polling: registered workers count as healthy
        registry.add("prefill", "127.0.0.1:1")
        registry.add("decode", "127.0.0.1:2")
        self.dispatcher = FakeDispatcher()
        self.core = RouterCore(path, "tiny", max_model_len, registry, self.dispatcher,  # type: ignore[arg-type]
                               RouterMetrics(), build(RouterConfig, options))
        self.vocab_size = ModelConfig.from_dir(path).vocab_size
        self.app = build_app(self.core)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.url = asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(scaled(30))

    async def _start(self) -> str:
        self.runner = web.AppRunner(self.app, handler_cancellation=True)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        return f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(scaled(30))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(scaled(10))
