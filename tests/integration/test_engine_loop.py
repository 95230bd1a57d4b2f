"""`EngineLoop`: the engine thread waits (bounded) when it has nothing it can run, and wakes on a command."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from conftest import MIXED
from helpers import GREEDY
from pdspark import SamplingParams
from pdspark.engine.factory import create_engine
from pdspark.serving import engine_loop
from pdspark.serving.engine_client import EngineClient
from pdspark.serving.engine_loop import HANDOFF_S, EngineLoop
from pdspark.testing.time_scale import scaled
from pdspark.types import FinishReason

# Pools of 4 full pages of 16 tokens: a 40-token prompt takes 3, so a second one cannot start while the first
# holds its pages for a transfer.
OPTS = dict(page_size=16, max_model_len=128, num_full_pages=4, max_num_seqs=2, max_num_batched_tokens=64,
            enable_prefix_cache=False)
PARAMS = SamplingParams(max_tokens=1, **GREEDY)


@pytest.fixture
def engine(checkpoints):
    path, _ = checkpoints(MIXED)
    return create_engine(str(path), **OPTS)


def test_loop_sleeps_while_the_only_request_waits_for_held_pages(engine):
    # A long idle wait: only a command (or stop) can wake the loop within the test's deadlines.
    loop = EngineLoop(engine, idle_wait_s=60.0)
    spinning = threading.Event()
    watch = {"from": None}

    def count_steps() -> None:  # ticker: runs on the loop thread once per iteration
        if watch["from"] is not None and loop.steps - watch["from"] > 20:
            spinning.set()

    loop.add_ticker(count_steps)
    loop.start()
    client = EngineClient(loop, timeout_s=scaled(30))
    try:
        held = threading.Event()
        blocked_done = threading.Event()
        asyncio.run(client.submit("held", [5] * 40, PARAMS, lambda out: out.finished and held.set(), hold_pages=True))
        assert held.wait(scaled(30)), "the first request never finished"

        asyncio.run(client.submit("blocked", [6] * 40, PARAMS, lambda out: out.finished and blocked_done.set()))
        watch["from"] = loop.steps
        # The blocked request can neither start nor fail: the loop must wait for a change, not step in a loop.
        # (Waiting here on an event with a deadline: an assertion that something does not happen needs a window.)
        assert not spinning.wait(0.5), f"the loop ran {loop.steps - watch['from']} steps with nothing to run"
        assert not blocked_done.is_set()

        client.release("held")  # a command wakes the loop at once, long before its 60 s idle wait ends
        assert blocked_done.wait(scaled(30)), "the blocked request did not run once the pages were released"
        assert engine.requests["blocked"].finish_reason == FinishReason.LENGTH
    finally:
        loop.stop(timeout=scaled(5))
    assert not loop.is_alive(), "stop() did not wake the waiting loop"


def test_a_failing_clean_up_is_logged_not_lost(engine, caplog):
    """Clean-ups are queued and never awaited: a broken invariant in one (a page freed twice, say) must reach the
    log, or a test that checks the logs for errors could never see it."""
    loop = EngineLoop(engine)
    loop.start()
    client = EngineClient(loop, timeout_s=scaled(30))
    freed = threading.Event()

    def release(request_id: str) -> None:
        freed.set()
        raise AssertionError(f"full: double free of page 3 ({request_id})")

    client._release = release  # type: ignore[method-assign]
    try:
        with caplog.at_level("ERROR", logger="pdspark.serving.engine_client"):
            client.release("r1")
            assert freed.wait(scaled(5))
            loop.call(lambda: None)  # the clean-up's done-callback ran before this command's turn
        assert "engine-loop clean-up release failed" in caplog.text and "double free of page 3 (r1)" in caplog.text
    finally:
        loop.stop(timeout=scaled(5))


class _Observer:
    """A `StepObserver` that records what the loop tells it."""

    def __init__(self) -> None:
        self.steps: list[tuple[float, int]] = []
        self.errors: list[str] = []

    def on_step(self, seconds: float, batch_size: int) -> None:
        self.steps.append((seconds, batch_size))

    def on_error(self, stage: str) -> None:
        self.errors.append(stage)


def test_the_observer_hears_every_step_with_its_batch_and_every_failure(engine):
    observer = _Observer()
    loop = EngineLoop(engine, observer=observer)
    broken = {"once": True}

    def ticker() -> None:
        if broken.pop("once", False):
            raise RuntimeError("a broken ticker")

    loop.add_ticker(ticker)
    loop.start()
    client = EngineClient(loop, timeout_s=scaled(30))
    done = [threading.Event(), threading.Event()]
    params = SamplingParams(max_tokens=3, **GREEDY)
    try:
        for i, event in enumerate(done):
            asyncio.run(client.submit(f"r{i}", [5 + i] * 20, params,
                                      lambda out, e=event: out.finished and e.set()))
        assert all(e.wait(scaled(30)) for e in done)
        steps = loop.call(lambda: loop.steps)
    finally:
        loop.stop(timeout=scaled(5))
    # Every step that ran something was observed, with the requests it ran (both fit one batch at most).
    assert 0 < len(observer.steps) <= steps and all(0 < n <= 2 and s > 0 for s, n in observer.steps)
    assert max(n for _, n in observer.steps) == 2
    assert engine.stats.generated_tokens == 6  # 3 tokens each, counted as they were appended
    assert observer.errors == ["callback"]


def test_the_loop_steps_aside_for_a_waiting_thread_only_when_a_step_follows(engine, monkeypatch):
    """After an awaited command, with a step to run next, the loop sleeps `HANDOFF_S` (releasing the GIL) so that
    the thread waiting for the result runs before that step; after a clean-up nobody awaits, or with nothing to
    step, it goes straight on."""
    naps: list[float] = []
    real_sleep = time.sleep

    def sleep(seconds: float) -> None:
        if threading.current_thread().name == "engine-loop":
            naps.append(seconds)
        real_sleep(seconds)

    monkeypatch.setattr(engine_loop.time, "sleep", sleep)
    loop = EngineLoop(engine)
    loop.start()
    client = EngineClient(loop, timeout_s=scaled(30))
    finished = threading.Event()

    def barrier() -> None:  # two un-awaited commands: the drains before them (and their own) are over
        for _ in range(2):
            loop.submit(lambda: None).result(scaled(10))

    try:
        asyncio.run(client.submit("long", [5] * 20, SamplingParams(max_tokens=40, **GREEDY),
                                  lambda out: out.finished and finished.set()))
        barrier()
        assert naps == [HANDOFF_S]  # the submit was awaited, and the request's first step came next
        assert loop.call(lambda: engine.has_unfinished), "the request ended before the test could look"
        barrier()
        assert naps == [HANDOFF_S] * 2  # this call too, with the request's next step to come
        client.abort("long")
        assert finished.wait(scaled(30))
        client.release("long")
        assert not loop.call(lambda: engine.has_unfinished)
        barrier()
        assert naps == [HANDOFF_S] * 2  # nothing to step: no nap; the clean-ups: none either
    finally:
        loop.stop(timeout=scaled(5))
