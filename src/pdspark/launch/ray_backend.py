"""`RayCluster`: `pdspark up --backend ray` runs the cluster's services as Ray actors (the `pdspark[ray]` extra).

`pdspark.launch.up` makes the plan (every service's command line, its ports picked up front) and all the output;
this module runs that plan on Ray: a local Ray it starts (`ray.init`) or one it joins (`--ray-address`).

NOTE: one code path. An actor (`ServiceActor`) starts its service exactly as the process backend does:
`spawn_service` runs `python -m pdspark.cli serve <role> ...` as the actor's child, tied by `PR_SET_PDEATHSIG` to
the thread that spawned it, the actor's main thread (Ray runs a synchronous actor's methods there), so a killed
actor takes its service with it.
NOTE: restarts are Ray's. A service that exits makes its actor exit (`os._exit`), and Ray restarts the actor
(`max_restarts=-1`; 0 with `--no-restart`). The new actor waits `restart_backoff_s`, then runs the same command
line on the same ports: the router re-admits a worker at the address it already knows. `poll()` reports each exit
and each restart (a new service pid that is ready).
NOTE: placement. Every actor takes its role's resources (`--ray-*-resources`: `CPU`/`GPU` amounts, fractions
allowed, or custom resources), so Ray places it where they are free. The addresses are picked on the launcher's
machine and are loopback by default, so the actors are pinned to the launcher's node (a joined multi-node cluster
places them on that node only).
"""

from __future__ import annotations

import os
import sys
import threading
import time
import warnings
from typing import Any, NamedTuple

from pdspark.config import UpConfig
from pdspark.launch.service_process import spawn_service, wait_ready

_POLL_S = 1.0  # how often `poll` asks each actor about its service
_STOP_TIMEOUT_S = 20.0  # for every service's graceful stop (SIGTERM, drain) before its actor is killed


class ServiceStartError(RuntimeError):
    """A service failed its first start (a configuration error: `up` stops everything)."""


class ServiceChange(NamedTuple):
    """What `RayCluster.poll` saw happen to a service since the last poll."""

    name: str
    event: str  # "exited" or "restarted"
    pid: int  # the service's pid: the one that exited, or the new one
    info: dict  # a restarted service's ready line ({} for "exited")
    restarts: int


class ServiceActor:
    """One service as the child of a Ray actor (made remote by `RayCluster`)."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], restart_backoff_s: float):
        import ray

        with warnings.catch_warnings():  # 2.60 deprecates the property without a replacement
            warnings.simplefilter("ignore")
            restarted = ray.get_runtime_context().was_current_actor_reconstructed
        if restarted:
            time.sleep(restart_backoff_s)
        self.name = name
        self.stopping = False
        self.process = spawn_service(name, argv, env)
        threading.Thread(target=self._watch, name=f"{name}-watch", daemon=True).start()

    def _watch(self) -> None:
        self.process.proc.wait()
        if self.stopping:
            return
        self.process.drain()
        print(f"pdspark up: {self.name} {self.process.exit_text}; its last stderr lines:\n"
              f"{self.process.stderr_tail()}", file=sys.stderr, flush=True)
        os._exit(1)  # Ray restarts the actor, which starts the service again

    def wait_ready(self, timeout: float) -> dict:
        wait_ready(self.process, timeout)
        return self.status()

    def status(self) -> dict:
        p = self.process
        return {"pid": p.pid, "ready": p.ready, "info": p.info, "actor_pid": os.getpid()}

    def send_signal(self, signum: int) -> None:
        if self.process.alive:
            self.process.proc.send_signal(signum)

    def stop(self) -> int:
        self.stopping = True
        return self.process.stop()


class _Tracked:
    def __init__(self, actor: Any):
        self.actor = actor
        self.pid = 0
        self.down = False
        self.restarts = 0
        self.pending: Any = None  # the outstanding `status` call
        self.asked_at = 0.0


class RayCluster:
    def __init__(self, cfg: UpConfig):
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        self.cfg = cfg
        self.started = cfg.ray_address is None  # else joined: ray.shutdown() only disconnects
        ray.init(address=cfg.ray_address, num_cpus=cfg.ray_num_cpus if self.started else None,
                 include_dashboard=False)
        self._node = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
        self._remote = ray.remote(ServiceActor)
        self.services: dict[str, _Tracked] = {}

    def start(self, name: str, role: str, argv: list[str], env: dict[str, str]) -> None:
        """Create the actor of one service (`role`: router, prefill or decode, for its resources)."""
        resources = self.cfg.ray_resources(role)
        actor = self._remote.options(
            num_cpus=resources.pop("CPU", 0.0), num_gpus=resources.pop("GPU", 0.0), resources=resources,
            max_restarts=-1 if self.cfg.restart else 0, scheduling_strategy=self._node,
        ).remote(name, argv, env, self.cfg.restart_backoff_s)
        self.services[name] = _Tracked(actor)

    def wait_ready(self, names: list[str], stop: threading.Event, timeout: float) -> dict[str, dict] | None:
        """Every named service's status once all are ready; None if `stop` is set first. Raises
        `ServiceStartError` for a service that fails to start."""
        import ray

        refs = {self.services[n].actor.wait_ready.remote(timeout): n for n in names}
        out: dict[str, dict] = {}
        while len(out) < len(names):
            if stop.is_set():
                return None
            done, _ = ray.wait(list(set(refs) - {r for r, n in refs.items() if n in out}), timeout=0.2)
            for ref in done:
                name = refs[ref]
                try:
                    out[name] = ray.get(ref)
                except ray.exceptions.RayError as e:
                    raise ServiceStartError(f"{name} failed to start: {e}") from e
                self.services[name].pid = out[name]["pid"]
        return out

    def poll(self) -> list[ServiceChange]:
        """What happened to the services since the last call (at most one status call per service in flight)."""
        import ray

        changes: list[ServiceChange] = []
        now = time.monotonic()
        for name, s in self.services.items():
            if s.pending is None:
                if now - s.asked_at >= _POLL_S:
                    s.pending, s.asked_at = s.actor.status.remote(), now
                continue
            done, _ = ray.wait([s.pending], timeout=0)
            if not done:
                continue
            ref, s.pending = s.pending, None
            try:
                status = ray.get(ref)
            except ray.exceptions.RayError:  # the actor died (and is restarting, or is gone for good)
                status = None
            if (status is None or status["pid"] != s.pid) and not s.down:
                s.down = True
                changes.append(ServiceChange(name, "exited", s.pid, {}, s.restarts))
            if status is not None and s.down and status["ready"]:
                s.down, s.pid, s.restarts = False, status["pid"], s.restarts + 1
                changes.append(ServiceChange(name, "restarted", s.pid, status["info"], s.restarts))
        return changes

    def send_signal(self, name: str, signum: int) -> None:
        """Pass a signal on to a service (SIGHUP: the router reads its key files again); does not wait."""
        self.services[name].actor.send_signal.remote(signum)

    def is_down_for_good(self, name: str) -> bool:
        """With `--no-restart`, a service that exited stays down."""
        return not self.cfg.restart and self.services[name].down

    def shutdown(self, order: list[list[str]]) -> None:
        """Stop the services group by group (each group at once, gracefully, bounded), kill their actors, then
        stop the Ray processes `ray.init` started (or just disconnect from a joined cluster)."""
        import ray

        for group in order:
            refs = [self.services[n].actor.stop.remote() for n in group if n in self.services]
            ray.wait(refs, num_returns=len(refs), timeout=_STOP_TIMEOUT_S)
        for s in self.services.values():
            ray.kill(s.actor, no_restart=True)
        ray.shutdown()
