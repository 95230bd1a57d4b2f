"""`create_backend`: a transfer backend by name. Backends import their heavy dependencies only when created."""

from __future__ import annotations

from pdspark.errors import ConfigError
from pdspark.transfer.base import TransferBackend

BACKENDS = ("mooncake", "inprocess")


def create_backend(name: str, host: str = "127.0.0.1", protocol: str = "tcp", device: str = "") -> TransferBackend:
    """`mooncake` (the Mooncake Transfer Engine; TCP by default, `rdma` when configured, on the NICs `device` names,
    all when empty) or `inprocess` (tests)."""
    if name == "mooncake":
        from pdspark.transfer.mooncake_backend import MooncakeBackend

        return MooncakeBackend(host, protocol, device)
    if name == "inprocess":
        from pdspark.transfer.inprocess_backend import InProcessBackend

        return InProcessBackend()
    raise ConfigError(f"unsupported transfer backend {name!r}; allowed: {', '.join(BACKENDS)}")
