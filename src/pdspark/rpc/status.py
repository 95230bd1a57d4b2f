"""A `RequestFailed` on a gRPC call, both ways.

A service that fails a call ends it with the code's gRPC status (`ErrorCode.grpc_status`) and the message as
details, and attaches the typed failure, a serialized `ErrorDetail`, as trailing metadata under `ERROR_KEY`.
The caller reads the code back from that metadata, never from the details text; a call that failed without it
(the peer unreachable, the caller's own deadline or cancel) gets `ErrorCode.of_transport(status)`.
"""

from __future__ import annotations

from typing import NoReturn

import grpc

from pdspark.errors import ErrorCode, RequestFailed
from pdspark.rpc import convert
from pdspark.v1 import common_pb2

ERROR_KEY = "pdspark-error-bin"  # "-bin": gRPC carries the value as bytes


def status_of(code: ErrorCode) -> grpc.StatusCode:
    return grpc.StatusCode[code.grpc_status]


def trailers(failure: RequestFailed) -> tuple[tuple[str, bytes], ...]:
    return ((ERROR_KEY, convert.failure_to_pb(failure).SerializeToString()),)


def abort(context: grpc.ServicerContext, failure: RequestFailed) -> NoReturn:
    """End a (sync) server call with `failure`."""
    context.set_trailing_metadata(trailers(failure))
    context.abort(status_of(failure.code), failure.message)
    raise AssertionError("unreachable: ServicerContext.abort raises")


async def abort_async(context: grpc.aio.ServicerContext, failure: RequestFailed) -> NoReturn:
    """End an asyncio server call with `failure`."""
    await context.abort(status_of(failure.code), failure.message, trailing_metadata=trailers(failure))
    raise AssertionError("unreachable: ServicerContext.abort raises")


def reported_failure(e: grpc.RpcError) -> RequestFailed | None:
    """The failure the peer attached to its error, or None when the call failed without one."""
    for key, value in e.trailing_metadata() or ():
        if key == ERROR_KEY:
            return convert.failure_from_pb(common_pb2.ErrorDetail.FromString(value))
    return None


def failure_from_rpc_error(e: grpc.RpcError) -> RequestFailed:
    """A failed call as a `RequestFailed`: the peer's own failure when it attached one, else the transport's."""
    reported = reported_failure(e)
    if reported is not None:
        return reported
    status: grpc.StatusCode = e.code()
    return RequestFailed(ErrorCode.of_transport(status.name), f"{status.name}: {e.details() or ''}")
