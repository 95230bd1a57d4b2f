"""What the supervisor needs of a place to run services: `ServiceBackend` starts a run of a planned service and
`ServiceRun` is that run, until it ends. A backend runs a service's `pdspark <argv>` and nothing else: whether and
when to start it again is the supervisor's (`pdspark.launch.supervisor`), the same for every backend.

Two implement it: child processes of the launcher (`pdspark.launch.process_backend`) and Ray actors
(`pdspark.launch.ray_backend`).
"""

from __future__ import annotations

from typing import Protocol

from pdspark.launch.plan import Service


class ServiceRun(Protocol):
    """One run of one service: from its start until it has ended and been stopped. What it reports is as of the
    backend's last `poll` (a child process's state is live; a Ray actor's is fetched)."""

    @property
    def pid(self) -> int:
        """The service's own process (0 until a remote backend has reported it)."""
        ...

    @property
    def info(self) -> dict:
        """The service's ready line (`{"event": "ready", "address": ...}`); {} until it printed it."""
        ...

    @property
    def ready(self) -> bool: ...

    @property
    def alive(self) -> bool:
        """False once the run has ended: the service exited, or what hosted it is gone."""
        ...

    @property
    def returncode(self) -> int | None:
        """The service's exit status once it exited (negative: killed by that signal); None before, or when the
        backend could not learn it (a Ray actor that died with its service)."""
        ...

    @property
    def exit_text(self) -> str:
        """How the run ended, for logs: "exit code 1", "killed by SIGKILL" (or "running")."""
        ...

    @property
    def details(self) -> dict:
        """What the backend adds to the service's entry in the `ready` event (Ray: `actor_pid`); {} for none."""
        ...

    def tail(self, n: int = 40) -> str:
        """The last `n` lines of the service's stdout and stderr, interleaved."""
        ...

    def stderr_tail(self, n: int = 10) -> str: ...

    def drain(self) -> None:
        """After the run ended: wait (bounded) until its last output is in `tail`, so a report shows its last
        words."""
        ...

    def send_signal(self, signum: int) -> None:
        """Pass a signal to the service if it runs (SIGHUP: the router reads its key files again); does not wait."""
        ...

    def terminate(self) -> None:
        """Ask the service to stop (SIGTERM: it drains) without waiting; `stop` waits."""
        ...

    def stop(self) -> int | None:
        """Stop the service (SIGTERM; killed if it does not exit in time) and free what hosted it; on a run that has
        already ended, only the freeing. Bounded. The exit status, as `returncode`."""
        ...


class ServiceBackend(Protocol):
    def start(self, service: Service) -> ServiceRun:
        """Start a run of `service`; it is ready once `ready` says so. Called from the launcher's main thread."""
        ...

    def poll(self) -> None:
        """Bring what every run reports up to date (the supervisor calls it before it looks at them); returns at
        once."""
        ...

    def close(self) -> None:
        """After every run was stopped: release the backend itself (Ray: shut down the Ray it started)."""
        ...
