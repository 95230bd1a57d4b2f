"""`OutputStream`: one request's outputs, from the engine-loop thread to the coroutine that streams them.

Outputs are cumulative (each carries every token so far), so only the latest matters: the engine thread stores
it and wakes the reader through the asyncio loop (`call_soon_threadsafe`, at most one wake-up in flight), and a
reader that falls behind skips straight to the newest. The engine thread never blocks on a slow reader, and a
reader holds no thread while it waits.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading

from pdspark.types import RequestOutput


class OutputStream:
    def __init__(self, loop: asyncio.AbstractEventLoop):
        self._loop = loop
        self._lock = threading.Lock()  # `_latest` and `_wake_pending` are shared with the engine thread
        self._latest: RequestOutput | None = None
        self._wake_pending = False
        self._ready = asyncio.Event()  # asyncio side only

    def put(self, out: RequestOutput) -> None:
        """Engine thread (a listener): publish `out` and wake the reader."""
        with self._lock:
            self._latest = out
            if self._wake_pending:
                return
            self._wake_pending = True
        # RuntimeError: the asyncio loop has closed (the worker is stopping), so nobody is reading.
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(self._ready.set)

    async def next(self, timeout_s: float) -> RequestOutput:
        """The newest output not read yet; raises `TimeoutError` after `timeout_s` without one."""
        while True:
            await asyncio.wait_for(self._ready.wait(), timeout_s)
            self._ready.clear()
            with self._lock:
                out, self._latest, self._wake_pending = self._latest, None, False
            if out is not None:
                return out
