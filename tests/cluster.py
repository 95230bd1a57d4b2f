"""Real worker processes for end-to-end tests: started with `pdspark serve ...`, stopped by PID."""

from __future__ import annotations

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
