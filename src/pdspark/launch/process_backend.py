"""The process backend of `pdspark up` (the default): every service a child process of the launcher.

NOTE: one thread. Every child is spawned (and restarted) from the launcher's main thread, because
`PR_SET_PDEATHSIG` (see `orphan_guard.py`) ties a child to the thread that created it: children die with the
launcher, however it ends.
"""

from __future__ import annotations

import threading

from pdspark.launch.plan import Service
from pdspark.launch.service_process import ServiceProcess, spawn_service


class ProcessBackend:
    """A `ServiceBackend` whose runs are `ServiceProcess`es: their state is kept live by their reader threads and
    `Popen.poll`, so there is nothing to poll and nothing to close."""

    def start(self, service: Service) -> ServiceProcess:
        assert threading.current_thread() is threading.main_thread(), "children die with the thread that made them"
        return spawn_service(service.name, service.argv, service.env, echo_stderr=True)

    def poll(self) -> None:
        pass

    def close(self) -> None:
        pass
