"""Stub prefill and decode workers (grpc.aio, no model) for router tests and benchmarks.

They answer at once, or on cue, per call (`script`, then `mode`): `HOLD` (answer once `release` is set), `HANG`
(never answer), a `RequestFailed` (fail the call with it, typed trailer included, as a worker does), `CANCEL` (end
it with status CANCELLED and no typed failure, as a proxy resetting it or the worker's side cancelling it does), or
`Delayed(seconds, mode)`. They record what reached them: each call's worker-side request id and the timeout it
carried, the calls cancelled under them, the ids `Abort` named. A decode stub streams `tokens` chunks whose text
is the request id it was sent, so a client can tell whose tokens it got; it never answers a request paired with
a prefill address in `hang_with` (as a real one waits for a transfer that prefill worker never starts).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import contextvars
from collections.abc import AsyncGenerator
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdspark.errors import ErrorCode, RequestFailed
from pdspark.rpc import status
from pdspark.rpc.keepalive import SERVER_OPTIONS  # accept the router's pings as a worker does
from pdspark.rpc.multiplexed_server import CallContext, CallHandler, MultiplexedServer
from pdspark.v1 import common_pb2, worker_pb2, worker_pb2_grpc

OK, HOLD, HANG, CANCEL = "ok", "hold", "hang", "cancel"


class _CallsStream:
    """A stub's `Calls` stream: its grpc context (what `CANCEL` ends, for a call on it) and the chunks it wrote."""

    def __init__(self, context) -> None:
        self.context = context
        self.written: collections.Counter[str] = collections.Counter()  # chunks written, by request id
        self.wrote = asyncio.Event()

    async def serve(self, server: MultiplexedServer, request_iterator
                    ) -> AsyncGenerator[worker_pb2.ReplyFrames, None]:
        _CALLS_STREAM.set(self)  # the stream's call tasks inherit it
        async with contextlib.aclosing(server.serve(request_iterator, self.context)) as replies:
            async for message in replies:
                yield message  # back here once grpc.aio wrote it
                for frame in message.frames:
                    if frame.HasField("chunk"):
                        self.written[frame.chunk.request_id] += 1
                self.wrote.set()

    async def written_out(self, request_id: str, chunks: int) -> None:
        while self.written[request_id] < chunks:
            self.wrote.clear()
            await self.wrote.wait()


# The `Calls` stream a multiplexed call came on (its call tasks inherit it from the stream's handler).
_CALLS_STREAM: contextvars.ContextVar[_CallsStream] = contextvars.ContextVar("calls_stream")



@dataclass(frozen=True)
class Delayed:
    seconds: float
    mode: str | RequestFailed


Mode = str | RequestFailed | Delayed


@dataclass(frozen=True)
class Call:
    request_id: str
    timeout_s: float | None  # the caller's deadline as it arrived (relative)
    prompt_token_ids: tuple[int, ...] = ()
    generated_token_ids: tuple[int, ...] = ()  # a decode call's (a migrated stream's tokens so far)
    traceparent: str = ""  # the W3C trace context the call carried (tracing on)


class _Stub:
    def __init__(self) -> None:
        self.mode: Mode = OK
        self.script: list[Mode] = []  # modes for the next calls, in order; then `mode`
        self.release = asyncio.Event()
        self.load_mode: str = OK  # GetLoad: OK or HANG
        self.calls: list[Call] = []
        self.cancelled: list[str] = []
        self.aborted: list[str] = []
        self.answered: list[str] = []  # the calls that returned their answer (Prefill)
        self.running = 0

    def _next_mode(self, request, context) -> Mode:
        traceparent = dict(context.invocation_metadata() or ()).get("traceparent", "")
        self.calls.append(Call(request.request_id, context.time_remaining(), tuple(request.prompt_token_ids),
                               tuple(getattr(request, "generated_token_ids", ())), traceparent))
        return self.script.pop(0) if self.script else self.mode

    async def _wait(self, mode: Mode, request_id: str, context, sent: int = 0) -> None:
        """Wait as `mode` says; fail the call if it is a failure (`sent`: the chunks it streamed before). Records a
        cancel of the call."""
        try:
            if isinstance(mode, Delayed):
                await asyncio.sleep(mode.seconds)
                mode = mode.mode
            if isinstance(mode, RequestFailed):
                await status.abort_async(context, mode)
            if mode == CANCEL:
                await _end_cancelled(context, request_id, sent)
            if mode == HOLD:
                await self.release.wait()
            elif mode == HANG:
                await asyncio.get_running_loop().create_future()
        except asyncio.CancelledError:
            self.cancelled.append(request_id)
            raise

    def _unstarted(self, request) -> None:
        """A multiplexed call cancelled before its handler ran: cancelled under this stub all the same."""
        self.cancelled.append(request.request_id)

    async def Abort(self, request, context):
        self.aborted.append(request.request_id)
        return worker_pb2.AbortResponse(found=False)

    async def GetLoad(self, request, context):
        if self.load_mode == HANG:
            await asyncio.get_running_loop().create_future()
        return worker_pb2.LoadReport(running=self.running, metrics_url="http://stub/metrics")


