"""The supervisor of `pdspark up`: one loop that starts the cluster's services, waits until they are ready, watches
them and restarts those that end, whatever backend runs them (`pdspark.launch.backend`).

NOTE: supervision.
- Start: the workers (in parallel), then the router on them once every worker is ready. A service that fails during
  this *initial* start is a configuration error: `up` stops everything and exits 1.
- Backoff: a service that exits waits `restart_backoff_s`, doubled per consecutive failure up to
  `max_restart_backoff_s`, before its restart; a run that stays ready for `STABLE_S` resets the count. A restart
  that fails (its port briefly held elsewhere, say) is just the next failure: it is retried the same way. A
  (re)started service not ready within `READY_TIMEOUT_S` is stopped, which counts as a failure.
- Crash loop: after `crash_loop_restarts` consecutive failures the supervisor reports a crash loop (with the
  service's last stderr lines) and keeps retrying at the capped backoff: the cause may pass (a port, memory, a peer)
  and the cluster keeps serving on its other workers meanwhile. With `--no-restart`, any exit stops the cluster.
- One thread: everything here (every start included) runs on the launcher's main thread, which the process
  backend needs (see `pdspark.launch.process_backend`); signal handlers only set events the loop reads.
- Output: stderr gets a line per readiness, exit and restart; stdout one JSON line per event (`ready` with every
  service's pid, `exited`, `restarted`, `crash_loop`) for scripts.
- Stop: Ctrl-C / SIGTERM (the `stop` event) stops the router first, so it stops sending work, then every worker at
  once (each drains on SIGTERM); then the backend is closed.
"""

from __future__ import annotations

import signal
import textwrap
import threading
import time
from dataclasses import dataclass

from pdspark.config import UpConfig
from pdspark.launch.backend import ServiceBackend, ServiceRun
from pdspark.launch.console import event, log, print_endpoints, scrape_config
from pdspark.launch.plan import ClusterPlan, Service

STABLE_S = 60.0  # a run ready this long resets its service's failure count (and so its backoff)
READY_TIMEOUT_S = 180.0  # a (re)started service not ready by then is stopped and counted as a failure
TICK_S = 0.2  # how often the supervisor looks at its services
_STDERR_LINES = 10  # of a service's stderr, shown when it exits


def restart_delay(cfg: UpConfig, failures: int) -> float:
    """Seconds before the next start of a service that has failed `failures` (>= 1) times in a row."""
    return min(cfg.restart_backoff_s * 2.0 ** min(failures - 1, 62), cfg.max_restart_backoff_s)


@dataclass
class Supervised:
    """One service of the cluster and where it stands in its restart cycle."""

    service: Service
    run: ServiceRun | None = None  # None while waiting out a backoff
    started_at: float = 0.0
    ready_at: float | None = None  # None until the current run printed its ready line
    restarts: int = 0
    failures: int = 0  # consecutive runs that ended before staying ready for STABLE_S
    restart_at: float = 0.0  # while `run` is None: when to start it again

    @property
    def name(self) -> str:
        return self.service.name


def _address(run: ServiceRun) -> str:
    """The gRPC address a service answers at (a worker's ready line says `address`, the router's `grpc`)."""
    return run.info.get("address") or run.info.get("grpc", "")


def _indent(text: str) -> str:
    return textwrap.indent(text.rstrip("\n") or "(none)", "    | ")


