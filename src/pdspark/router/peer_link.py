"""`PeerLink`: one router process's line to the others of its group (`--processes`), through the supervisor.

What one process changes or finds on behalf of all goes out as an *ask*: the supervisor (`router_group`) sends it to
every process, the asking one included, in the one order it receives asks in, and sends the asker their answers
once all have answered (or exited). So every process applies worker additions and removals in the same order
(workers get the same names everywhere), and a request's abort reaches whichever process serves it.

Messages are small dicts over a `multiprocessing` pipe (pickled): `{"kind": "ask", "token", "op", "args"}` up and
down, `{"kind": "answer", "token", "value"}` up, `{"kind": "answers", "token", "values": {index: answer}}` down,
and once `{"kind": "ready", ...}` up (the process's ready line).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Awaitable, Callable
from multiprocessing.connection import Connection
from typing import Any

from pdspark.errors import ErrorCode, RequestFailed

logger = logging.getLogger(__name__)

Handler = Callable[[dict], Awaitable[Any]]

# An ask waits for every live process's answer: an ask's handlers do local work (a worker's first health check at
# most, bounded by the health timeout), so this only bounds a process that hangs.
ASK_TIMEOUT_S = 30.0


class PeerLink:
    def __init__(self, conn: Connection, index: int):
        self.conn = conn
        self.index = index
        self.handlers: dict[str, Handler] = {}
        self._tokens = itertools.count()
        self._waiting: dict[str, asyncio.Future] = {}
        self._tasks: set[asyncio.Task] = set()
        self.lost: Callable[[], None] | None = None  # called once the supervisor's end is closed

    def start(self) -> None:
        """Read the pipe on the running loop (call once, on it)."""
        asyncio.get_running_loop().add_reader(self.conn.fileno(), self._readable)

    def stop(self) -> None:
        asyncio.get_running_loop().remove_reader(self.conn.fileno())

    def send(self, message: dict) -> None:
        self.conn.send(message)

    async def ask(self, op: str, args: dict, timeout_s: float = ASK_TIMEOUT_S) -> dict[int, Any]:
        """`op` done by every live process of the group (this one too): their answers, by process index.

        Raises:
            RequestFailed: `UNAVAILABLE` when the answers did not all come within `timeout_s`.
        """
        token = f"{self.index}:{next(self._tokens)}"
        answer = self._waiting[token] = asyncio.get_running_loop().create_future()
        try:
            self.conn.send({"kind": "ask", "token": token, "op": op, "args": args})
            return await asyncio.wait_for(answer, timeout_s)
        except TimeoutError:
            raise RequestFailed(ErrorCode.UNAVAILABLE, f"the router's processes did not all answer {op!r} within "
                                f"{timeout_s:g} s") from None
        finally:
            self._waiting.pop(token, None)

    def _readable(self) -> None:
        try:
            message = self.conn.recv()
        except (EOFError, OSError):  # the supervisor is gone: nothing more comes
            self.stop()
            if self.lost is not None:
                self.lost()
            return
        if message["kind"] == "answers":
            waiter = self._waiting.get(message["token"])
            if waiter is not None and not waiter.done():
                waiter.set_result(message["values"])
        elif message["kind"] == "ask":
            task = asyncio.create_task(self._answer(message))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _answer(self, message: dict) -> None:
        handler = self.handlers.get(message["op"])
        try:
            value = None if handler is None else await handler(message["args"])
        except Exception:
            logger.exception("the group's ask %r failed in this process", message["op"])
            value = None
        self.conn.send({"kind": "answer", "token": message["token"], "value": value})
