"""`pdspark up`: a local cluster (router + prefill and decode workers) as child processes, in one command.

Starts the workers (in parallel), waits for each with a progress line, starts the router on them, prints the
endpoints with ready-to-paste examples, then supervises: a service that exits is restarted while the rest keeps
serving. Ctrl-C / SIGTERM stops everything, leaving no child behind.

NOTE: supervision.
- Stable addresses: the launcher picks every port up front (gRPC and metrics per worker, HTTP and gRPC for the
  router) and passes it explicitly, so a restarted worker answers at the address the router already knows (its
  health checks re-admit it) and a restarted router serves on the same endpoints.
- Backoff: a service that exits waits `restart_backoff_s`, doubled per consecutive failure up to
  `max_restart_backoff_s`, before its restart; a run that stays ready for `STABLE_S` resets the count. A restart
  that fails (its port briefly held elsewhere, say) is just the next failure: it is retried the same way.
- Crash loop: after `crash_loop_restarts` consecutive failures the launcher reports a crash loop (with the child's
  last stderr lines) and keeps retrying at the capped backoff: the cause may pass (a port, memory, a peer) and the
  cluster keeps serving on its other workers meanwhile. A service that fails during the *initial* start is a
  configuration error instead: `up` stops everything and exits 1.
- One thread: every child is spawned (and restarted) from the main thread, because `PR_SET_PDEATHSIG` ties a child
  to the thread that created it; children die with the launcher, however it ends.
- Output: stderr gets a line per readiness, exit and restart, and a Prometheus scrape config (the router's service
  discovery); stdout gets one JSON line per event (`ready` with every service's pid, `exited`, `restarted`,
  `crash_loop`) for scripts.
- Keys: the router gets its API and admin keys in its environment (`secret_env`), never on its command line, which
  every user of the machine can read in `ps`; the workers get those variables blanked. No output shows a key.
  SIGHUP is passed on to the router, which reads its key files again.
- TLS (`--tls`): a throwaway CA (`ThrowawayCA`) issues every service a certificate naming its role, in a private
  directory (0700, keys 0600) that lives as long as the launcher and is removed when it exits. The services get
  the paths as flags (`--tls-cert/--tls-key/--tls-ca`; the router also `--ssl-certfile/--ssl-keyfile` for HTTPS and
  TLS on its gRPC port); clients trust the CA whose path is printed (and is on the `ready` event as `ca`).
  Readiness is each child's own ready line, so it needs no connection of the launcher's to a service.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import socket
import sys
import tempfile
import textwrap
import threading
import time
from dataclasses import dataclass

from pdspark.assets import resolve_model
from pdspark.config import AuthConfig, RouterConfig, TLSConfig, UpConfig, WorkerConfig
from pdspark.model.model_config import ModelConfig
from pdspark.options import replace_options, secret_env, to_argv
from pdspark.router.auth.api_keys import is_loopback
from pdspark.rpc.throwaway_ca import ThrowawayCA
from pdspark.service_process import ServiceProcess, spawn_service

STABLE_S = 60.0  # a run ready this long resets its service's failure count (and so its backoff)
READY_TIMEOUT_S = 180.0  # a (re)started service not ready by then is stopped and counted as a failure
_TICK_S = 0.2  # how often the supervisor looks at its children
_STDERR_LINES = 10  # of a child's stderr, shown when it exits


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _event(**fields) -> None:
    print(json.dumps(fields), flush=True)


def worker_configs(cfg: UpConfig, has_draft: bool) -> dict[str, WorkerConfig]:
    """What each role's workers run: the user's engine options, DSpark when the checkpoint has a draft (unless
    `--no-speculative`), and no prefix cache on decode (every prompt's cache arrives there by transfer, so a
    prefix cache would only hold memory)."""
    engine = replace_options(cfg.engine, speculative="dspark" if has_draft and cfg.speculative else None)
    return {
        "prefill": WorkerConfig(role="prefill", model=cfg.model, port=0, metrics_port=0, engine=engine,
                                otlp_endpoint=cfg.otlp_endpoint),
        "decode": WorkerConfig(role="decode", model=cfg.model, port=0, metrics_port=0,
                               engine=replace_options(engine, enable_prefix_cache=False),
                               otlp_endpoint=cfg.otlp_endpoint),
    }


def router_config(cfg: UpConfig, prefill: list[str], decode: list[str]) -> RouterConfig:
    # The router admits what the workers serve: the same max_model_len (None on both sides resolves the same way).
    return RouterConfig(model=cfg.model, host=cfg.host, port=cfg.port, grpc_port=cfg.grpc_port, auth=cfg.auth,
                        prefill=tuple(prefill), decode=tuple(decode), max_model_len=cfg.engine.scheduler.max_model_len,
                        otlp_endpoint=cfg.otlp_endpoint)


def restart_delay(cfg: UpConfig, failures: int) -> float:
    """Seconds before the next start of a service that has failed `failures` (>= 1) times in a row."""
    return min(cfg.restart_backoff_s * 2.0 ** min(failures - 1, 62), cfg.max_restart_backoff_s)


def free_ports(host: str, n: int) -> list[int]:
    """`n` distinct ports free on `host` now (all held while picking, so they differ). Another process may still
    take one before its service binds it: that start fails and is retried like any failure."""
    family, _, _, _, address = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0]
    socks: list[socket.socket] = []
    try:
        for _ in range(n):
            s = socket.socket(family, socket.SOCK_STREAM)
            socks.append(s)
            s.bind(address)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


@dataclass
class Supervised:
    """One service of the cluster: its fixed command line and where it stands in its restart cycle."""

    name: str
    kind: str  # "worker" or "router", for messages
    argv: list[str]
    env: dict[str, str]  # over the launcher's own: what must not be on the command line (keys)
    process: ServiceProcess | None = None  # None while waiting out a backoff
    started_at: float = 0.0
    ready_at: float | None = None  # None until the current run printed its ready line
    restarts: int = 0
    failures: int = 0  # consecutive runs that ended before staying ready for STABLE_S
    restart_at: float = 0.0  # while `process` is None: when to start it again

    def spawn(self) -> None:
        """Start a run. Only from the launcher's main thread (see the NOTE above)."""
        assert threading.current_thread() is threading.main_thread(), "children die with the thread that made them"
        self.process = spawn_service(self.name, self.argv, self.env)
        self.started_at, self.ready_at = time.monotonic(), None