class Supervisor:
    def __init__(self, cfg: UpConfig, plan: ClusterPlan, backend: ServiceBackend, stop: threading.Event):
        """`stop`: set (by Ctrl-C / SIGTERM) to stop the cluster; `run` then returns 0."""
        self.cfg = cfg
        self.plan = plan
        self.backend = backend
        self.stop = stop
        self.reload = threading.Event()  # SIGHUP, passed on to the router at the next tick
        self.t0 = time.monotonic()
        self.workers = [Supervised(s) for s in plan.workers]
        self.router = Supervised(plan.router)

    @property
    def services(self) -> list[Supervised]:
        return [*self.workers, self.router]

    def reload_keys(self) -> None:
        """SIGHUP: the router reads its key files again (a restarted router reads them at its start anyway). Only
        sets an event, so a signal handler may call it."""
        self.reload.set()

    def run(self) -> int:
        """Start the cluster and supervise it until `stop`: 0, or 1 when it could not start or (--no-restart) a
        service exited. Every service is stopped and the backend closed however it returns."""
        try:
            if not self._start(self.workers) or not self._start([self.router]):
                return 0 if self.stop.is_set() else 1
            self._announce()
            return self._supervise()
        finally:
            self._stop_all()

    def _spawn(self, s: Supervised) -> None:
        s.run = self.backend.start(s.service)
        s.started_at, s.ready_at = time.monotonic(), None

    def _start(self, services: list[Supervised]) -> bool:
        """Start the first run of `services` and wait for them all; False (after saying why) if one fails or a stop
        is asked."""
        for s in services:
            self._spawn(s)
        while not all(s.ready_at is not None for s in services):
            if self.stop.wait(TICK_S):
                return False
            self.backend.poll()
            for s in services:
                run = s.run
                assert run is not None  # spawned above
                if run.ready and s.ready_at is None:
                    self._ready(s)
                elif not run.alive or time.monotonic() - s.started_at > READY_TIMEOUT_S:
                    run.stop()
                    run.drain()
                    log(f"pdspark up: {s.name} failed to start ({run.exit_text}):\n{run.tail()}")
                    return False
        return True

    def _announce(self) -> None:
        """The ready event and the endpoints, once every service is ready."""
        router = self.router.run
        assert router is not None
        services = {}
        for s in self.services:
            assert s.run is not None
            services[s.name] = {"pid": s.run.pid, "address": _address(s.run), **s.run.details}
        print_endpoints(router.info, services, needs_key=bool(self.cfg.auth.api_key or self.cfg.auth.api_key_file),
                        ca=self.plan.ca_path)
        log(scrape_config(router.info.get("admin", router.info["http"]), self.cfg.auth, self.cfg.host))

    def _supervise(self) -> int:
        while not self.stop.wait(TICK_S):
            self.backend.poll()
            self._pass_on_reload()
            for s in self.services:
                if self.stop.is_set():
                    break
                if not self.cfg.restart and s.run is not None and not s.run.alive:
                    log(f"pdspark up: {s.name} exited ({s.run.exit_text}); shutting down (--no-restart)\n"
                        f"{s.run.tail(20)}")
                    return 1
                self._tend(s, time.monotonic())
        return 0

    def _pass_on_reload(self) -> None:
        if self.reload.is_set():
            self.reload.clear()
            run = self.router.run
            if run is not None and run.alive:
                run.send_signal(signal.SIGHUP)

    def _tend(self, s: Supervised, now: float) -> None:
        run = s.run
        if run is None:
            if now >= s.restart_at:
                s.restarts += 1
                self._spawn(s)
                log(f"{self._stamp()} {s.name} restarting (restart {s.restarts})")
        elif not run.alive:
            self._exited(s, run, now)
        elif s.ready_at is None:
            if run.ready:
                self._ready(s)
            elif now - s.started_at > READY_TIMEOUT_S:
                log(f"pdspark up: {s.name} not ready {READY_TIMEOUT_S:.0f}s after its start; stopping it")
                run.stop()  # the next tick counts it as a failure
        elif s.failures and now - s.ready_at >= STABLE_S:
            s.failures = 0

    def _ready(self, s: Supervised) -> None:
        run = s.run
        assert run is not None
        s.ready_at = time.monotonic()
        worker = s.service.is_worker
        where = f" at {run.info.get('address', '')}" if worker else ""
        metrics = f", metrics :{run.info['metrics_port']}" if run.info.get("metrics_port") else ""
        hosted = "".join(f", {key.replace('_', ' ')} {value}" for key, value in run.details.items())
        again = f", restart {s.restarts}" if s.restarts else ""
        kind = " worker" if worker else ""
        log(f"{self._stamp()} {s.name}{kind} ready{where} (pid {run.pid}{metrics}{hosted}{again})")
        if s.restarts:
            event(event="restarted", service=s.name, pid=run.pid, address=_address(run), restarts=s.restarts)

    def _exited(self, s: Supervised, run: ServiceRun, now: float) -> None:
        run.stop()  # frees what hosted the run (a Ray actor); nothing left to stop for a child process
        run.drain()  # its last stderr lines (a traceback) are what the report below is for
        s.failures += 1
        delay = restart_delay(self.cfg, s.failures)
        s.run, s.restart_at = None, now + delay
        ran = f"after {now - s.ready_at:.1f}s up" if s.ready_at is not None else "before it was ready"
        log(f"{self._stamp()} {s.name} {run.exit_text} {ran}; restarting in {delay:.1f}s "
            f"(failure {s.failures} in a row). Its last stderr lines:\n{_indent(run.stderr_tail(_STDERR_LINES))}")
        event(event="exited", service=s.name, pid=run.pid, returncode=run.returncode, restart_in_s=delay,
              failures=s.failures)
        if s.failures == self.cfg.crash_loop_restarts:
            log(f"pdspark up: ERROR: {s.name} is in a crash loop: {s.failures} failures in a row (last: "
                f"{run.exit_text}). Restarts go on every {self.cfg.max_restart_backoff_s:.0f}s at most; the rest of "
                f"the cluster keeps serving. Fix the cause above, or stop with Ctrl-C.")
            event(event="crash_loop", service=s.name, failures=s.failures)

    def _stop_all(self) -> None:
        log("pdspark up: stopping all services...")
        if self.router.run is not None:
            self.router.run.stop()
        for w in self.workers:
            if w.run is not None:
                w.run.terminate()
        for w in self.workers:
            if w.run is not None:
                w.run.stop()
        self.backend.close()
        log("pdspark up: stopped")

    def _stamp(self) -> str:
        return f"  [{time.monotonic() - self.t0:5.1f}s]"
