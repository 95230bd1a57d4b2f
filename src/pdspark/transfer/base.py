"""The transfer interface the workers use to write bytes into a peer's registered memory.

Contract:
- `register(addr, nbytes)` once per pool at start-up, on both sides (sources and destinations).
- `session_id` names this side; a peer writes into our memory by naming it.
- `write(session, writes)` copies every `(src_addr, dst_addr, nbytes)` (src local, dst in the peer's registered
  memory) and returns only when all bytes landed; raises `TransferError` if anything failed.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

from pdspark.errors import PdsparkError


class TransferError(PdsparkError):
    """The transfer engine could not move the bytes."""


class Write(NamedTuple):
    src_addr: int
    dst_addr: int
    nbytes: int


class TransferBackend(Protocol):
    @property
    def session_id(self) -> str: ...

    def register(self, addr: int, nbytes: int) -> None: ...

    def write(self, session: str, writes: list[Write]) -> None: ...

    def close(self) -> None: ...