class Launcher:
    def __init__(self, cfg: UpConfig, stop: threading.Event, tls_dir: str | None = None):
        """`tls_dir`: with `cfg.tls`, the private directory the throwaway CA writes the certificates to."""
        self.cfg = cfg
        self.stop = stop
        self.t0 = time.monotonic()
        has_draft = "dspark" in ModelConfig.from_dir(resolve_model(cfg.model)).raw
        roles = ["prefill"] * cfg.prefill + ["decode"] * cfg.decode
        self.base = worker_configs(cfg, has_draft)
        ports = iter(free_ports(self.base["prefill"].host, 2 * len(roles)))
        self.workers: list[Supervised] = []
        addresses: dict[str, list[str]] = {"prefill": [], "decode": []}
        # The workers need no key: blank any the launcher's own environment holds.
        no_keys = {name: "" for name in secret_env(router_config(cfg, [], []))}
        assert not cfg.tls or tls_dir is not None, "--tls needs a directory for the certificates"
        self.ca = ThrowawayCA(tls_dir) if cfg.tls and tls_dir is not None else None
        for i, role in enumerate(roles):
            # Children get every option as a flag, so their config is this one whatever their environment says.
            w = dataclasses.replace(self.base[role], port=next(ports), metrics_port=next(ports),
                                    tls=self._tls(f"{role}-{i}", role, self.base[role].advertise_host))
            self.workers.append(Supervised(f"{role}-{i}", "worker", ["serve", role, *to_argv(w)], no_keys))
            addresses[role].append(f"{w.advertise_host}:{w.port}")
        router_ports = iter(free_ports(cfg.host, [cfg.port, cfg.grpc_port].count(0)))
        router = dataclasses.replace(router_config(cfg, addresses["prefill"], addresses["decode"]),
                                     port=cfg.port or next(router_ports), grpc_port=cfg.grpc_port or next(router_ports))
        if self.ca is not None:
            # One certificate for both ends: the router's public ports and its calls to the workers.
            tls = self._tls("router", "router", cfg.host)
            router = dataclasses.replace(router, tls=tls, ssl_certfile=tls.tls_cert, ssl_keyfile=tls.tls_key)
        self.router = Supervised("router", "router", ["serve", "router", *to_argv(router)], secret_env(router))

    def _tls(self, name: str, role: str, host: str) -> TLSConfig:
        if self.ca is None:
            return TLSConfig()
        issued = self.ca.issue(name, role, (host,))
        return TLSConfig(tls_cert=issued.cert, tls_key=issued.key, tls_ca=self.ca.ca_path)

    def reload_keys(self) -> None:
        """SIGHUP: the router reads its key files again (a restarted router reads them at its start anyway)."""
        p = self.router.process
        if p is not None and p.alive:
            p.proc.send_signal(signal.SIGHUP)

    @property
    def services(self) -> list[Supervised]:
        return [*self.workers, self.router]

    def run(self) -> int:
        try:
            _log(f"pdspark up: starting {self.cfg.prefill} prefill + {self.cfg.decode} decode worker(s) on "
                 f"{self.cfg.model} (speculative: {self.base['decode'].engine.speculative or 'off'})")
            for w in self.workers:
                w.spawn()
            if not self._start(self.workers):
                return 0 if self.stop.is_set() else 1
            self.router.spawn()
            if not self._start([self.router]):
                return 0 if self.stop.is_set() else 1
            assert self.router.process is not None
            _print_endpoints(self.router.process.info,
                             {s.name: {"pid": self._pid(s), "address": self._address(s)} for s in self.services},
                             needs_key=bool(self.cfg.auth.api_key or self.cfg.auth.api_key_file),
                             ca=self.ca.ca_path if self.ca is not None else None)
            _log(scrape_config(self.router.process.info["http"], self.cfg.auth, self.cfg.host))
            return self._supervise()
        finally:
            self._stop_all()

    def _start(self, services: list[Supervised]) -> bool:
        """Wait for the first run of `services`; False (after saying why) if one fails or a stop is asked."""
        while not all(s.ready_at is not None for s in services):
            if self.stop.wait(_TICK_S):
                return False
            for s in services:
                p = s.process
                assert p is not None  # spawned by the caller
                if p.ready and s.ready_at is None:
                    self._ready(s)
                elif not p.alive or time.monotonic() - s.started_at > READY_TIMEOUT_S:
                    p.stop()
                    p.drain()
                    _log(f"pdspark up: {s.name} failed to start ({p.exit_text}):\n{p.tail()}")
                    return False
        return True

    def _supervise(self) -> int:
        while not self.stop.wait(_TICK_S):
            for s in self.services:
                if self.stop.is_set():
                    break
                if not self.cfg.restart and s.process is not None and not s.process.alive:
                    _log(f"pdspark up: {s.name} exited ({s.process.exit_text}); shutting down (--no-restart)\n"
                         f"{s.process.tail(20)}")
                    return 1
                self._tend(s, time.monotonic())
        return 0

    def _tend(self, s: Supervised, now: float) -> None:
        p = s.process
        if p is None:
            if now >= s.restart_at:
                s.restarts += 1
                s.spawn()
                _log(f"{self._stamp()} {s.name} restarting (restart {s.restarts})")
        elif not p.alive:
            self._exited(s, p, now)
        elif s.ready_at is None:
            if p.ready:
                self._ready(s)
            elif now - s.started_at > READY_TIMEOUT_S:
                _log(f"pdspark up: {s.name} not ready {READY_TIMEOUT_S:.0f}s after its start; stopping it")
                p.stop()  # the next tick counts it as a failure
        elif s.failures and now - s.ready_at >= STABLE_S:
            s.failures = 0

    def _ready(self, s: Supervised) -> None:
        assert s.process is not None
        s.ready_at = time.monotonic()
        p = s.process
        where = f" at {p.address}" if s.kind == "worker" else ""
        metrics = f", metrics :{p.info['metrics_port']}" if p.info.get("metrics_port") else ""
        again = f", restart {s.restarts}" if s.restarts else ""
        kind = " worker" if s.kind == "worker" else ""
        _log(f"{self._stamp()} {s.name}{kind} ready{where} (pid {p.pid}{metrics}{again})")
        if s.restarts:
            _event(event="restarted", service=s.name, pid=p.pid, address=self._address(s), restarts=s.restarts)

    def _exited(self, s: Supervised, p: ServiceProcess, now: float) -> None:
        p.drain()  # its last stderr lines (a traceback) are what the report below is for
        s.failures += 1
        delay = restart_delay(self.cfg, s.failures)
        s.process, s.restart_at = None, now + delay
        ran = f"after {now - s.ready_at:.1f}s up" if s.ready_at is not None else "before it was ready"
        _log(f"{self._stamp()} {s.name} {p.exit_text} {ran}; restarting in {delay:.1f}s "
             f"(failure {s.failures} in a row). Its last stderr lines:\n{_indent(p.stderr_tail(_STDERR_LINES))}")
        _event(event="exited", service=s.name, pid=p.pid, returncode=p.proc.returncode, restart_in_s=delay,
               failures=s.failures)
        if s.failures == self.cfg.crash_loop_restarts:
            _log(f"pdspark up: ERROR: {s.name} is in a crash loop: {s.failures} failures in a row (last: "
                 f"{p.exit_text}). Restarts go on every {self.cfg.max_restart_backoff_s:.0f}s at most; the rest of "
                 f"the cluster keeps serving. Fix the cause above, or stop with Ctrl-C.")
            _event(event="crash_loop", service=s.name, failures=s.failures)

    def _stop_all(self) -> None:
        _log("pdspark up: stopping all services...")
        # The router first, so it stops sending work; then every worker at once (each drains on SIGTERM).
        if self.router.process is not None:
            self.router.process.stop()
        for w in self.workers:
            if w.process is not None:
                w.process.terminate()
        for w in self.workers:
            if w.process is not None:
                w.process.stop()
        _log("pdspark up: stopped")

    def _pid(self, s: Supervised) -> int:
        assert s.process is not None
        return s.process.pid

    def _address(self, s: Supervised) -> str:
        """The gRPC address a service answers at (a worker's ready line says `address`, the router's `grpc`)."""
        assert s.process is not None
        return s.process.info.get("address") or s.process.info.get("grpc", "")

    def _stamp(self) -> str:
        return f"  [{time.monotonic() - self.t0:5.1f}s]"


