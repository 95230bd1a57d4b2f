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
