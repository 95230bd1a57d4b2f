"""`InProcessBackend`: both workers in one process (unit tests only): a write is a memmove between registered
regions, with the same checks the real engine makes (the destination must lie in the peer's registered memory)."""

from __future__ import annotations

import ctypes
import itertools

from pdspark.transfer.base import TransferError, Write, check_deadline

_SESSIONS: dict[str, InProcessBackend] = {}
_ids = itertools.count()


class InProcessBackend:
    def __init__(self, write_grace_s: float = 0.5) -> None:
        self._session = f"inprocess:{next(_ids)}"
        # A write is a memmove of at most a prompt's cache (milliseconds); the rest covers a thread that checked
        # the deadline and then waited for the GIL on a loaded machine.
        self._write_grace_s = write_grace_s
        self.regions: list[tuple[int, int]] = []
        _SESSIONS[self._session] = self

    @property
    def session_id(self) -> str:
        return self._session

    def register(self, addr: int, nbytes: int) -> None:
        self.regions.append((addr, addr + nbytes))

    def write(self, session: str, writes: list[Write], deadline: float | None = None) -> None:
        peer = _SESSIONS.get(session)
        if peer is None:
            raise TransferError(f"no in-process peer {session!r}")
        check_deadline(deadline, 0, len(writes))
        for w in writes:
            if not any(lo <= w.dst_addr and w.dst_addr + w.nbytes <= hi for lo, hi in peer.regions):
                raise TransferError(f"write of {w.nbytes} bytes outside {session}'s registered memory")
            if not any(lo <= w.src_addr and w.src_addr + w.nbytes <= hi for lo, hi in self.regions):
                raise TransferError(f"write of {w.nbytes} bytes from unregistered memory")
            ctypes.memmove(w.dst_addr, w.src_addr, w.nbytes)

    def write_grace_s(self, nbytes: int) -> float:
        return self._write_grace_s

    def close(self) -> None:
        _SESSIONS.pop(self._session, None)
