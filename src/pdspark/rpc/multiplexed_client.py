"""`MultiplexedClient`: a worker's calls of one kind (Prefill, or Generate) multiplexed on one long-lived `Calls`
stream of a channel (worker.proto), instead of one gRPC call each.

Why: a grpc.aio call costs the router about 0.4 CPU ms (call object, metadata, deadline, a completion-queue batch
per step), the worker about as much; a frame on an open stream costs a tenth of that when every frame queued
meanwhile leaves in one message (bench/bench_worker_rpc.py: 8x less router CPU at 16 requests in flight).

Each call is a `MultiplexedCall`, which offers what the router uses of grpc.aio's call objects and fails the same
way: iterate it (a streaming call's replies), `response()` (a unary call's, a future), `cancel()` and `done()`; a
failure raises `grpc.aio.AioRpcError` with the status, details and trailing metadata (the typed `ErrorDetail`) the
worker ended the call with. `timeout` is the call's deadline, kept here (DEADLINE_EXCEEDED, and the worker is told
to cancel) and sent along (the worker cancels the call at it too, as a gRPC server does).

Streams: one at a time per client, opened by the first call and again by the first call after it broke. Frames
are written by one writer task (grpc.aio takes one write at a time), every frame queued when it runs (a loop turn
after the first frame) in one message of at most `MAX_MESSAGE_BYTES` (a larger frame goes alone); one reader task
hands each reply to its call.
When the stream breaks (the worker died, stopped answering keepalive pings, or the channel was closed), every call
on it ends with the stream's status, as the calls on a broken connection do; calls made after it open a new
stream (which fails at once while the worker stays unreachable, as a call does without wait-for-ready).

NOTE: calls on one stream share its HTTP/2 flow control: a frame queues behind the frames written before it (a
long prompt's delays the next few by the time its bytes take on the wire).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections import deque
from collections.abc import Sequence
from typing import Any

import grpc

from pdspark.v1 import worker_pb2

logger = logging.getLogger(__name__)
MAX_MESSAGE_BYTES = 4 << 20  # frames batched into one message up to this size: well under the 64 MiB message limit
_STATUS_CODES = {code.value[0]: code for code in grpc.StatusCode}


class MultiplexedCall:
    """One call on a `Calls` stream: its replies as they arrive, then its end (OK, or an `AioRpcError`)."""

    __slots__ = ("_stream", "call_id", "_replies", "_waiter", "_ended", "_error", "_timer", "_response")

    def __init__(self, stream: _Stream, call_id: int):
        self._stream = stream
        self.call_id = call_id
        self._replies: deque[Any] = deque()
        self._waiter: asyncio.Future | None = None
        self._ended = False
        self._error: BaseException | None = None  # an AioRpcError, or a CancelledError once cancelled
        self._timer: asyncio.TimerHandle | None = None
        self._response: asyncio.Future | None = None  # a unary call's (`response`)

    def done(self) -> bool:
        return self._ended

    def cancel(self) -> bool:
        """End the call as cancelled (iterating it raises `asyncio.CancelledError`); the worker cancels it."""
        if self._ended:
            return False
        self._stream.send_cancel(self.call_id)
        self._end(asyncio.CancelledError())
        return True

    def __aiter__(self) -> MultiplexedCall:
        return self

    async def __anext__(self) -> Any:
        while True:
            if isinstance(self._error, asyncio.CancelledError):
                raise asyncio.CancelledError()
            if self._replies:
                return self._replies.popleft()
            if self._ended:
                if self._error is None:
                    raise StopAsyncIteration
                raise self._error
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            except asyncio.CancelledError:
                self.cancel()  # the reading task was cancelled: so is the call, as grpc.aio's
                raise
            finally:
                self._waiter = None

    def response(self) -> asyncio.Future:
        """A unary call's reply, as a future: it fails as the call does, and cancelling it cancels the call (also
        before anything awaited it, unlike a coroutine's task)."""
        if self._response is None:
            self._response = asyncio.get_running_loop().create_future()
            self._response.add_done_callback(self._response_done)
            if self._ended:
                self._settle()
        return self._response

    def _response_done(self, future: asyncio.Future) -> None:
        if future.cancelled():
            self.cancel()

    def _settle(self) -> None:
        future = self._response
        if future is None or future.done():
            return
        if self._error is None:
            future.set_result(self._replies[-1] if self._replies else None)
        elif isinstance(self._error, asyncio.CancelledError):
            future.cancel()
        else:
            future.set_exception(self._error)

    # -- fed by the stream ------------------------------------------------------------------------------------------
    def _reply(self, message: Any) -> None:
        self._replies.append(message)
        self._wake()

    def _end(self, error: BaseException | None) -> None:
        if self._ended:
            return
        self._ended, self._error = True, error
        if self._timer is not None:
            self._timer.cancel()
        self._stream.calls.pop(self.call_id, None)
        self._wake()
        self._settle()

    def _expire(self) -> None:
        if not self._ended:
            self._stream.send_cancel(self.call_id)
            self._end(grpc.aio.AioRpcError(grpc.StatusCode.DEADLINE_EXCEEDED, details="Deadline Exceeded"))

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)


