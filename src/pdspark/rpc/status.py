"""gRPC status codes for `RequestFailed` codes, in one place."""

from __future__ import annotations

import grpc

from pdspark.errors import RequestFailed

STATUS_OF = {
    "INVALID_REQUEST": grpc.StatusCode.INVALID_ARGUMENT,
    "INCOMPATIBLE": grpc.StatusCode.FAILED_PRECONDITION,
    "DEADLINE": grpc.StatusCode.DEADLINE_EXCEEDED,
    "CAPACITY": grpc.StatusCode.RESOURCE_EXHAUSTED,
    "TRANSFER": grpc.StatusCode.INTERNAL,
    "ABORTED": grpc.StatusCode.CANCELLED,
    "UNAVAILABLE": grpc.StatusCode.UNAVAILABLE,
}
CODE_OF = {status: code for code, status in STATUS_OF.items()}


def failure_from_rpc_error(e: grpc.RpcError) -> RequestFailed:
    """A peer's gRPC error as a `RequestFailed` (the message carries the peer's code when it sent one)."""
    details = e.details() or ""
    code = details.split(":", 1)[0]
    if code in RequestFailed.CODES:
        return RequestFailed(code, details.split(":", 1)[1].strip())
    return RequestFailed(CODE_OF.get(e.code(), "UNAVAILABLE"), f"{e.code().name}: {details}")
