"""`pdspark up`: a cluster (router + prefill and decode workers) in one command: its plan (`plan`), run by the
supervisor (`supervisor`) on child processes (`process_backend`, the default) or Ray actors (`ray_backend`,
`--backend ray`). Ctrl-C / SIGTERM stops everything, leaving no child behind; SIGHUP is passed on to the router,
which reads its key files again.

NOTE: TLS (`--tls`). The certificates of the throwaway CA live in a private directory (0700, keys 0600) that lives as
long as the launcher and is removed when it exits. Readiness is each service's own ready line, so it needs no
connection of the launcher's to a service.
"""

from __future__ import annotations

import contextlib
import signal
import tempfile
import threading

from pdspark.config import UpConfig
from pdspark.launch.backend import ServiceBackend
from pdspark.launch.console import log, starting_line
from pdspark.launch.plan import ClusterPlan, plan_cluster
from pdspark.launch.process_backend import ProcessBackend
from pdspark.launch.supervisor import Supervisor


def _stop_on_signals(stop: threading.Event) -> None:
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())


def _backend(cfg: UpConfig, plan: ClusterPlan) -> ServiceBackend:
    if cfg.backend == "ray":
        # Imported here: Ray is an optional extra, and the process backend needs none of it.
        from pdspark.launch.ray_backend import RayBackend

        return RayBackend(cfg, plan.services)
    return ProcessBackend()


def launch(cfg: UpConfig) -> int:
    """Run the cluster `cfg` asks for until Ctrl-C / SIGTERM (0), or until it cannot start or, with --no-restart,
    a service exits (1)."""
    stop = threading.Event()
    _stop_on_signals(stop)
    # mkdtemp's directory is 0700; it goes, keys and all, however the run ends (but a SIGKILL).
    certs = tempfile.TemporaryDirectory(prefix="pdspark-tls-") if cfg.tls else contextlib.nullcontext(None)
    with certs as tls_dir:
        plan = plan_cluster(cfg, tls_dir)
        log(starting_line(cfg, plan.speculative))
        backend = _backend(cfg, plan)
        _stop_on_signals(stop)  # again: `ray.init` installs its own SIGTERM handler
        supervisor = Supervisor(cfg, plan, backend, stop)
        signal.signal(signal.SIGHUP, lambda *_: supervisor.reload_keys())
        return supervisor.run()
