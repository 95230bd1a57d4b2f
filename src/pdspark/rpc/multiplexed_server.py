"""`MultiplexedServer`: a worker's side of the `Calls` stream (worker.proto): each `CallFrame` runs the servicer's
own handler of the call it stands for (`Prefill`, `Generate`), on a task of its own, as if it had come as that
gRPC call; its replies go back as `ReplyFrame`s, batched as `MultiplexedClient` batches its frames.

The handler sees a `CallContext` in place of grpc's servicer context: the call's metadata (trace context), its
time remaining (the frame's `timeout_ms`, from receipt) and `abort` (the call ends with that status, details and
trailing metadata, e.g. the typed `ErrorDetail`). An exception the handler lets out ends the call UNKNOWN, as grpc
ends it. A call is cancelled (its task, as grpc cancels a handler) when its caller sends `cancel`, when its timeout
passes, and when the stream ends: every call on a stream that goes away (the router died, or its connection broke)
is cancelled, as the calls of a broken connection are. A worker that is stopping (`stop_taking_calls`) refuses new
calls UNAVAILABLE, as a gRPC server in its grace period refuses new calls, while the running ones go on; each stream
then ends with its last call, so that the server's grace is not spent waiting for its callers to close them.

A call cancelled before its task took a step (its `cancel` came in the message that brought it: the router's caller
went away at once) never runs its handler, so none of the handler's own accounting happens: the stream drops it in
its task's done-callback, whatever the task did, and the handler's `unstarted` records its outcome (a worker counts
it `cancelled`, as it counts a call cancelled while running).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

import grpc

from pdspark.errors import ErrorCode, RequestFailed
from pdspark.rpc import status
from pdspark.rpc.multiplexed_client import batches
from pdspark.v1 import worker_pb2

logger = logging.getLogger(__name__)
# Reply frames queued for the stream's writer before a streaming call that adds one waits for it to drain: the
# flow control a call of its own has (its handler waits at a `yield` while the caller does not read), so that a
# caller that stops reading (hung, SIGSTOPped) holds up its calls instead of growing the worker's memory.
MAX_PENDING = 256


@dataclass(frozen=True)
class CallHandler:
    """The servicer method a call kind runs, and where its replies go in a `ReplyFrame`."""

    behaviour: Callable[[Any, Any], Any]  # (request, context): a coroutine (unary) or an async generator (streaming)
    reply: str  # `ReplyFrame.body` field of its replies: `prefill`, `chunk`
    streaming: bool
    # (request): a call cancelled before `behaviour` ran at all; records what `behaviour` records of a cancelled call
    unstarted: Callable[[Any], None] | None = None


class CallAborted(Exception):
    """`CallContext.abort`: the call ends with this status."""

    def __init__(self, code: grpc.StatusCode, details: str, trailing_metadata: Sequence[tuple[str, Any]]):
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details
        self.trailing_metadata = trailing_metadata


class CallContext:
    """What a servicer reads of its call's context, for a call on a `Calls` stream."""

    __slots__ = ("_metadata", "_deadline", "_stream")

    def __init__(self, metadata: tuple[tuple[str, str], ...], deadline: float | None, stream: Any):
        self._metadata = metadata
        self._deadline = deadline  # loop time
        self._stream = stream  # the stream's grpc context: the peer's identity

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._metadata

    def time_remaining(self) -> float | None:
        if self._deadline is None:
            return None
        return max(0.0, self._deadline - asyncio.get_running_loop().time())

    async def abort(self, code: grpc.StatusCode, details: str = "",
                    trailing_metadata: Sequence[tuple[str, Any]] = ()) -> NoReturn:
        raise CallAborted(code, details, trailing_metadata)

    def auth_context(self) -> Mapping[str, list[bytes]]:
        return self._stream.auth_context()

    def peer(self) -> str:
        return self._stream.peer()