class StubPrefill(_Stub, worker_pb2_grpc.PrefillWorkerServicer):
    def __init__(self) -> None:
        super().__init__()
        self.calls_server = MultiplexedServer({"prefill": CallHandler(self.Prefill, "prefill", streaming=False,
                                                                      unstarted=self._unstarted)})

    async def Calls(self, request_iterator, context):  # Prefill calls multiplexed, as a worker takes them
        async with contextlib.aclosing(_CallsStream(context).serve(self.calls_server, request_iterator)) as replies:
            async for message in replies:
                yield message

    async def Prefill(self, request, context):
        await self._wait(self._next_mode(request, context), request.request_id, context)
        self.answered.append(request.request_id)
        return worker_pb2.PrefillResponse(result=worker_pb2.TransferResult(transfer_id=request.transfer_id,
                                                                           first_token_id=9))


class StubDecode(_Stub, worker_pb2_grpc.DecodeWorkerServicer):
    def __init__(self, tokens: int = 4, delay_s: float = 0.0):
        super().__init__()
        self.tokens = tokens
        self.delay_s = delay_s  # between tokens
        self.hang_with: set[str] = set()  # prefill addresses whose transfers never come
        # Per call, in order: the stream breaks (UNAVAILABLE, as a worker that died) after this many chunks;
        # (n, mode): it does as `mode` says there instead (HANG: it stalls, as a stopped worker's stream; CANCEL: it
        # ends CANCELLED).
        self.breaks: list[int | tuple[int, str]] = []
        self.calls_server = MultiplexedServer({"generate": CallHandler(self.Generate, "chunk", streaming=True,
                                                                       unstarted=self._unstarted)})

    async def Calls(self, request_iterator, context):  # Generate calls multiplexed, as a worker takes them
        async with contextlib.aclosing(_CallsStream(context).serve(self.calls_server, request_iterator)) as replies:
            async for message in replies:
                yield message

    async def Generate(self, request, context):
        mode = self._next_mode(request, context)
        if request.prefill_address in self.hang_with:
            mode = HANG
        self.running += 1
        stop_at = self.breaks.pop(0) if self.breaks else None
        try:
            await self._wait(mode, request.request_id, context)
            # A migrated stream continues the numbering: the client sees 0 .. tokens - 1 once each.
            for n, i in enumerate(range(len(request.generated_token_ids), self.tokens)):
                if n and self.delay_s:
                    await asyncio.sleep(self.delay_s)
                if isinstance(stop_at, tuple) and n == stop_at[0]:
                    await self._wait(stop_at[1], request.request_id, context, sent=n)
                elif n == stop_at:
                    await status.abort_async(context, RequestFailed(ErrorCode.UNAVAILABLE, "stub decode died"))
                last = i == self.tokens - 1
                yield worker_pb2.GenerateChunk(
                    request_id=request.request_id, token_ids=[i], text=request.request_id + ";", finished=last,
                    finish_reason=common_pb2.FINISH_REASON_LENGTH if last else common_pb2.FINISH_REASON_UNSPECIFIED)
        except asyncio.CancelledError:
            if request.request_id not in self.cancelled:
                self.cancelled.append(request.request_id)
            raise
        finally:
            self.running -= 1


async def _end_cancelled(context, request_id: str, sent: int) -> None:
    """End the call, which streamed `sent` chunks, with status CANCELLED and no typed failure: what a proxy's
    RST_STREAM or the worker's side cancelling the call sends. A multiplexed call's whole `Calls` stream ends so,
    as one is reset or cancelled (a worker-side cancel of one multiplexed call sends nothing), once the call's
    chunks were written: every call on it ends with that status at the router, and this one waits here for the
    stream's end to cancel it."""
    if not isinstance(context, CallContext):  # a gRPC call of its own: its chunks were written at each `yield`
        await context.abort(grpc.StatusCode.CANCELLED, "cancelled on the worker's side")
    stream = _CALLS_STREAM.get()
    await stream.written_out(request_id, sent)
    with contextlib.suppress(grpc.aio.AbortError):  # raised here: the stream is over
        await stream.context.abort(grpc.StatusCode.CANCELLED, "cancelled on the worker's side")
    await asyncio.get_running_loop().create_future()


class StubHealth(health_pb2_grpc.HealthServicer):
    """The standard health service; `mode` HANG never answers (a hung worker), anything else but OK answers
    NOT_SERVING."""

    def __init__(self) -> None:
        self.mode = OK

    async def Check(self, request, context):
        if self.mode == HANG:
            await asyncio.get_running_loop().create_future()
        serving = health_pb2.HealthCheckResponse.SERVING if self.mode == OK else \
            health_pb2.HealthCheckResponse.NOT_SERVING
        return health_pb2.HealthCheckResponse(status=serving)


async def serve_stub(stub: StubPrefill | StubDecode, port: int = 0, host: str = "127.0.0.1"
                     ) -> tuple[grpc.aio.Server, StubHealth, str]:
    """Serve `stub` and a `StubHealth` on `host` (any free port); returns (server, health, address)."""
    # No SO_REUSEPORT: the port is this stub's alone (another process's listener on it would take its calls).
    server = grpc.aio.server(options=(*SERVER_OPTIONS, ("grpc.so_reuseport", 0)))
    if isinstance(stub, StubPrefill):
        worker_pb2_grpc.add_PrefillWorkerServicer_to_server(stub, server)
    else:
        worker_pb2_grpc.add_DecodeWorkerServicer_to_server(stub, server)
    health = StubHealth()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    port = server.add_insecure_port(f"{host}:{port}")
    await server.start()
    return server, health, f"{host}:{port}"
