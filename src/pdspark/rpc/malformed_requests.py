"""`MalformedRequestInterceptor`: a request whose bytes are not a valid message of its RPC's type ends with
INVALID_ARGUMENT (and the typed `ErrorDetail` trailer), as any other bad input does, before its handler runs.

NOTE: left to itself, grpc answers such a request with UNKNOWN ("Unexpected DecodeError"), the status of a server
bug: a client could not tell its own mistake from ours, and a fuzzer could not tell either. The interceptor swaps
each unary-request handler's deserializer for one that hands a marker to the handler instead of raising, and the
handler it wraps refuses the marker. Of the streaming-request handlers, the bidirectional ones (the workers' `Calls`)
are guarded the same way, a malformed message ending the stream; reflection's keep grpc's own handling.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from pdspark.errors import ErrorCode, RequestFailed
from pdspark.rpc import status


class _Malformed:
    """What the request deserializer returns for bytes it cannot parse."""

    def __init__(self, method: str, error: Exception):
        self.failure = RequestFailed(ErrorCode.INVALID_REQUEST, f"{method}: the request is not a valid message of "
                                                                f"its type ({type(error).__name__})")


class MalformedRequestInterceptor(grpc.aio.ServerInterceptor):
    async def intercept_service(self, continuation: Callable[[grpc.HandlerCallDetails],
                                                             Awaitable[grpc.RpcMethodHandler]],
                                details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or handler.request_deserializer is None:
            return handler
        if handler.request_streaming:
            return _guarded_stream(handler, details.method) if handler.response_streaming else handler
        return _guarded(handler, details.method)


def _tolerant(parse: Callable[[bytes], Any], method: str) -> Callable[[bytes], Any]:
    def deserialize(data: bytes) -> Any:
        try:
            return parse(data)
        except Exception as e:  # DecodeError, or whatever else a parser raises on hostile bytes
            return _Malformed(method, e)

    return deserialize


def _guarded_stream(handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
    behaviour = handler.stream_stream

    async def stream(requests, context):
        async def checked():
            async for request in requests:
                if isinstance(request, _Malformed):
                    await status.abort_async(context, request.failure)  # the stream ends with it
                yield request

        async with contextlib.aclosing(behaviour(checked(), context)) as inner:
            async for item in inner:
                yield item

    return grpc.stream_stream_rpc_method_handler(stream, request_deserializer=_tolerant(
        handler.request_deserializer, method), response_serializer=handler.response_serializer)


def _guarded(handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
    codec = {"request_deserializer": _tolerant(handler.request_deserializer, method),
             "response_serializer": handler.response_serializer}
    if handler.response_streaming:
        behaviour = handler.unary_stream
        if inspect.isasyncgenfunction(behaviour):
            async def stream(request, context):
                if isinstance(request, _Malformed):
                    await status.abort_async(context, request.failure)
                # Closed explicitly, as the servicers close their own: a caller that goes away cancels at a `yield`.
                async with contextlib.aclosing(behaviour(request, context)) as inner:
                    async for item in inner:
                        yield item

            return grpc.unary_stream_rpc_method_handler(stream, **codec)

        async def writing(request, context):  # a streaming handler that writes with `context.write`
            if isinstance(request, _Malformed):
                await status.abort_async(context, request.failure)
            return await behaviour(request, context)

        return grpc.unary_stream_rpc_method_handler(writing, **codec)

    async def unary(request, context):
        if isinstance(request, _Malformed):
            await status.abort_async(context, request.failure)
        return await handler.unary_unary(request, context)

    return grpc.unary_unary_rpc_method_handler(unary, **codec)
