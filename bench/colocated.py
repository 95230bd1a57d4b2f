"""`ColocatedWorker`: the baseline disaggregation is measured against: one engine process that prefills and
decodes every request itself (no transfer), driven from the bench process over multiprocessing queues.

The engine runs on an `EngineLoop` thread in the child, as in a worker; each output crosses one queue back and is
timestamped when the bench process reads it (the P/D path timestamps gRPC messages on arrival: both include one
hop between processes).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

from pdspark.types import SamplingParams

_STARTUP_S = 300.0


@dataclass(frozen=True)
class TokenEvent:
    at: float  # time.perf_counter() in the bench process when the output arrived
    num_tokens: int  # tokens generated so far
    finished: bool


class ColocatedWorker:
    def __init__(self, model: str, options: dict, threads: int, cpus: set[int] | None = None):
        """`options`: engine keyword options (`create_engine`); `threads`: torch threads; `cpus`: pin to these."""
        ctx = mp.get_context("spawn")
        self._requests: mp.Queue = ctx.Queue()
        self._outputs: mp.Queue = ctx.Queue()
        self._proc = ctx.Process(target=_serve, args=(model, options, threads, cpus, self._requests, self._outputs),
                                 daemon=True)
        self._proc.start()
        if self._outputs.get(timeout=_STARTUP_S) != "ready":
            raise RuntimeError("the colocated worker did not start")
        self._streams: dict[str, queue.Queue[TokenEvent]] = {}
        self._lock = threading.Lock()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    @property
    def pid(self) -> int:
        assert self._proc.pid is not None
        return self._proc.pid

    def generate(self, request_id: str, prompt: list[int], params: SamplingParams,
                 timeout_s: float = 300.0) -> Iterator[TokenEvent]:
        """The request's outputs as they arrive, up to the finished one (raises `TimeoutError` past `timeout_s`)."""
        events: queue.Queue[TokenEvent] = queue.Queue()
        with self._lock:
            self._streams[request_id] = events
        self._requests.put((request_id, prompt, params))
        deadline = time.monotonic() + timeout_s
        try:
            while True:
                event = events.get(timeout=max(0.0, deadline - time.monotonic()))
                yield event
                if event.finished:
                    return
        except queue.Empty:
            raise TimeoutError(f"colocated request {request_id} unfinished after {timeout_s:.0f}s") from None
        finally:
            with self._lock:
                self._streams.pop(request_id, None)

    def stop(self) -> None:
        self._requests.put(None)
        self._proc.join(10)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(5)

    def _read(self) -> None:
        while True:
            try:
                rid, n, finished = self._outputs.get()
            except (EOFError, OSError):
                return
            at = time.perf_counter()
            with self._lock:
                events = self._streams.get(rid)
            if events is not None:
                events.put(TokenEvent(at, n, finished))


def _serve(model: str, options: dict, threads: int, cpus: set[int] | None, requests: mp.Queue,
           outputs: mp.Queue) -> None:
    """Child process: an engine loop; requests in, `(request id, tokens so far, finished)` out."""
    if cpus is not None:
        os.sched_setaffinity(0, cpus)
    from pdspark.engine.factory import create_engine
    from pdspark.serving.engine_loop import EngineLoop

    import torch

    torch.set_num_threads(threads)
    engine = create_engine(model, **options)
    loop = EngineLoop(engine)
    loop.start()
    outputs.put("ready")

    def add(rid: str, prompt: list[int], params: SamplingParams) -> None:  # loop thread
        def listener(out) -> None:
            outputs.put((rid, len(out.token_ids), out.finished))
            if out.finished:
                loop.submit(engine.release, rid)  # between steps, as the workers' clean-ups run

        engine.add_request(prompt, params, request_id=rid)
        loop.listen(rid, listener)

    while (msg := requests.get()) is not None:
        loop.submit(add, *msg)
    loop.stop()
