"""The Ray backend of `pdspark up --backend ray` (the `pdspark[ray]` extra): every run of a service in a Ray actor, on
a local Ray it starts (`ray.init`) or one it joins (`--ray-address`).

NOTE: one code path. An actor (`ServiceActor`) starts its service exactly as the process backend does:
`spawn_service` runs `python -m pdspark.cli serve <role> ...` as the actor's child, tied by `PR_SET_PDEATHSIG` to
the thread that spawned it, the actor's main thread (Ray runs a synchronous actor's methods there), so a killed
actor takes its service with it.
NOTE: restarts are the supervisor's, as with child processes. An actor hosts one run of its service; Ray does not
restart it (`max_restarts=0`): the supervisor starts the next run in a new actor, after its backoff, on the same
ports (the router re-admits a worker at the address it already knows). Stopping a run kills its actor, which would
otherwise keep holding its resources (and a crash loop would pile them up).
NOTE: polled state. A run reports what its actor last answered to `status`: `poll()` keeps at most one such call in
flight per actor, asked every `_POLL_S`. An actor that dies (its process killed) ends its run.
NOTE: placement. Every actor takes its role's resources (`--ray-*-resources`: `CPU`/`GPU` amounts, fractions
allowed, or custom resources) for each rank of its service (a worker group of `--ep-size` ranks runs as the actor's
process tree on one node: the actor takes them all). One placement group reserves them for the whole cluster, a
bundle per service, before any service starts: `--ray-placement pack` (the default) puts every bundle on one node,
the launcher's when they fit (STRICT_PACK); `spread` across nodes (SPREAD). Every run of a service is scheduled into
its own bundle, so a restarted service comes back on the same node, at the same address. The addresses are picked
on the launcher's machine and are loopback by default: a service on another machine would not be reached there, so
spread serves on nodes of one machine (or where those addresses reach them).
"""

from __future__ import annotations

import math
import os
import time
from typing import Any

from pdspark.config import UpConfig
from pdspark.errors import ConfigError
from pdspark.launch.plan import Service
from pdspark.launch.service_process import spawn_service

_POLL_S = 1.0  # how often each actor is asked about its service
_STOP_TIMEOUT_S = 20.0  # for a service's graceful stop (SIGTERM, drain) before its actor is killed
_TAIL_LINES = 40  # of a service's output, sent once it has ended (for the supervisor's report)


class ServiceActor:
    """One run of one service, as the child of a Ray actor (made remote by `RayBackend`)."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str]):
        self.process = spawn_service(name, argv, env, echo_stderr=True)  # Ray sends it on to the driver

    def status(self) -> dict:
        """Where the service stands; once it has ended, also its last output lines (`log`, `errors`)."""
        import ray

        p = self.process
        status = {"pid": p.pid, "ready": p.ready, "info": p.info, "returncode": p.returncode,
                  "exit_text": p.exit_text, "actor_pid": os.getpid(),
                  "ray_node": ray.get_runtime_context().get_node_id()}
        if status["returncode"] is not None:
            p.drain()
            status.update(log=p.log[-_TAIL_LINES:], errors=p.errors[-_TAIL_LINES:])
        return status

    def send_signal(self, signum: int) -> None:
        self.process.send_signal(signum)

    def stop(self) -> dict:
        self.process.stop()
        return self.status()


class RayRun:
    """A `ServiceRun` whose service is a Ray actor's child: it reports the actor's last `status` answer."""

    def __init__(self, actor: Any):
        self._actor = actor
        self._status: dict = {"pid": 0, "ready": False, "info": {}, "returncode": None, "exit_text": "running",
                              "actor_pid": 0, "ray_node": ""}
        self._pending: Any = None  # the outstanding `status` call
        self._asked_at = -math.inf
        self._stopping: Any = None  # the outstanding `stop` call
        self._lost: str | None = None  # why the run ended when its actor died (no exit status to tell)
        self.freed = False  # its actor killed

    @property
    def pid(self) -> int:
        return self._status["pid"]

    @property
    def info(self) -> dict:
        return self._status["info"]

    @property
    def ready(self) -> bool:
        return self._status["ready"]

    @property
    def alive(self) -> bool:
        return self._lost is None and self._status["returncode"] is None and not self.freed

    @property
    def returncode(self) -> int | None:
        return self._status["returncode"]

    @property
    def exit_text(self) -> str:
        return self._lost or self._status["exit_text"]

    @property
    def details(self) -> dict:
        return {"actor_pid": self._status["actor_pid"], "ray_node": self._status["ray_node"]}

    def tail(self, n: int = 40) -> str:
        return "".join(self._status.get("log", [])[-n:])

    def stderr_tail(self, n: int = 10) -> str:
        return "".join(self._status.get("errors", [])[-n:])

    def drain(self) -> None:
        pass  # the actor drained its service's output before it reported the end

    def refresh(self, now: float) -> None:
        """Take the answer to the status call in flight if there is one; else ask again, every `_POLL_S`."""
        import ray

        if not self.alive or self._stopping is not None:
            return
        if self._pending is None:
            if now - self._asked_at >= _POLL_S:
                self._pending, self._asked_at = self._actor.status.remote(), now
            return
        done, _ = ray.wait([self._pending], timeout=0)
        if done:
            ref, self._pending = self._pending, None
            self._take(ref)

    def send_signal(self, signum: int) -> None:
        if self.alive:
            self._actor.send_signal.remote(signum)

    def terminate(self) -> None:
        if self._stopping is None and not self.freed:
            self._stopping = self._actor.stop.remote()

    def stop(self) -> int | None:
        import ray

        if not self.freed:
            self.terminate()
            done, _ = ray.wait([self._stopping], timeout=_STOP_TIMEOUT_S)
            if done:
                self._take(done[0])  # the final status: exit code and last output lines
            elif self.alive:
                self._lost = f"not stopped within {_STOP_TIMEOUT_S:.0f}s (its Ray actor killed)"
            self.kill()
        return self.returncode

    def kill(self) -> None:
        """Kill the actor (and so its service) at once."""
        import ray

        if not self.freed:
            ray.kill(self._actor, no_restart=True)
            self.freed = True

    def _take(self, ref: Any) -> None:
        import ray

        try:
            self._status = ray.get(ref)
        except ray.exceptions.RayError as e:  # the actor died, and its service with it
            self._lost = self._lost or f"lost with its Ray actor ({type(e).__name__})"


def actor_resources(cfg: UpConfig, service: Service) -> dict[str, float]:
    """What the actor of one run of `service` takes: its role's resources for each of its ranks."""
    return {name: amount * service.ranks for name, amount in cfg.ray_resources(service.role).items()}


