"""Exceptions by audience.

- `ConfigError` (a `ValueError`): a checkpoint or engine setting we do not support; the message names the key
  and the allowed values.
- `InvalidRequestError` (a `ValueError`): a request a caller built wrongly (empty prompt, bad sampling values).
- `CapacityError`: a request that can never fit in the configured memory, however long it waits.
- `CheckpointError`: a weight directory that is missing tensors or holds tensors of the wrong shape.

Internal invariants use `assert`.
"""

from __future__ import annotations


class PdsparkError(Exception):
    """Base class of every error pdspark raises on purpose."""


class ConfigError(PdsparkError, ValueError):
    """An unsupported or inconsistent configuration value."""


class InvalidRequestError(PdsparkError, ValueError):
    """A request that cannot be served as given."""


class CapacityError(PdsparkError):
    """A request larger than the pools could ever hold."""


class CheckpointError(PdsparkError):
    """A checkpoint directory that does not match its config."""


def check_choice(name: str, value: object, allowed: tuple | list | set) -> None:
    """Raise `ConfigError` naming `name` unless `value` is one of `allowed`."""
    if value not in allowed:
        choices = ", ".join(repr(a) for a in allowed)
        raise ConfigError(f"unsupported value {value!r} for `{name}`; allowed: {choices}")


class RequestFailed(PdsparkError):
    """A request that a worker could not complete, with a code shared across the wire (see `ErrorCode` in
    proto/pdspark/v1/common.proto): INVALID_REQUEST, INCOMPATIBLE, DEADLINE, CAPACITY, TRANSFER, ABORTED,
    UNAVAILABLE."""

    CODES = ("INVALID_REQUEST", "INCOMPATIBLE", "DEADLINE", "CAPACITY", "TRANSFER", "ABORTED", "UNAVAILABLE")

    def __init__(self, code: str, message: str):
        assert code in self.CODES, code
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


def as_request_failed(e: PdsparkError) -> RequestFailed:
    """The wire-level failure for an engine-side error."""
    if isinstance(e, RequestFailed):
        return e
    if isinstance(e, InvalidRequestError):
        return RequestFailed("INVALID_REQUEST", str(e))
    if isinstance(e, CapacityError):
        return RequestFailed("CAPACITY", str(e))
    return RequestFailed("UNAVAILABLE", str(e))
