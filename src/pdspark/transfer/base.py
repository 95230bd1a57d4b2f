"""The transfer interface the workers use to write bytes into a peer's registered memory.

Contract:
- `register(addr, nbytes)` once per pool at start-up, on both sides (sources and destinations).
- `session_id` names this side; a peer writes into our memory by naming it.
- `write(session, writes, deadline)` copies every `(src_addr, dst_addr, nbytes)` (src local, dst in the peer's
  registered memory) and returns only when all bytes landed; raises `TransferError` if anything failed. It blocks
  (callers run it on a transfer thread, never on the engine or asyncio thread) and starts no batch of writes after
  `deadline` (`time.monotonic()` seconds; None: no deadline); a batch in flight ends within the backend's own
  timeout. Safe to call from several threads at once.
- `write_grace_s(nbytes)`: that timeout, for a transfer of `nbytes`: how long after the deadline a write that
  started before it may still land. The decode side keeps a transfer's pages that long when the prefill side did
  not answer (it assumes the pair runs one backend with one setting, as a deployment does).
"""

from __future__ import annotations

import time
from typing import NamedTuple, Protocol

from pdspark.errors import PdsparkError


class TransferError(PdsparkError):
    """The transfer engine could not move the bytes."""


def check_deadline(deadline: float | None, done: int, total: int) -> None:
    """Raise `TransferError` when `deadline` has passed, before a backend starts the next batch of writes."""
    if deadline is not None and time.monotonic() >= deadline:
        raise TransferError(f"deadline passed after {done} of {total} writes; the rest were not started")


class Write(NamedTuple):
    src_addr: int
    dst_addr: int
    nbytes: int


class TransferBackend(Protocol):
    @property
    def session_id(self) -> str: ...

    def register(self, addr: int, nbytes: int) -> None: ...

    def write(self, session: str, writes: list[Write], deadline: float | None = None) -> None: ...

    def write_grace_s(self, nbytes: int) -> float: ...

    def close(self) -> None: ...