class _Calls:
    """One stream's running calls and the replies waiting for the writer."""

    def __init__(self, server: MultiplexedServer, context: Any):
        self.server = server
        self.handlers = server.handlers
        self.context = context
        self.tasks: dict[int, asyncio.Task] = {}  # the running calls, by id (each dropped by its done-callback)
        self.started: set[int] = set()  # the calls in `tasks` whose task took its first step
        self.pending: list[worker_pb2.ReplyFrame] = []
        self.wake = asyncio.Event()
        self.drained = asyncio.Event()  # set whenever the writer takes the pending frames
        self.reading = True  # the caller may still send frames
        self.closed = False  # `close` ran (the stream is over)

    def reply(self, frame: worker_pb2.ReplyFrame) -> None:
        self.pending.append(frame)
        self.wake.set()

    async def read(self, frames: AsyncIterator[worker_pb2.CallFrames]) -> None:
        loop = asyncio.get_running_loop()
        try:
            async for message in frames:
                for frame in message.frames:
                    kind = frame.WhichOneof("body")
                    if kind == "cancel":
                        task = self.tasks.get(frame.call_id)
                        if task is not None:
                            task.cancel()
                        continue
                    if not self.server.taking_calls:
                        self.reply(_ended(frame.call_id, grpc.StatusCode.UNAVAILABLE, "the worker is stopping"))
                        continue
                    handler = self.handlers.get(kind) if kind is not None else None
                    if handler is None or frame.call_id in self.tasks:  # the caller's mistake: bad input
                        failure = RequestFailed(ErrorCode.INVALID_REQUEST, f"no call {kind!r} on this stream"
                                                if handler is None else f"call {frame.call_id} is running already")
                        frame_end = _ended(frame.call_id, status.status_of(failure.code), failure.message)
                        frame_end.trailing_metadata.update(status.trailers(failure))
                        self.reply(frame_end)
                        continue
                    deadline = loop.time() + frame.timeout_ms / 1000 if frame.timeout_ms else None
                    context = CallContext(tuple(frame.metadata.items()), deadline, self.context)
                    request = getattr(frame, kind)
                    task = asyncio.ensure_future(self._run(frame.call_id, handler, request, context))
                    self.tasks[frame.call_id] = task
                    # Not `_run`'s `finally`: a task cancelled before its first step (a `cancel` later in this same
                    # message) never runs it, and its entry (and request, a whole prompt) would stay for as long as
                    # the stream does.
                    task.add_done_callback(functools.partial(self._call_done, frame.call_id, handler, request))
                    if deadline is not None:
                        timer = loop.call_at(deadline, task.cancel)  # as grpc cancels a handler at its deadline
                        task.add_done_callback(functools.partial(_stop_timer, timer))
        finally:
            self.reading = False
            self.wake.set()

    async def _run(self, call_id: int, handler: CallHandler, request: Any, context: CallContext) -> None:
        self.started.add(call_id)
        try:
            if handler.streaming:
                async with contextlib.aclosing(handler.behaviour(request, context)) as replies:
                    async for reply in replies:
                        self.reply(worker_pb2.ReplyFrame(call_id=call_id, **{handler.reply: reply}))
                        while len(self.pending) >= MAX_PENDING:
                            self.drained.clear()
                            await self.drained.wait()
                self.reply(worker_pb2.ReplyFrame(call_id=call_id, end=True))
            else:
                reply = await handler.behaviour(request, context)
                self.reply(worker_pb2.ReplyFrame(call_id=call_id, end=True, **{handler.reply: reply}))
        except CallAborted as e:
            frame = _ended(call_id, e.code, e.details)
            frame.trailing_metadata.update({k: v if isinstance(v, bytes) else v.encode()
                                            for k, v in e.trailing_metadata})
            self.reply(frame)
        except asyncio.CancelledError:
            raise  # its caller cancelled it or its deadline passed (the caller ended it itself), or the stream ended
        except Exception as e:
            logger.exception("call %d on a calls stream failed", call_id)
            self.reply(_ended(call_id, grpc.StatusCode.UNKNOWN, f"Unexpected {type(e).__name__}: {e}"))

    def _call_done(self, call_id: int, handler: CallHandler, request: Any, task: asyncio.Task) -> None:
        """A call's task is over, whatever it did: drop it; one cancelled before it ran gets its outcome recorded."""
        if self.tasks.get(call_id) is task:
            del self.tasks[call_id]
        if call_id in self.started:
            self.started.discard(call_id)
        elif handler.unstarted is not None:  # cancelled before its first step: `behaviour` never saw it
            handler.unstarted(request)
        if not self.tasks:
            self.wake.set()  # the writer may be waiting for the last call to end

    def close(self) -> None:
        """Cancel every running call (the stream is over); said once in the log when there were any, with their ids."""
        if not self.closed:
            self.closed = True
            running = [call_id for call_id, task in self.tasks.items() if not task.done()]
            if running:
                logger.info("a calls stream ended with %d calls running (ids %s): cancelling them", len(running),
                            ", ".join(map(str, running)))
        for task in list(self.tasks.values()):
            task.cancel()


class MultiplexedServer:
    def __init__(self, handlers: Mapping[str, CallHandler]):
        """`handlers`: by `CallFrame.body` field (`prefill`, `generate`), what a call of that kind runs."""
        self.handlers = handlers
        self.taking_calls = True
        self.streams: set[_Calls] = set()  # the streams being served (each one's running calls: `tasks`)

    def stop_taking_calls(self) -> None:
        """From now on new calls are refused UNAVAILABLE (the worker is stopping); running calls go on, and each
        stream ends once its last call did (its caller opens a new one for its next call, which a stopping server
        refuses): a stopping worker's grace is its calls', not as long as its callers keep their streams open."""
        self.taking_calls = False
        for calls in self.streams:
            calls.wake.set()

    async def serve(self, frames: AsyncIterator[worker_pb2.CallFrames], context: Any
                    ) -> AsyncGenerator[worker_pb2.ReplyFrames, None]:
        """The `Calls` handler: until the caller goes away, or it stopped sending (or the worker stopped taking calls)
        and every call ended."""
        calls = _Calls(self, context)
        self.streams.add(calls)
        # The RPC done (its caller killed: the connection closed) cancels every call on it, as a broken connection's
        # calls are. Not left to this generator's `finally`: grpc.aio ends a handler whose caller is gone at the
        # write that fails, without closing the handler's generator, which then only closes when it is garbage-
        # collected; meanwhile a killed router's busy Generate calls ran on to their end (test_leases, SIGKILL).
        context.add_done_callback(lambda _: calls.close())
        reader = asyncio.ensure_future(calls.read(frames))
        try:
            while (calls.reading and self.taking_calls) or calls.tasks or calls.pending:
                await calls.wake.wait()
                calls.wake.clear()
                replies, calls.pending = calls.pending, []
                calls.drained.set()
                for batch in batches(replies) if replies else ():
                    yield worker_pb2.ReplyFrames(frames=batch)
            if not calls.reading:
                await reader  # its failure (a broken stream) ends the stream with it
        finally:
            self.streams.discard(calls)
            reader.cancel()
            calls.close()


def _stop_timer(timer: asyncio.TimerHandle, _: asyncio.Task) -> None:
    timer.cancel()


def _ended(call_id: int, code: grpc.StatusCode, details: str) -> worker_pb2.ReplyFrame:
    return worker_pb2.ReplyFrame(call_id=call_id, end=True, status_code=code.value[0], status_details=details)
