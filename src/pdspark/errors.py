"""Exceptions by audience.

- `ConfigError` (a `ValueError`): a checkpoint or engine setting we do not support; the message names the key
  and the allowed values.
- `InvalidRequestError` (a `ValueError`): a request a caller built wrongly (empty prompt, bad sampling values).
- `CapacityError`: a request that can never fit in the configured memory, however long it waits.
- `CheckpointError`: a weight directory that is missing tensors or holds tensors of the wrong shape.
- `MissingExtraError` (an `ImportError`): a command or class that needs an optional extra which is not installed;
  the message names the extra and its pip line.

Internal invariants use `assert`.
"""

from __future__ import annotations

import enum


class PdsparkError(Exception):
    """Base class of every error pdspark raises on purpose."""


class ConfigError(PdsparkError, ValueError):
    """An unsupported or inconsistent configuration value."""


class InvalidRequestError(PdsparkError, ValueError):
    """A request that cannot be served as given; `field` names the offending parameter when there is one."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field


class CapacityError(PdsparkError):
    """A request larger than the pools could ever hold."""


class CheckpointError(PdsparkError):
    """A checkpoint directory that does not match its config."""


class WorkerGroupError(PdsparkError, RuntimeError):
    """A rank of a worker group failed, exited or hung past the group's timeout: the group cannot go on (its
    ranks no longer hold the same state); start a new one."""


class ExpertExchangeError(PdsparkError, RuntimeError):
    """A C step's expert exchange (expert parallelism) reported a failure: a collective of the rank group failed or
    timed out (raised from the collective's own error, `pdspark.parallel.slot_exchange.exchange_errors`)."""


class MissingExtraError(PdsparkError, ImportError):
    """What was asked for needs an optional extra (`pdspark[engine]`) whose packages are not installed."""


def check_choice(name: str, value: object, allowed: tuple | list | set) -> None:
    """Raise `ConfigError` naming `name` unless `value` is one of `allowed`."""
    if value not in allowed:
        choices = ", ".join(repr(a) for a in allowed)
        raise ConfigError(f"unsupported value {value!r} for `{name}`; allowed: {choices}")


class ErrorCode(enum.Enum):
    """Why a request failed, as every side of the wire reports it. Each code owns what it means to each audience:
    the HTTP status and OpenAI error `type` the router answers with, the gRPC status a service aborts a call with
    (by name, so this module needs no grpc), and whether the router may retry the request on another
    prefill/decode pair (only before its first token reached the caller). The value is the code's name in HTTP
    error bodies and metric labels. The protobuf `ErrorCode` (common.proto) carries it between processes."""

    #                  value               HTTP  gRPC status             retry  OpenAI error type
    INVALID_REQUEST = ("invalid_request", 400, "INVALID_ARGUMENT", False, "invalid_request_error")
    CAPACITY = ("capacity", 400, "INVALID_ARGUMENT", False, "invalid_request_error")  # never fits: not a 429
    INCOMPATIBLE = ("incompatible", 503, "FAILED_PRECONDITION", True, "server_error")  # another pair may match
    DEADLINE = ("deadline", 504, "DEADLINE_EXCEEDED", True, "server_error")
    TRANSFER = ("transfer", 502, "INTERNAL", True, "server_error")
    ABORTED = ("aborted", 499, "CANCELLED", False, "server_error")  # 499: nginx's "client closed request"
    UNAVAILABLE = ("unavailable", 503, "UNAVAILABLE", True, "server_error")
    # Busy, not broken: the router tries another pair, and answers 429 + Retry-After when every pair is full.
    OVERLOADED = ("overloaded", 429, "RESOURCE_EXHAUSTED", True, "rate_limit_error")
    ALREADY_EXISTS = ("already_exists", 409, "ALREADY_EXISTS", False, "invalid_request_error")
    # The router's API keys (`pdspark.router.auth.api_keys`): no key or a wrong one; a valid key without the right.
    UNAUTHENTICATED = ("unauthenticated", 401, "UNAUTHENTICATED", False, "authentication_error")
    PERMISSION_DENIED = ("permission_denied", 403, "PERMISSION_DENIED", False, "permission_error")

    def __new__(cls, value: str, http_status: int, grpc_status: str, retryable: bool, openai_type: str):
        member = object.__new__(cls)
        member._value_ = value
        member.http_status = http_status
        member.grpc_status = grpc_status
        member.retryable = retryable
        member.openai_type = openai_type
        return member

    http_status: int
    grpc_status: str  # a `grpc.StatusCode` name
    retryable: bool
    openai_type: str

    @classmethod
    def of_transport(cls, grpc_status: str) -> ErrorCode:
        """The code of a call that failed without a pdspark error attached (the peer is gone, the caller's own
        deadline passed or it cancelled): what the transport's status says about the peer."""
        if grpc_status == "DEADLINE_EXCEEDED":
            return cls.DEADLINE
        if grpc_status == "CANCELLED":
            return cls.ABORTED
        if grpc_status in ("UNAUTHENTICATED", "PERMISSION_DENIED"):
            return cls[grpc_status]  # retrying cannot help: the caller's key must change
        return cls.UNAVAILABLE


class RequestFailed(PdsparkError):
    """A request that a worker or the router could not complete, with its typed `code`."""

    def __init__(self, code: ErrorCode, message: str):
        assert isinstance(code, ErrorCode), code
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message


class Unanswered(RequestFailed):
    """A call that ended without its peer's answer: no answer before the deadline, the connection broke (the peer's
    lease lapsed), or it was unreachable. Unlike a failure the peer reported, the peer may still be acting on it."""


class NotSent(RequestFailed):
    """A call that was never made: its peer was unreachable when it was due (no connection to it), so the request
    never left this process. Unlike `Unanswered`, the peer cannot be acting on it."""


def as_request_failed(e: PdsparkError) -> RequestFailed:
    """The wire-level failure for an engine-side error."""
    if isinstance(e, RequestFailed):
        return e
    if isinstance(e, InvalidRequestError):
        return RequestFailed(ErrorCode.INVALID_REQUEST, str(e))
    if isinstance(e, CapacityError):
        return RequestFailed(ErrorCode.CAPACITY, str(e))
    return RequestFailed(ErrorCode.UNAVAILABLE, str(e))
