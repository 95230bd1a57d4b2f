"""Real worker processes for end-to-end tests: started with `pdspark serve ...`, stopped by PID."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from pdspark.service_process import ServiceProcess, start_service


def start_worker(role: str, model: str, *args: str, timeout: float = 120.0, env: dict | None = None
                 ) -> ServiceProcess:
    service = start_service(role, ["serve", role, "--model", model, "--port", "0", "--metrics-port", "0", *args],
                            timeout=timeout, env={"OMP_NUM_THREADS": "1", **(env or {})})
    service.role = role  # type: ignore[attr-defined]
    return service


def start_router(model: str, prefill: list, decode: list, *args: str, timeout: float = 60.0,
                 env: dict | None = None) -> ServiceProcess:
    """`env`: over the test's own (keys travel there: `PDSPARK_ADMIN_API_KEY`, ...)."""
    return start_service("router", ["serve", "router", "--model", model, "--port", "0", "--grpc-port", "0",
                                    "--prefill", ",".join(w.address for w in prefill),
                                    "--decode", ",".join(w.address for w in decode), *args], timeout=timeout,
                         env=env)


def wait_until(condition: Callable[[], Any], timeout: float, what: str, interval_s: float = 0.05) -> Any:
    """Poll `condition` until it returns something truthy (returned); fail naming `what` after `timeout` s."""
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        assert time.monotonic() < deadline, f"not within {timeout}s: {what}"
        time.sleep(interval_s)
    return value


def seconds_until(condition: Callable[[], Any], timeout: float, what: str) -> float:
    """`wait_until` polling every 20 ms, returning how long the wait took (a detection time)."""
    t0 = time.monotonic()
    wait_until(condition, timeout, what, interval_s=0.02)
    return time.monotonic() - t0
