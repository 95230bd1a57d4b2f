"""`PeerRoleInterceptor`: on a worker serving mutual TLS, each control RPC is taken only from the role that makes it.

The TLS handshake already admits only peers with a certificate of the cluster's CA. A certificate may also name its
service's role (a URI SAN `urn:pdspark:role:<role>`, as `ThrowawayCA` writes them); then the call must be one that
role makes: `Prefill`, `Generate`, `Calls` (those two, multiplexed), `Abort` and `GetLoad` come from the router,
`SubmitPlan` from a decode worker. A stolen prefill worker's certificate cannot ask a decode worker for tokens, nor
a router's send a transfer plan naming memory to write. Health checks and reflection are open to every authenticated
peer. A certificate that names no role (an operator's PKI without the SAN) is trusted with every call: the CA is
then the whole boundary. A refused call ends with PERMISSION_DENIED and the typed `ErrorDetail` trailer, before its
handler runs.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Awaitable, Callable, Mapping

import grpc

from pdspark.errors import ErrorCode, RequestFailed
from pdspark.rpc import status
from pdspark.rpc.throwaway_ca import ROLE_URI_PREFIX
from pdspark.v1 import worker_pb2

logger = logging.getLogger(__name__)


def _method(service: str, name: str) -> str:
    return f"/{worker_pb2.DESCRIPTOR.services_by_name[service].full_name}/{name}"


# The role whose calls each worker RPC is: the callers the worker serves it to.
WORKER_CALLERS: dict[str, frozenset[str]] = {
    _method("PrefillWorker", "Prefill"): frozenset({"router"}),
    _method("PrefillWorker", "SubmitPlan"): frozenset({"decode"}),
    _method("PrefillWorker", "Abort"): frozenset({"router"}),
    _method("PrefillWorker", "GetLoad"): frozenset({"router"}),
    _method("PrefillWorker", "Calls"): frozenset({"router"}),
    _method("DecodeWorker", "Generate"): frozenset({"router"}),
    _method("DecodeWorker", "Abort"): frozenset({"router"}),
    _method("DecodeWorker", "GetLoad"): frozenset({"router"}),
    _method("DecodeWorker", "Calls"): frozenset({"router"}),
}


def peer_roles(auth_context: Mapping[str, list[bytes]]) -> set[str]:
    """The pdspark roles a peer's certificate names (empty: none named, or no certificate)."""
    return {uri.decode(errors="replace")[len(ROLE_URI_PREFIX):] for uri in auth_context.get("peer_uri", ())
            if uri.startswith(ROLE_URI_PREFIX.encode())}


class PeerRoleInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, callers: Mapping[str, frozenset[str]] = WORKER_CALLERS):
        self.callers = callers

    async def intercept_service(self, continuation: Callable[[grpc.HandlerCallDetails],
                                                             Awaitable[grpc.RpcMethodHandler]],
                                details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        allowed = self.callers.get(details.method)
        if handler is None or allowed is None:
            return handler
        # The peer's certificate is known only to the call's context: the check runs as the handler's first step.
        assert not handler.request_streaming or handler.response_streaming, \
            f"{details.method}: no worker RPC streams requests for one response"
        return _checked(handler, details.method, allowed)


async def _check(context: grpc.aio.ServicerContext, method: str, allowed: frozenset[str]) -> None:
    roles = peer_roles(context.auth_context())
    if roles and not roles & allowed:
        logger.warning("refused %s from a peer whose certificate names role %s (allowed: %s)", method,
                       ",".join(sorted(roles)), ",".join(sorted(allowed)))
        await status.abort_async(context, RequestFailed(
            ErrorCode.PERMISSION_DENIED, f"{method} is not taken from a {'/'.join(sorted(roles))} certificate"))


def _checked(handler: grpc.RpcMethodHandler, method: str, allowed: frozenset[str]) -> grpc.RpcMethodHandler:
    codec = {"request_deserializer": handler.request_deserializer,
             "response_serializer": handler.response_serializer}
    if handler.request_streaming:  # `Calls`: checked once for every call on the stream
        async def calls(requests, context):
            await _check(context, method, allowed)
            async with contextlib.aclosing(handler.stream_stream(requests, context)) as inner:
                async for item in inner:
                    yield item

        return grpc.stream_stream_rpc_method_handler(calls, **codec)
    if handler.response_streaming:
        async def stream(request, context):
            await _check(context, method, allowed)
            # Closed explicitly, as the servicer closes its own: a caller that goes away cancels us at a `yield`.
            async with contextlib.aclosing(handler.unary_stream(request, context)) as inner:
                async for item in inner:
                    yield item

        return grpc.unary_stream_rpc_method_handler(stream, **codec)

    async def unary(request, context):
        await _check(context, method, allowed)
        return await handler.unary_unary(request, context)

    return grpc.unary_unary_rpc_method_handler(unary, **codec)
