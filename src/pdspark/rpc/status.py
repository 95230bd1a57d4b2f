"""A `RequestFailed` on a gRPC call, both ways.

A service that fails a call ends it with the code's gRPC status (`ErrorCode.grpc_status`) and the message as
details, and attaches the typed failure, a serialized `ErrorDetail`, as trailing metadata under `ERROR_KEY`.
The caller reads the code back from that metadata, never from the details text; a call that failed without it
(the peer unreachable, the caller's own deadline or cancel) gets `ErrorCode.of_transport(status)`. A grpc.aio
call's own cancel never ends it with a status: `failure_from_aio_error` takes its CANCELLED for the peer's (or a
proxy's), UNAVAILABLE.
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


def failure_from_aio_error(e: grpc.RpcError) -> RequestFailed:
    """`failure_from_rpc_error` for a grpc.aio call (or a `MultiplexedCall`): a CANCELLED status without the peer's
    typed failure is UNAVAILABLE, which the router retries (or migrates, once tokens flowed).

    Such a call that its caller cancelled raises `asyncio.CancelledError`, never an error with a status, so a
    CANCELLED status is one its caller did not ask for: a proxy on the way reset the stream (RST_STREAM), or the
    peer's side cancelled the call (or the multiplexed `Calls` stream it was on). That is about this call, not the
    request: another worker can serve it. (Not for sync grpc, whose own cancel ends the call CANCELLED; the one
    error with a status that this side makes is `MultiplexedClient.close`'s, which the router never calls.)
    """
    if e.code() is grpc.StatusCode.CANCELLED and reported_failure(e) is None:
        return RequestFailed(ErrorCode.UNAVAILABLE, f"CANCELLED by the peer or a proxy: {e.details() or ''}")
    return failure_from_rpc_error(e)