def _indent(text: str) -> str:
    return textwrap.indent(text.rstrip("\n") or "(none)", "    | ")


def _stop_on_signals(stop: threading.Event) -> None:
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())


def launch(cfg: UpConfig) -> int:
    stop = threading.Event()
    _stop_on_signals(stop)
    # mkdtemp's directory is 0700; it goes, keys and all, however `run` ends (but a SIGKILL).
    certs = tempfile.TemporaryDirectory(prefix="pdspark-tls-") if cfg.tls else contextlib.nullcontext(None)
    with certs as tls_dir:
        launcher = Launcher(cfg, stop, tls_dir)
        if cfg.backend == "ray":
            return run_on_ray(launcher)
        signal.signal(signal.SIGHUP, lambda *_: launcher.reload_keys())
        return launcher.run()


def run_on_ray(launcher: Launcher) -> int:
    """The same plan and output as `Launcher.run`, with each service in a Ray actor that Ray restarts (see
    `pdspark.ray_launcher`). Ctrl-C / SIGTERM stops the services, their actors and the Ray processes started."""
    from pdspark.ray_launcher import RayCluster, ServiceStartError

    cfg, stop = launcher.cfg, launcher.stop
    _log(f"pdspark up: starting Ray ({cfg.ray_address or 'local'}) for {cfg.prefill} prefill + {cfg.decode} "
         f"decode worker(s) on {cfg.model} (speculative: {launcher.base['decode'].engine.speculative or 'off'})")
    cluster = RayCluster(cfg)
    _stop_on_signals(stop)  # `ray.init` installs its own SIGTERM handler
    signal.signal(signal.SIGHUP, lambda *_: cluster.send_signal("router", signal.SIGHUP) if
                  "router" in cluster.services else None)
    workers = [w.name for w in launcher.workers]
    try:
        for w in launcher.workers:
            cluster.start(w.name, w.argv[1], w.argv, w.env)  # argv: serve <role> ...
        ready = cluster.wait_ready(workers, stop, READY_TIMEOUT_S)
        if ready is None:
            return 0
        r = launcher.router
        cluster.start(r.name, "router", r.argv, r.env)
        status = cluster.wait_ready([r.name], stop, READY_TIMEOUT_S)
        if status is None:
            return 0
        ready = {n: (ready | status)[n] for n in [*workers, r.name]}  # in the plan's order
        for name, st in ready.items():
            _log(f"{launcher._stamp()} {name} ready at {st['info'].get('address') or st['info'].get('grpc')} "
                 f"(pid {st['pid']}, Ray actor pid {st['actor_pid']})")
        info = ready["router"]["info"]
        _print_endpoints(info, {n: {"pid": st["pid"], "address": st["info"].get("address") or st["info"]["grpc"],
                                    "actor_pid": st["actor_pid"]} for n, st in ready.items()},
                         needs_key=bool(cfg.auth.api_key or cfg.auth.api_key_file),
                         ca=launcher.ca.ca_path if launcher.ca is not None else None)
        _log(scrape_config(info["http"], cfg.auth, cfg.host))
        while not stop.wait(_TICK_S):
            for c in cluster.poll():
                _log(f"{launcher._stamp()} {c.name} {c.event} (pid {c.pid}, restart {c.restarts})")
                address = c.info.get("address") or c.info.get("grpc", "")
                _event(event=c.event, service=c.name, pid=c.pid, **({"address": address, "restarts": c.restarts}
                                                                     if c.event == "restarted" else {}))
                if cluster.is_down_for_good(c.name):
                    _log(f"pdspark up: {c.name} exited; shutting down (--no-restart)")
                    return 1
        return 0
    except ServiceStartError as e:
        _log(f"pdspark up: {e}")
        return 1
    finally:
        _log("pdspark up: stopping all services and Ray...")
        cluster.shutdown([["router"], workers])
        _log("pdspark up: stopped")


