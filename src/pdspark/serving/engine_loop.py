"""`EngineLoop`: runs an `Engine` on one thread; server threads reach it only through `call` and listeners.

The engine is not thread-safe, so every touch of it (adding, aborting, allocating, transferring) happens on the loop
thread, in order. Between steps the loop runs its tickers (deadline checks). A failing step never kills the
worker: the requests of that step are aborted and their listeners told.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from pdspark.engine.engine import Engine
from pdspark.types import RequestOutput

logger = logging.getLogger(__name__)
Listener = Callable[[RequestOutput], None]


class EngineLoop:
    def __init__(self, engine: Engine, idle_wait_s: float = 0.02):
        self.engine = engine
        self.idle_wait_s = idle_wait_s
        self._commands: queue.Queue[tuple[Callable[[], Any], Future]] = queue.Queue()
        self._listeners: dict[str, Listener] = {}
        self._tickers: list[Callable[[], None]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self.steps = 0

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._thread.join(timeout)

    # ---- from other threads ------------------------------------------------------------------------------------------
    def submit(self, fn: Callable[[], Any]) -> Future:
        """Run `fn` on the loop thread; the future carries its result or exception."""
        fut: Future = Future()
        self._commands.put((fn, fut))
        return fut

    def call(self, fn: Callable[[], Any], timeout: float = 30.0) -> Any:
        """`submit` and wait (bounded) for the result."""
        return self.submit(fn).result(timeout)

    def add_ticker(self, fn: Callable[[], None]) -> None:
        """Run `fn` on the loop thread between steps (at least every `idle_wait_s` while idle)."""
        self._tickers.append(fn)

    # ---- on the loop thread ------------------------------------------------------------------------------------------
    def listen(self, request_id: str, listener: Listener) -> None:
        """Deliver `request_id`'s outputs to `listener` (loop thread only)."""
        self._listeners[request_id] = listener

    def forget(self, request_id: str) -> None:
        self._listeners.pop(request_id, None)

    def _run(self) -> None:
        while not self._stop.is_set():
            self._drain(block=not self.engine.has_unfinished)
            for tick in self._tickers:
                self._guard(tick)
            if self.engine.has_unfinished:
                self._step()

    def _drain(self, block: bool) -> None:
        deadline = time.monotonic() + (self.idle_wait_s if block else 0)
        while True:
            try:
                timeout = max(0.0, deadline - time.monotonic())
                fn, fut = self._commands.get(block=block, timeout=timeout) if block else self._commands.get_nowait()
            except queue.Empty:
                return
            block = False  # after the first command, take only what is already queued
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn())
                except BaseException as e:  # handed to the caller, never raised here
                    fut.set_exception(e)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception:
            logger.exception("engine step failed; aborting the running requests")
            for req in list(self.engine.scheduler.running):
                self.engine.abort(req.req_id)
                self._deliver(self.engine.output(req))
            return
        self.steps += 1
        for out in outputs:
            self._deliver(out)

    def _deliver(self, out: RequestOutput) -> None:
        listener = self._listeners.get(out.request_id)
        if listener is not None:
            self._guard(lambda: listener(out))
            if out.finished:
                self._listeners.pop(out.request_id, None)

    @staticmethod
    def _guard(fn: Callable[[], None]) -> None:
        try:
            fn()
        except Exception:
            logger.exception("engine-loop callback failed")