class _Stream:
    """One open `Calls` stream: its calls by id, the frames waiting for the writer, the writer and reader tasks."""

    def __init__(self, call: grpc.aio.StreamStreamCall):
        self.call = call
        self.calls: dict[int, MultiplexedCall] = {}
        self.pending: list[worker_pb2.CallFrame] = []
        self.wake = asyncio.Event()
        self.broken = False
        self.tasks = (asyncio.ensure_future(self._write()), asyncio.ensure_future(self._read()))

    def send(self, frame: worker_pb2.CallFrame) -> None:
        self.pending.append(frame)
        self.wake.set()

    def send_cancel(self, call_id: int) -> None:
        if not self.broken:
            self.send(worker_pb2.CallFrame(call_id=call_id, cancel=True))

    async def _write(self) -> None:
        try:
            while True:
                await self.wake.wait()
                # One more turn of the loop before taking the queue: the frames of requests whose handlers run in
                # that turn (their bytes came in the same read of the sockets) leave in this message too. Each
                # message is a grpc.aio write: at 16 connections this halved the writes' share of the router's
                # CPU samples (18% -> 8%), for one loop turn of latency.
                await asyncio.sleep(0)
                self.wake.clear()
                frames, self.pending = self.pending, []
                for batch in batches(frames):
                    await self.call.write(worker_pb2.CallFrames(frames=batch))
        except asyncio.CancelledError:
            raise
        except Exception as e:  # the call ended (the reader ends the calls with its status) or cannot write
            if not self.call.done():
                logger.warning("a multiplexed calls stream could not write (%s): ending it", e)
                self.call.cancel()

    async def _read(self) -> None:
        error: grpc.aio.AioRpcError
        try:
            async for message in self.call:
                for frame in message.frames:
                    call = self.calls.get(frame.call_id)
                    if call is None:
                        continue  # cancelled or expired here meanwhile
                    kind = frame.WhichOneof("body")
                    if kind is not None:
                        call._reply(getattr(frame, kind))
                    if frame.end:
                        call._end(None if frame.status_code == 0 else _error_of(frame))
            error = grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE,
                                         details="the worker ended its calls stream")
        except grpc.aio.AioRpcError as e:
            error = e
        except asyncio.CancelledError:
            if self.broken or not self.call.cancelled():
                raise  # this task was cancelled (`close`)
            # Its channel was closed (the worker removed or retired): its calls fail as a dead worker's would.
            error = grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, details="the channel to the worker was closed")
        self.close(error)

    def close(self, error: grpc.aio.AioRpcError) -> None:
        """End the stream and every call on it with `error`."""
        self.broken = True
        for call in list(self.calls.values()):
            call._end(error)
        for task in self.tasks:
            if task is not asyncio.current_task():
                task.cancel()
        self.call.cancel()


class MultiplexedClient:
    def __init__(self, channel: grpc.aio.Channel, method: str):
        """`method`: the full name of a `Calls` method (`/pdspark.v1.PrefillWorker/Calls`)."""
        self._open = channel.stream_stream(method, request_serializer=worker_pb2.CallFrames.SerializeToString,
                                           response_deserializer=worker_pb2.ReplyFrames.FromString)
        self._stream: _Stream | None = None
        self._ids = itertools.count(1)

    def call(self, kind: str, request: Any, timeout: float | None = None,
             metadata: Sequence[tuple[str, str]] | None = None) -> MultiplexedCall:
        """Start a call: `kind` names the request in `CallFrame.body` (`prefill`, `generate`).

        Args:
            timeout: seconds the call may take (None: no deadline), as a gRPC call's.
            metadata: what a gRPC call would carry as metadata (string values: trace context).
        """
        stream = self._stream
        if stream is None or stream.broken:
            stream = self._stream = _Stream(self._open())
        call = MultiplexedCall(stream, next(self._ids))
        frame = worker_pb2.CallFrame(call_id=call.call_id, **{kind: request})
        if metadata:
            frame.metadata.update(metadata)
        if timeout is not None:
            # Milliseconds, rounded up: a positive timeout never reaches the worker as 0 ("none").
            frame.timeout_ms = max(1, int(timeout * 1000 + 0.999))
            call._timer = asyncio.get_running_loop().call_later(max(0.0, timeout), call._expire)
        stream.calls[call.call_id] = call
        stream.send(frame)
        return call

    @property
    def in_flight(self) -> int:
        """Calls on the stream that have not ended."""
        return 0 if self._stream is None or self._stream.broken else len(self._stream.calls)

    async def close(self) -> None:
        """End the stream (its calls end CANCELLED); a later call opens a new one."""
        if self._stream is not None and not self._stream.broken:
            self._stream.close(grpc.aio.AioRpcError(grpc.StatusCode.CANCELLED, details="the client closed"))
        self._stream = None


def batches(frames: list, max_bytes: int = MAX_MESSAGE_BYTES) -> list[list]:
    """`frames` in order, cut into runs of at most `max_bytes` serialized (a larger frame is a run of its own)."""
    if len(frames) == 1:
        return [frames]
    runs: list[list] = [[]]
    size = 0
    for frame in frames:
        n = frame.ByteSize()
        if runs[-1] and size + n > max_bytes:
            runs.append([])
            size = 0
        runs[-1].append(frame)
        size += n
    return runs


def _error_of(frame: worker_pb2.ReplyFrame) -> grpc.aio.AioRpcError:
    code = _STATUS_CODES.get(frame.status_code, grpc.StatusCode.UNKNOWN)
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(*frame.trailing_metadata.items()),
                                details=frame.status_details)
