"""Polling an observable condition until it holds, with a deadline (scaled by the suite's time factor): the one way
the tests wait for something another thread, task or process does, instead of sleeping; and an asyncio scenario run
with a deadline."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from pdspark.testing.time_scale import scaled

T = TypeVar("T")


def _no_detail() -> str:
    return ""


def wait_until(condition: Callable[[], Any], within_s: float, what: str,
               describe: Callable[[], str] = _no_detail, *, interval_s: float = 0.02) -> Any:
    """Poll `condition` until it returns something truthy, which is returned; fail naming `what` (and `describe()`,
    the state that explains the failure) when it has not held within `within_s` (scaled)."""
    limit = scaled(within_s)
    deadline = time.monotonic() + limit
    while not (value := condition()):
        assert time.monotonic() < deadline, f"{what}: not within {limit:.3g} s {describe()}".rstrip()
        time.sleep(interval_s)
    return value


def seen_at(condition: Callable[[], Any], within_s: float, what: str,
            describe: Callable[[], str] = _no_detail) -> float:
    """`wait_until`, returning the `time.monotonic()` at which `condition` was first seen to hold (an upper bound of
    when it began to: compare it with a lower bound, e.g. a deadline the thing must not happen before)."""
    wait_until(condition, within_s, what, describe=describe)
    return time.monotonic()


def seconds_until(condition: Callable[[], Any], within_s: float, what: str,
                  describe: Callable[[], str] = _no_detail) -> float:
    """`wait_until`, returning how long the wait took (a detection time)."""
    t0 = time.monotonic()
    wait_until(condition, within_s, what, describe=describe)
    return time.monotonic() - t0


async def until(condition: Callable[[], Any], within_s: float, what: str, *, interval_s: float = 0.01) -> float:
    """The asyncio form: poll `condition` (sync, or returning an awaitable) until it holds, without blocking the
    loop; returns the seconds it took. Fails naming `what` after `within_s` (scaled)."""
    loop = asyncio.get_running_loop()
    limit = scaled(within_s)
    t0 = loop.time()
    while not await _value(condition()):
        assert loop.time() - t0 < limit, f"{what}: not within {limit:.3g} s"
        await asyncio.sleep(interval_s)
    return loop.time() - t0


def run_within(scenario: Coroutine[Any, Any, T], within_s: float = 60.0) -> T:
    """`asyncio.run(scenario)`, cancelled and failed (`TimeoutError`) when it has not ended within `within_s`
    (scaled): a test's asyncio scenario never hangs the run."""
    return asyncio.run(asyncio.wait_for(scenario, scaled(within_s)))


async def _value(x: Any) -> Any:
    return await x if inspect.isawaitable(x) else x


async def async_seen_at(condition: Callable[[], Any], within_s: float, what: str) -> float:
    """`until`, returning the `time.monotonic()` at which `condition` was first seen to hold (the loop's clock is
    `time.monotonic()`)."""
    await until(condition, within_s, what)
    return time.monotonic()
