"""`EngineLoop`: runs an `Engine` on one thread; other threads reach it only through `call`/`submit` (wrapped by
`EngineClient`), listeners, and the published `load`.

The engine is not thread-safe, so every touch of it (adding, aborting, allocating, handing out pages) happens on
the loop thread, in order, between steps. Between steps the loop also runs its tickers (reservations, metrics) and
publishes an immutable `EngineLoad` snapshot (`load`, one attribute assignment: readers never wait for a step).
A failing step never kills the worker: the requests of that step are aborted and their listeners told. An optional
`StepObserver` hears of every step that ran (its seconds and batch size) and of every failure, on the loop thread.

NOTE: the loop steps only while a step can make progress. When nothing can run (no requests, or only waiting ones
that do not fit because pages are held, e.g. for a transfer), it sleeps on its command queue until a command
arrives (a submit, abort, release: anything that can change the engine's state) or `idle_wait_s` passes (so
tickers still run and a blocked request is retried), and `stop()` wakes it at once.

NOTE: the hand-off. A thread waiting for a command's result (the asyncio thread of a worker, through
`EngineClient`) is woken as the command completes, but the engine thread, which holds the GIL, goes straight on to
its next step, and the waiter gets the GIL only at the next switch interval or when the step blocks: a decode
worker streamed a request's first token 0.5-3 ms after it joined the batch, behind the batch's next step. So after
a drain that completed an awaited command (`submit(..., awaited=True)`), while there is a step to run, the loop
steps aside for `HANDOFF_S` (a sleep, which releases the GIL) so that the waiter runs first (measured: 0.06-0.14
ms from the command's end to the waiter's resuming, against 0.5-3 ms). Clean-ups that nobody awaits cost nothing.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, NoReturn, Protocol

from pdspark.engine.engine import Engine
from pdspark.errors import WorkerGroupError
from pdspark.serving.engine_load import EngineLoad
from pdspark.types import RequestOutput

logger = logging.getLogger(__name__)
Listener = Callable[[RequestOutput], None]
# The load snapshot is refreshed at most this often (it walks the prefix tree); readers see it at most this much
# (plus one step or idle wait) behind.
_PUBLISH_EVERY_S = 0.01
# How long the loop steps aside after completing an awaited command (see the hand-off NOTE): long enough for a
# woken thread to take the GIL, short next to a step (~1-5 ms).
HANDOFF_S = 0.0002


class StepObserver(Protocol):
    """Told on the loop thread, between steps: keep it cheap (a histogram observation, a counter add)."""

    def on_step(self, seconds: float, batch_size: int) -> None:
        """A step ran `batch_size` (> 0) requests in `seconds`."""

    def on_error(self, stage: str) -> None:
        """`stage`: "step" (a step raised; its requests were aborted) or "callback" (a listener or ticker raised)."""


class LoopStopped(RuntimeError):
    """A command sent to an engine loop that has stopped (the worker is shutting down)."""


class EngineLoop:
    def __init__(self, engine: Engine, idle_wait_s: float = 0.02, observer: StepObserver | None = None):
        self.engine = engine
        self.idle_wait_s = idle_wait_s
        self.observer = observer
        self._commands: queue.Queue[tuple[Callable[[], Any], Future, bool]] = queue.Queue()
        self._listeners: dict[str, Listener] = {}
        self._tickers: list[Callable[[], None]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._stalled = False  # the last step could run nothing: wait for a change before stepping again
        self.steps = 0
        self._changed = False  # a command or a step ran since the last published load
        self._published_at = 0.0
        # Written only by the loop thread (taken here before it starts); read by any thread without a lock.
        self.load: EngineLoad = EngineLoad.of(engine)
        self._published_usage = engine.pool_usage()

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._commands.put((lambda: None, Future(), False))  # wake a loop that is waiting for commands
        self._thread.join(timeout)

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    # ---- from other threads ------------------------------------------------------------------------------------------
    def submit(self, fn: Callable[..., Any], *args: Any, awaited: bool = False) -> Future:
        """Run `fn(*args)` on the loop thread between steps; the future carries its result or exception
        (`LoopStopped` once the loop has stopped: nothing would ever run it). `awaited`: a thread waits for the
        result; the loop hands it the GIL before its next step (see the hand-off NOTE)."""
        fut: Future = Future()
        if self._stop.is_set():
            fut.set_exception(LoopStopped("the engine loop has stopped"))
            return fut
        self._commands.put((lambda: fn(*args), fut, awaited))
        return fut

    def call(self, fn: Callable[..., Any], *args: Any, timeout: float = 30.0, cancel_on_timeout: bool = True) -> Any:
        """Run `fn(*args)` on the loop thread and wait (at most `timeout` seconds) for its result; raises
        `TimeoutError` after that, cancelling the command if it has not started (unless `cancel_on_timeout` is
        False: then it still runs when the loop gets to it). On the loop thread itself it runs at once: we are
        between steps already, and queuing it would wait on ourselves."""
        if threading.current_thread() is self._thread:
            return fn(*args)
        fut = self.submit(fn, *args, awaited=True)
        try:
            return fut.result(timeout)
        except TimeoutError:
            if cancel_on_timeout:
                fut.cancel()
            raise

    def add_ticker(self, fn: Callable[[], None]) -> None:
        """Run `fn` on the loop thread between steps (at least every `idle_wait_s` while idle)."""
        self._tickers.append(fn)

    # ---- on the loop thread ------------------------------------------------------------------------------------------
    def listen(self, request_id: str, listener: Listener) -> None:
        """Deliver `request_id`'s outputs to `listener` (loop thread only)."""
        self._listeners[request_id] = listener

    def forget(self, request_id: str) -> None:
        self._listeners.pop(request_id, None)

    def deliver(self, out: RequestOutput) -> None:
        """Hand `out` to its request's listener (loop thread only); a finished output is the listener's last."""
        listener = self._listeners.get(out.request_id)
        if listener is not None:
            self._guard(lambda: listener(out))
            if out.finished:
                self._listeners.pop(out.request_id, None)

    def _run(self) -> None:
        while not self._stop.is_set():
            self._drain(block=self._stalled or not self.engine.has_unfinished)
            for tick in self._tickers:
                self._guard(tick)
            if self.engine.has_unfinished:
                self._step()
            else:
                self._stalled = False
            self._publish()

    def _publish(self) -> None:
        # A ticker may change the pools too (handing out a reservation): compare the page counts, which is cheap.
        now = time.monotonic()
        if now - self._published_at < _PUBLISH_EVERY_S:
            return
        if self._changed or self.engine.pool_usage() != self._published_usage:
            self._changed, self._published_at = False, now
            self.load = EngineLoad.of(self.engine)
            self._published_usage = self.engine.pool_usage()

    def _drain(self, block: bool) -> None:
        """Run the queued commands; with `block`, first wait (at most `idle_wait_s`) for one to arrive. Steps
        aside after an awaited one (the hand-off NOTE) when a step follows."""
        deadline = time.monotonic() + (self.idle_wait_s if block else 0)
        handoff = False
        while True:
            try:
                timeout = max(0.0, deadline - time.monotonic())
                fn, fut, awaited = (self._commands.get(block=block, timeout=timeout) if block
                                    else self._commands.get_nowait())
            except queue.Empty:
                break
            block = False  # after the first command, take only what is already queued
            self._stalled = False  # a command may have freed pages or added work: try a step again
            self._changed = True
            if fut.set_running_or_notify_cancel():
                handoff |= awaited
                try:
                    fut.set_result(fn())
                except BaseException as e:  # handed to the caller, never raised here
                    fut.set_exception(e)
        if handoff and self.engine.has_unfinished:
            time.sleep(HANDOFF_S)

    def _step(self) -> None:
        t0 = time.perf_counter()
        try:
            outputs = self.engine.step()
        except WorkerGroupError as e:
            exit_for_group_failure(str(e))
        except Exception:
            logger.exception("engine step failed; aborting the running requests")
            if self.observer is not None:
                self.observer.on_error("step")
            for req in list(self.engine.scheduler.running):
                self.engine.abort(req.req_id)
                self.deliver(self.engine.output(req))
            self._changed = True
            return
        self.steps += 1
        self._changed = True
        batch_size = self.engine.stats.last_batch_size
        if self.observer is not None and batch_size:
            self.observer.on_step(time.perf_counter() - t0, batch_size)
        # A step that produced nothing and left nothing running scheduled nothing (a non-empty schedule either
        # leaves its requests running or finishes them with an output): the waiting requests cannot start until
        # something changes, and only a command or the passing of time (tickers) can change it.
        self._stalled = not outputs and not self.engine.has_running
        for out in outputs:
            self.deliver(out)

    def _guard(self, fn: Callable[[], None]) -> None:
        try:
            fn()
        except Exception:
            logger.exception("engine-loop callback failed")
            if self.observer is not None:
                self.observer.on_error("callback")


# The exit status of a worker whose rank group failed (the supervisor restarts it, group and all).
GROUP_FAILED_EXIT = 3


def exit_for_group_failure(detail: str) -> NoReturn:
    """A worker group fails as a unit: rank 0 kills this machine's other ranks (its children: a stopped or hung one
    would never see its pipe close) and exits at once, and the supervisor restarts the worker, group and all. No
    other cleanup runs: the group's state is lost anyway. (Ranks on other machines end as their control connection
    closes.)"""
    logger.critical("the worker group failed, exiting for a restart: %s", detail)
    for rank in multiprocessing.active_children():
        rank.kill()
    logging.shutdown()
    os._exit(GROUP_FAILED_EXIT)