def scrape_config(http: str, auth: AuthConfig, host: str) -> str:
    """A Prometheus scrape config for the cluster (human text): HTTP service discovery at the router, which lists
    every metrics endpoint. The list names worker addresses, so it takes an admin key unless the router is a
    development one (no key of either kind, loopback only: see `pdspark.router.auth.api_keys`)."""
    url = f"{http}/prometheus/targets"
    lines = ["Prometheus: the router lists every metrics endpoint (its own and each worker's) at",
             f"  {url}  (HTTP service discovery). A scrape config:",
             "  scrape_configs:",
             "    - job_name: pdspark",
             "      scrape_interval: 15s",
             "      http_sd_configs:",
             f"        - url: {url}",
             "          refresh_interval: 30s"]
    if auth.admin_api_key or auth.admin_api_key_file:
        # NOTE: Prometheus sends a credentials file's whole content: a key file of several lines does not do. And
        # 2.42's HTTP discovery sends no `Bearer` unless `type` says so (the scrape's own default does not apply).
        lines += ["          authorization:  # an admin key: the list names worker addresses",
                  "            type: Bearer",
                  "            credentials_file: /path/to/admin-key  # a file holding one admin key"]
    elif auth.configured or not is_loopback(host):
        lines.append("  (the list needs an admin key on this router: start it with --admin-api-key-file)")
    return "\n".join(lines) + "\n"


