"""`TransferWriter`: a prompt's held pages written into a decode worker's memory, with their source checksum, on
threads of its own, and given up on when the transfer engine stays blocked past the deadline and its grace.

Threads: reading the pages and writing them runs on the transfer executor, never on the engine or asyncio thread;
the source checksum runs on a pool of its own while the writes run (zlib and the transfer engine both release the
GIL), so a transfer takes the longer of the two, not their sum. A checksum task never waits for anything, so the
transfer threads that wait for it cannot deadlock with it.

Stuck writes: a write given up on (past the deadline and the backend's grace) still holds its transfer thread until
the peer answers. `stuck` counts those (on the asyncio thread), from the moment the bound passed until the thread is
free again; once they hold every thread (`all_stuck`), a new write would only queue behind them.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass

from pdspark.cache.req_pages import ReqPages
from pdspark.errors import ErrorCode, Unanswered
from pdspark.transfer.base import TransferBackend
from pdspark.transfer.plan import BufferDesc, TransferPlan
from pdspark.transfer.transfer_plan import WriteList, plan_nbytes, plan_writes, source_checksum

logger = logging.getLogger(__name__)
TRANSFER_THREADS = 4
# The source checksum of a prompt's cache (at most a few MB of CRC32) ends well within this.
_CHECKSUM_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class Written:
    writes: WriteList
    checksum: int
    write_s: float  # inside the backend's write calls


class TransferWriter:
    def __init__(self, backend: TransferBackend, buffers: list[BufferDesc], executor: Executor | None = None,
                 threads: int = TRANSFER_THREADS):
        """`executor`: the transfer threads, `threads` of them (made here when None)."""
        self.backend = backend
        self.buffers = buffers
        self.threads = threads
        self._executor = executor or ThreadPoolExecutor(threads, thread_name_prefix="transfer")
        self._checksums = ThreadPoolExecutor(threads, thread_name_prefix="checksum")  # one per transfer thread
        self.stuck = 0  # writes given up on whose thread is still busy (asyncio thread; see the module doc)
        self.on_stuck: list[Callable[[], None]] = []  # told on the asyncio thread each time `stuck` changes

    @property
    def all_stuck(self) -> bool:
        """Every transfer thread is held by a stuck write: no write can start until a peer answers."""
        return self.stuck >= self.threads

    async def write(self, transfer_id: str, plan: TransferPlan, pages: ReqPages, deadline_at: float) -> Written:
        """Write `pages` (held until this returns) as `plan` says; no batch of writes starts after `deadline_at`.
        Raises `Unanswered` when the writes are still running once the backend's grace after the deadline passed:
        they are stuck then (the transfer engine's first contact with a peer, its handshake, waits without a timeout
        for a peer that stopped), and may still land when the peer answers; their thread stays blocked until then.
        Other failures of the backend are raised as they are."""
        started = threading.Event()  # set by the transfer thread that takes the write
        write = asyncio.get_running_loop().run_in_executor(self._executor, self._write, plan, pages, deadline_at,
                                                           started)
        stuck_at = deadline_at + self.backend.write_grace_s(plan_nbytes(plan))
        try:
            return await asyncio.wait_for(asyncio.shield(write), max(0.0, stuck_at - time.monotonic()))
        except TimeoutError:
            write.add_done_callback(_consume)
            # One still queued behind busy threads holds none, and starts no write when it runs (the deadline
            # passed): only a write a thread took is stuck, until that thread is free.
            if started.is_set():
                self._count_stuck(+1)
                write.add_done_callback(lambda _: self._count_stuck(-1))
            logger.warning("transfer %s: writes still blocked in the transfer engine after the deadline and its "
                           "grace; given up on (a transfer thread stays blocked until the peer answers)", transfer_id)
            raise Unanswered(ErrorCode.TRANSFER, f"transfer {transfer_id!r}: writes blocked past the deadline and "
                                                 "the transfer engine's grace; given up on") from None

    def close(self) -> None:
        """Stop the checksum threads (a transfer still writing finishes its checksum first)."""
        self._checksums.shutdown(wait=False)

    def _count_stuck(self, change: int) -> None:
        self.stuck += change
        for listener in self.on_stuck:
            listener()

    def _write(self, plan: TransferPlan, pages: ReqPages, deadline_at: float, started: threading.Event) -> Written:
        """Transfer thread: returns only once both the writes and the checksum stopped reading the pages, whatever
        happened."""
        started.set()
        writes = plan_writes(self.buffers, plan, pages)
        checksum = self._checksums.submit(source_checksum, self.buffers, plan, pages)
        t0 = time.monotonic()
        try:
            self.backend.write(plan.session, writes.writes, deadline_at)
        finally:
            write_s = time.monotonic() - t0
            crc = checksum.result(_CHECKSUM_TIMEOUT_S)
        return Written(writes, crc, write_s)


def _consume(fut: asyncio.Future) -> None:
    """Mark a future's outcome as read (writes given up on)."""
    if not fut.cancelled():
        fut.exception()
