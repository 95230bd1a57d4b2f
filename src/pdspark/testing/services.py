"""Real services for end-to-end tests and benchmarks: `pdspark serve ...` processes, started and stopped by PID."""

from __future__ import annotations

import time

from pdspark.launch.service_process import ServiceProcess, spawn_service, start_service, wait_ready
from pdspark.testing.time_scale import scaled


def spawn_worker(role: str, model: str, *args: str, env: dict | None = None) -> ServiceProcess:
    """A worker process started, not yet ready: `ready(...)` waits for it (and for others started meanwhile)."""
    service = spawn_service(role, ["serve", role, "--model", model, "--port", "0", "--metrics-port", "0", *args],
                            env={"OMP_NUM_THREADS": "1", **(env or {})})
    service.role = role  # type: ignore[attr-defined]
    return service


def ready(*services: ServiceProcess, timeout: float = 120.0) -> list[ServiceProcess]:
    """Wait until every one of `services` printed its ready line, all within `timeout` (scaled); on a failure stop
    them all.
    Workers spawned together load their models at the same time: a worker's start keeps one core busy and the tests
    run one at a time, so on a quiet 2-core machine starting them one after the other leaves a core idle (on one
    loaded by other work there is no idle core, and it makes no difference)."""
    deadline = time.monotonic() + scaled(timeout)
    try:
        for service in services:
            wait_ready(service, max(0.0, deadline - time.monotonic()))
    except BaseException:
        for service in services:
            service.stop()
        raise
    return list(services)


def start_worker(role: str, model: str, *args: str, timeout: float = 120.0, env: dict | None = None
                 ) -> ServiceProcess:
    (service,) = ready(spawn_worker(role, model, *args, env=env), timeout=timeout)
    return service


def start_router(model: str, prefill: list, decode: list, *args: str, timeout: float = 60.0,
                 env: dict | None = None) -> ServiceProcess:
    """`env`: over the test's own (keys travel there: `PDSPARK_ADMIN_API_KEY`, ...)."""
    return start_service("router", ["serve", "router", "--model", model, "--port", "0", "--grpc-port", "0",
                                    "--prefill", ",".join(w.address for w in prefill),
                                    "--decode", ",".join(w.address for w in decode), *args], timeout=scaled(timeout),
                         env=env)