def _print_endpoints(info: dict, services: dict[str, dict], needs_key: bool, ca: str | None = None) -> None:
    http, grpc_addr, model = info["http"], info["grpc"], info["model"]
    _event(event="ready", http=http, grpc=grpc_addr, model=model, pid=os.getpid(), services=services, ca=ca)
    # With API keys, the examples read the key from the environment: it is never printed.
    auth = " -H \"Authorization: Bearer $PDSPARK_API_KEY\"" if needs_key else ""
    openai_key = "__import__('os').environ['PDSPARK_API_KEY']" if needs_key else "'none'"
    keys = "  API keys    : required (the examples send $PDSPARK_API_KEY; the SDK reads it too)\n" if needs_key else ""
    # With TLS, every example trusts the run's CA (and only it).
    tls = f"  TLS         : every service; clients trust the CA {ca} (removed when the cluster stops)\n" if ca else ""
    cacert = f" --cacert {ca}" if ca else ""
    http_client = (f", http_client=__import__('openai').DefaultHttpxClient(verify=__import__('ssl')"
                   f".create_default_context(cafile='{ca}'))") if ca else ""
    sdk_tls = f", tls=TLSOptions.from_files(ca='{ca}')" if ca else ""
    sdk_import = "Client, TLSOptions" if ca else "Client"
    print(f"""
pdspark cluster is up.
  OpenAI HTTP : {http}/v1   (also {http}/generate, /health, /metrics, /workers)
  gRPC        : {grpc_addr}   (pdspark.v1.Router)
{keys}{tls}
Try it:
  curl{cacert} {http}/v1/completions -H 'Content-Type: application/json'{auth} \\
    -d '{{"model": "{model}", "prompt": "def fibonacci(n):", "max_tokens": 48, "temperature": 0}}'

  python -c "from openai import OpenAI; c = OpenAI(base_url='{http}/v1', api_key={openai_key}{http_client}); \\
print(c.completions.create(model='{model}', prompt='import os', max_tokens=32).choices[0].text)"

  python -c "from pdspark.client import {sdk_import}; \\
print(Client('{grpc_addr}'{sdk_tls}).generate('def fibonacci(n):', max_tokens=48, temperature=0).text)"

Press Ctrl-C to stop. Services that exit are restarted on the same ports.
""", flush=True)