def _bundle(resources: dict[str, float]) -> dict[str, float]:
    """A placement-group bundle of these resources (Ray refuses an empty bundle: a service that asks for none
    reserves a sliver of CPU)."""
    return {name: amount for name, amount in resources.items() if amount > 0} or {"CPU": 0.01}


class RayBackend:
    """A `ServiceBackend` on Ray; creating it starts the local Ray (5-10 s) or joins `--ray-address`, then reserves
    the placement group of `services` (every service `start` will be asked to run), waiting at most
    `placement_timeout_s` for Ray to place it."""

    def __init__(self, cfg: UpConfig, services: list[Service], placement_timeout_s: float = 60.0):
        import ray
        from ray.util import placement_group

        self.cfg = cfg
        started = cfg.ray_address is None  # else joined: ray.shutdown() only disconnects
        ray.init(address=cfg.ray_address, num_cpus=cfg.ray_num_cpus if started else None, include_dashboard=False)
        self._bundle = {s.name: i for i, s in enumerate(services)}
        bundles = [_bundle(actor_resources(cfg, s)) for s in services]
        here = ray.get_runtime_context().get_node_id()
        self._group = (placement_group(bundles, strategy="STRICT_PACK", _soft_target_node_id=here)
                       if cfg.ray_placement == "pack" else placement_group(bundles, strategy="SPREAD"))
        try:
            ray.get(self._group.ready(), timeout=placement_timeout_s)
        except ray.exceptions.GetTimeoutError:
            ray.util.remove_placement_group(self._group)
            ray.shutdown()
            raise ConfigError(f"Ray could not place the services' resources ({bundles}, {cfg.ray_placement}) within "
                              f"{placement_timeout_s:.0f}s: its nodes have {ray.cluster_resources()}") from None
        self._remote = ray.remote(ServiceActor)
        self._runs: list[RayRun] = []

    def start(self, service: Service) -> RayRun:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        resources = actor_resources(self.cfg, service)
        actor = self._remote.options(
            num_cpus=resources.pop("CPU", 0.0), num_gpus=resources.pop("GPU", 0.0), resources=resources,
            max_restarts=0, scheduling_strategy=PlacementGroupSchedulingStrategy(
                self._group, placement_group_bundle_index=self._bundle[service.name]),
        ).remote(service.name, service.argv, service.env)
        run = RayRun(actor)
        self._runs.append(run)
        return run

    def poll(self) -> None:
        self._runs = [r for r in self._runs if not r.freed]
        now = time.monotonic()
        for run in self._runs:
            run.refresh(now)

    def close(self) -> None:
        """Kill any actor left (the supervisor stops every run first), then stop the Ray processes `ray.init`
        started (or just disconnect from a joined cluster)."""
        import ray

        for run in self._runs:
            run.kill()
        ray.util.remove_placement_group(self._group)
        ray.shutdown()
