"""`AuthInterceptor`: every call to the router's gRPC `Router` service is checked against its keys (`ApiKeys`)
before the call's handler runs, from the `authorization` metadata (`Bearer <key>`). A refused call ends with
UNAUTHENTICATED or PERMISSION_DENIED and the typed `ErrorDetail` trailer, as every pdspark failure does. The
standard health service and reflection stay open, for probes and tools.

NOTE: no key is ever logged: a refusal logs (at debug level) the method and the peer only, and counts in
`pdspark_router_auth_failures_total`.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence

import grpc

from pdspark.errors import ErrorCode, RequestFailed
from pdspark.router.auth.api_keys import Access, ApiKeys
from pdspark.router.router_metrics import RouterMetrics
from pdspark.rpc import status
from pdspark.v1 import router_pb2

logger = logging.getLogger(__name__)

AUTHORIZATION_KEY = "authorization"  # gRPC metadata keys are lower case
# The method prefix of the calls that need a key: `/pdspark.v1.Router/Generate`, ...
_PROTECTED = f"/{router_pb2.DESCRIPTOR.services_by_name['Router'].full_name}/"


def authorization_of(metadata: Sequence[tuple[str, str | bytes]] | None) -> str | None:
    """The `authorization` metadata value of a call, if it has one."""
    for key, value in metadata or ():
        if key == AUTHORIZATION_KEY:
            return value.decode(errors="replace") if isinstance(value, bytes) else value
    return None


class AuthInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, keys: ApiKeys, metrics: RouterMetrics):
        self.keys = keys
        self.metrics = metrics

    async def intercept_service(self, continuation: Callable[[grpc.HandlerCallDetails],
                                                             Awaitable[grpc.RpcMethodHandler]],
                                details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        method: str = details.method
        if handler is None or not method.startswith(_PROTECTED):
            return handler
        caller = self.keys.identify(authorization_of(details.invocation_metadata))
        failure = self.keys.refusal(caller, Access.GENERATE)
        if failure is None:
            return handler
        unauthenticated = failure.code is ErrorCode.UNAUTHENTICATED
        reason = ("invalid_key" if caller.presented else "missing_key") if unauthenticated else "forbidden"
        self.metrics.auth_failures.labels(api="grpc", reason=reason).inc()
        logger.debug("refused %s: %s", method, reason)
        return _refusing(handler, failure)


def _refusing(handler: grpc.RpcMethodHandler, failure: RequestFailed) -> grpc.RpcMethodHandler:
    """A handler of the same shape as `handler` that ends every call with `failure`."""
    codec = {"request_deserializer": handler.request_deserializer,
             "response_serializer": handler.response_serializer}
    if handler.response_streaming:
        async def refuse_stream(request_or_iterator, context):
            await status.abort_async(context, failure)
            yield  # unreachable: makes this an async generator, the shape of a streaming handler

        if handler.request_streaming:
            return grpc.stream_stream_rpc_method_handler(refuse_stream, **codec)
        return grpc.unary_stream_rpc_method_handler(refuse_stream, **codec)

    async def refuse(request_or_iterator, context):
        await status.abort_async(context, failure)

    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(refuse, **codec)
    return grpc.unary_unary_rpc_method_handler(refuse, **codec)
