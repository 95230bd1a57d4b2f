"""`RankService`: what a worker runs on each other rank of its group beside the engine, and rank 0's channel to it.

A serving DP-attention group receives transfers into every rank's own pools, so each rank needs its own transfer
session (registered over its pools) and answers checksums over its own memory. The engine layer knows nothing of
transfers: the worker hands `start_engine_group` a picklable service; each rank calls `start(engine)` once its
engine is built (its result travels to rank 0, which waits for every rank's before the group is returned: a worker
serves only once every rank registered), then answers rank 0's side calls (`call(name, *args)`) on a thread of its
own, over a pipe of their own. A side call never waits behind a step (a checksum reads pages no step touches, as
the one-process worker's checksum thread does).

Every wait on a rank is bounded: a rank that exits, or does not answer within the deadline, fails the call with
`WorkerGroupError` (and the channel is then broken for good: a late answer would be taken for the next call's); a
call that raised on the rank raises `RuntimeError` naming it (the channel goes on).
"""

from __future__ import annotations

import threading
from multiprocessing.connection import Connection
from multiprocessing.connection import wait as wait_for
from typing import TYPE_CHECKING, Any, Protocol

from pdspark.errors import WorkerGroupError

if TYPE_CHECKING:
    from pdspark.engine.engine import Engine


class RankService(Protocol):
    """Picklable (it travels to the spawned ranks). Both methods run on the rank."""

    def start(self, engine: Engine) -> Any:
        """Set up beside this rank's engine; the (picklable) result goes to rank 0 (`ServiceChannel.info`)."""

    def call(self, name: str, *args: Any) -> Any:
        """Answer one of rank 0's side calls."""


class ServiceChannel:
    """Rank 0's end of one other rank's service: what its `start` returned, and side calls to it (thread-safe:
    one call at a time)."""

    def __init__(self, rank: int, conn: Connection, sentinel: Any):
        self.rank = rank
        self._conn = conn
        self._sentinel = sentinel  # the rank's process: its exit ends a wait at once
        self._lock = threading.Lock()
        self._broken: str | None = None
        self.info: Any = None

    def receive_info(self, timeout_s: float) -> Any:
        """Wait (at most `timeout_s`) for what the rank's `start` returned."""
        ok, value = self._receive("start its service", timeout_s)
        if not ok:
            raise WorkerGroupError(f"rank {self.rank} failed to start its service: {value}")
        self.info = value
        return value

    def call(self, name: str, *args: Any, timeout_s: float) -> Any:
        with self._lock:
            if self._broken is not None:
                raise WorkerGroupError(f"rank {self.rank}'s service channel is broken ({self._broken})")
            try:
                self._conn.send((name, args))
            except OSError as e:
                self._broken = f"rank {self.rank} is gone: {e}"
                raise WorkerGroupError(self._broken) from e
            ok, value = self._receive(name, timeout_s)
        if not ok:  # (the call failed there; the rank and the channel go on)
            raise RuntimeError(f"rank {self.rank}: `{name}` failed: {value}")
        return value

    def close(self) -> None:
        self._conn.close()

    def _receive(self, what: str, timeout_s: float) -> tuple[bool, Any]:
        # (A rank on another machine has no process here: its sentinel is this connection, which turns readable
        # when it closes.)
        ready = wait_for([self._conn] if self._sentinel is self._conn else [self._conn, self._sentinel],
                         timeout=timeout_s)
        if not ready:
            self._broken = f"rank {self.rank} did not {what} within {timeout_s:.0f} s"
            raise WorkerGroupError(self._broken)
        if self._conn not in ready:
            self._broken = f"rank {self.rank} exited"
            raise WorkerGroupError(self._broken)
        try:
            answer: tuple[bool, Any] = self._conn.recv()
        except EOFError as e:
            self._broken = f"rank {self.rank} closed its service channel"
            raise WorkerGroupError(self._broken) from e
        return answer


def serve_side_calls(service: RankService, engine: Engine, conn: Connection) -> None:
    """On a rank: start the service (its result, or its failure, to rank 0), then answer side calls on a daemon
    thread until rank 0 closes the channel. A failed start raises here (the rank ends)."""
    try:
        info = service.start(engine)
    except Exception as e:
        conn.send((False, f"{type(e).__name__}: {e}"))
        raise
    conn.send((True, info))

    def answer() -> None:
        while True:
            try:
                name, args = conn.recv()
            except (EOFError, OSError):
                return
            try:
                answer = (True, service.call(name, *args))
            except Exception as e:  # (the call fails, the rank goes on: a side call changes no engine state)
                answer = (False, f"{type(e).__name__}: {e}")
            try:
                conn.send(answer)
            except OSError:  # rank 0 is gone or closed the channel
                return

    threading.Thread(target=answer, name="rank-service", daemon=True).start()
