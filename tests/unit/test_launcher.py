"""The launcher's supervision policy, without processes: restart delays, its options, the fixed ports every service
is started with (what lets a restarted worker keep its address), and the supervise loop on a scripted backend."""

from __future__ import annotations

import json
import shutil
import subprocess
import textwrap
import threading

import pytest

from pdspark.cli import build_parser
from pdspark.config import AuthConfig, RouterConfig, UpConfig, WorkerConfig
from pdspark.errors import ConfigError
from pdspark.launch.console import scrape_config
from pdspark.launch.plan import plan_cluster
from pdspark.launch.supervisor import Supervisor, restart_delay
from pdspark.options import parse_args, parse_options
from pdspark.testing.time_scale import scaled


def test_restart_delay_doubles_up_to_the_cap():
    cfg = parse_args(UpConfig, [], {})
    assert (cfg.restart, cfg.restart_backoff_s, cfg.max_restart_backoff_s, cfg.crash_loop_restarts) == \
           (True, 1.0, 30.0, 5)
    assert [restart_delay(cfg, n) for n in range(1, 8)] == [1, 2, 4, 8, 16, 30, 30]
    assert restart_delay(cfg, 10_000) == 30  # a crash loop running for days does not overflow
    fast = parse_args(UpConfig, ["--restart-backoff-s", "0.5", "--max-restart-backoff-s", "3"], {})
    assert [restart_delay(fast, n) for n in range(1, 5)] == [0.5, 1, 2, 3]


def test_supervision_options():
    cfg = parse_args(UpConfig, ["--no-restart", "--crash-loop-restarts", "2"], {"PDSPARK_RESTART_BACKOFF_S": "2"})
    assert (cfg.restart, cfg.crash_loop_restarts, cfg.restart_backoff_s) == (False, 2, 2.0)
    with pytest.raises(ConfigError, match="max_restart_backoff_s"):
        parse_args(UpConfig, ["--restart-backoff-s", "10", "--max-restart-backoff-s", "5"], {})
    with pytest.raises(ConfigError, match="crash_loop_restarts"):
        parse_args(UpConfig, ["--crash-loop-restarts", "0"], {})


def test_every_service_gets_fixed_distinct_ports():
    cfg = parse_args(UpConfig, ["--prefill", "2", "--decode", "1", "--port", "0", "--grpc-port", "0",
                                "--max-model-len", "256"], {})
    plan = plan_cluster(cfg)
    parser = build_parser()
    workers = {}
    for s in plan.workers:
        args = parser.parse_args(s.argv)
        workers[s.name] = parse_options(WorkerConfig, args, {}, fixed={"role": args.role})
    assert list(workers) == ["prefill-0", "prefill-1", "decode-2"]
    router = parse_options(RouterConfig, parser.parse_args(plan.router.argv), {})
    ports = [p for w in workers.values() for p in (w.port, w.metrics_port)] + [router.port, router.grpc_port]
    assert 0 not in ports and len(set(ports)) == len(ports)
    # The router looks for each worker where it will always be, restarts included.
    assert router.prefill == tuple(f"127.0.0.1:{workers[n].port}" for n in ("prefill-0", "prefill-1"))
    assert router.decode == (f"127.0.0.1:{workers['decode-2'].port}",)
    assert workers["decode-2"].engine.scheduler.max_model_len == 256 and router.max_model_len == 256
    # Ports the user chose are kept.
    chosen = plan_cluster(parse_args(UpConfig, ["--port", "18123", "--grpc-port", "18124"], {}))
    router = parse_options(RouterConfig, parser.parse_args(chosen.router.argv), {})
    assert (router.port, router.grpc_port) == (18123, 18124)


@pytest.mark.parametrize("endpoint", [None, "http://collector:4317"])
def test_the_otlp_endpoint_reaches_the_router_and_every_worker(endpoint):
    flags = ["--otlp-endpoint", endpoint] if endpoint else []
    plan = plan_cluster(parse_args(UpConfig, [*flags, "--max-model-len", "256"], {}))
    parser = build_parser()
    for s in plan.workers:
        args = parser.parse_args(s.argv)
        assert parse_options(WorkerConfig, args, {}, fixed={"role": args.role}).otlp_endpoint == endpoint, s.name
    assert parse_options(RouterConfig, parser.parse_args(plan.router.argv), {}).otlp_endpoint == endpoint
    # And by variable, as every option.
    assert parse_args(RouterConfig, [], {"PDSPARK_OTLP_ENDPOINT": "http://c:4317"}).otlp_endpoint == "http://c:4317"


@pytest.mark.parametrize("flags, want", [([], 30.0), (["--transfer-timeout", "8"], 8.0)])
def test_the_transfer_timeout_reaches_the_router(flags, want):
    plan = plan_cluster(parse_args(UpConfig, [*flags, "--max-model-len", "256"], {}))
    assert parse_options(RouterConfig, build_parser().parse_args(plan.router.argv), {}).transfer_timeout_s == want
    with pytest.raises(ConfigError, match="transfer_timeout_s"):
        parse_args(UpConfig, ["--transfer-timeout", "0"], {})


@pytest.mark.parametrize("flags, fixed", [([], None), (["--admin-port", "18125"], 18125), (["--admin-port", "0"], 0)])
def test_the_admin_port_reaches_the_router(flags, fixed):
    plan = plan_cluster(parse_args(UpConfig, [*flags, "--port", "0", "--grpc-port", "0", "--max-model-len", "256"], {}))
    router = parse_options(RouterConfig, build_parser().parse_args(plan.router.argv), {})
    if fixed is None:
        assert router.admin_port is None  # the admin routes stay on the main port
    elif fixed:
        assert router.admin_port == fixed
    else:  # any free port, picked up front as the others (a restarted router keeps it)
        assert router.admin_port and router.admin_port not in (router.port, router.grpc_port, 0)
    with pytest.raises(ConfigError, match="admin_port"):
        parse_args(UpConfig, ["--admin-port", "18126", "--port", "18126"], {})


def test_keys_reach_the_router_by_its_environment_only():
    env = {"PDSPARK_API_KEY": "client-key-0123456789", "PDSPARK_ADMIN_API_KEY": "admin-key-0123456789"}
    cfg = parse_args(UpConfig, ["--api-key-file", "/run/keys", "--max-model-len", "256"], env)
    plan = plan_cluster(cfg)
    for s in plan.services:
        assert not [a for a in s.argv if "key-0123456789" in a], s.name
    assert plan.router.env == env
    assert all(w.env == {"PDSPARK_API_KEY": "", "PDSPARK_ADMIN_API_KEY": ""} for w in plan.workers)
    router = parse_options(RouterConfig, build_parser().parse_args(plan.router.argv), plan.router.env)
    assert router.auth == cfg.auth and router.auth.api_key_file == "/run/keys"


@pytest.mark.parametrize("auth", [AuthConfig(), AuthConfig(admin_api_key=("admin-key-0123456789",))])
def test_the_printed_scrape_config_is_one_prometheus_takes(auth, tmp_path):
    text = scrape_config("http://127.0.0.1:8000", auth, "127.0.0.1")
    assert "url: http://127.0.0.1:8000/prometheus/targets" in text
    assert ("credentials_file" in text) == bool(auth.admin_api_key)
    key = tmp_path / "admin-key"
    key.write_text("admin-key-0123456789")
    config = textwrap.dedent(text.split("A scrape config:\n", 1)[1]).replace("/path/to/admin-key", str(key))
    (tmp_path / "prometheus.yml").write_text(config)
    promtool = shutil.which("promtool")
    assert promtool, "promtool is missing: `make setup` installs Debian's `prometheus` package, which has it"
    out = subprocess.run([promtool, "check", "config", str(tmp_path / "prometheus.yml")], capture_output=True,
                         text=True, timeout=scaled(60))
    assert out.returncode == 0, out.stdout + out.stderr


def test_a_router_that_needs_an_admin_key_for_discovery_says_so():
    assert "needs an admin key" in scrape_config("http://10.0.0.1:8000", AuthConfig(), "0.0.0.0")
    assert "needs an admin key" in scrape_config("http://127.0.0.1:8000", AuthConfig(api_key=("k" * 20,)),
                                                 "127.0.0.1")


class FakeRun:
    """A `ServiceRun` that plays a script: "ready", "fail" (exits before it is ready) or "dies" (ready, then killed
    a few polls later)."""

    def __init__(self, pid: int, outcome: str):
        self.pid, self.outcome = pid, outcome
        self.info = {"event": "ready", "address": f"127.0.0.1:{pid}", "http": "http://127.0.0.1:1",
                     "grpc": "127.0.0.1:2", "model": "m"} if outcome != "fail" else {}
        self.returncode: int | None = 1 if outcome == "fail" else None
        self.polls = 0
        self.stopped = False
        self.details: dict = {}

    @property
    def ready(self) -> bool:
        return bool(self.info)

    @property
    def alive(self) -> bool:
        return self.returncode is None and not self.stopped

    @property
    def exit_text(self) -> str:
        return f"exit code {self.returncode}"

    def tail(self, n: int = 40) -> str:
        return "boom\n"

    def stderr_tail(self, n: int = 10) -> str:
        return "boom\n"

    def drain(self) -> None:
        pass

    def send_signal(self, signum: int) -> None:
        pass

    def terminate(self) -> None:
        pass

    def stop(self) -> int | None:
        self.stopped = True
        return self.returncode


class FakeBackend:
    """Runs each service's script, one outcome per start (the last one repeats); sets `stop` once decode-1 has been
    started `len(its script)` times and the supervisor has seen that run ready."""

    def __init__(self, scripts: dict[str, list[str]], stop: threading.Event):
        self.scripts, self.stop = scripts, stop
        self.runs: dict[str, list[FakeRun]] = {}
        self.closed = False

    def start(self, service):
        runs = self.runs.setdefault(service.name, [])
        script = self.scripts.get(service.name, ["ready"])
        runs.append(FakeRun(1000 + 10 * len(self.runs) + len(runs), script[min(len(runs), len(script) - 1)]))
        return runs[-1]

    def poll(self) -> None:
        for run in (r for runs in self.runs.values() for r in runs if r.alive):
            run.polls += 1
            if run.outcome == "dies" and run.polls == 3:
                run.returncode = -9
        decode = self.runs.get("decode-1", [])
        # The poll after the one that showed the last run ready: the supervisor has seen it by then.
        if len(decode) == len(self.scripts["decode-1"]) and decode[-1].polls == 2:
            self.stop.set()

    def close(self) -> None:
        self.closed = True


def test_one_supervise_loop_restarts_with_backoff_and_reports_a_crash_loop(capsys):
    """The loop both backends share, on a scripted backend: decode-1 is killed once it is up, fails its first
    restart (a crash loop at 2 failures), then serves again; the stop then stops every run and closes the backend."""
    cfg = parse_args(UpConfig, ["--restart-backoff-s", "0.1", "--max-restart-backoff-s", "0.2",
                                "--crash-loop-restarts", "2", "--max-model-len", "256"], {})
    stop = threading.Event()
    backend = FakeBackend({"decode-1": ["dies", "fail", "ready"]}, stop)
    assert Supervisor(cfg, plan_cluster(cfg), backend, stop).run() == 0
    out = capsys.readouterr()
    events = [json.loads(line) for line in out.out.splitlines() if line.startswith("{")]
    assert [e["event"] for e in events] == ["ready", "exited", "exited", "crash_loop", "restarted"]
    assert set(events[0]["services"]) == {"prefill-0", "decode-1", "router"}
    killed, failed = backend.runs["decode-1"][:2]
    assert events[1] == {"event": "exited", "service": "decode-1", "pid": killed.pid, "returncode": -9,
                         "restart_in_s": 0.1, "failures": 1}
    assert events[2] == {"event": "exited", "service": "decode-1", "pid": failed.pid, "returncode": 1,
                         "restart_in_s": 0.2, "failures": 2}
    assert events[3] == {"event": "crash_loop", "service": "decode-1", "failures": 2}
    assert events[4]["restarts"] == 2 and events[4]["pid"] == backend.runs["decode-1"][2].pid
    assert "ERROR: decode-1 is in a crash loop" in out.err and "    | boom" in out.err
    assert all(r.stopped for runs in backend.runs.values() for r in runs) and backend.closed


def test_a_failed_first_start_stops_the_cluster():
    cfg = parse_args(UpConfig, ["--max-model-len", "256"], {})
    stop = threading.Event()
    backend = FakeBackend({"decode-1": ["fail"]}, stop)
    assert Supervisor(cfg, plan_cluster(cfg), backend, stop).run() == 1
    assert "router" not in backend.runs  # the router starts only on ready workers
    assert all(r.stopped for runs in backend.runs.values() for r in runs) and backend.closed


def test_worker_ports_never_take_a_port_the_user_gave_the_router(monkeypatch):
    """The workers' ports are picked free, and a router port the user chose is free too until the router binds it:
    the pick must leave it alone. Candidates are narrowed to six ports free now: the two chosen ports and the four
    the workers need."""
    from pdspark.launch import free_ports as fp

    base = fp.free_ports("127.0.0.1", 6, consecutive=True)[0]
    monkeypatch.setattr(fp, "outside_ephemeral", lambda: [range(base, base + 6)])
    plan = plan_cluster(parse_args(UpConfig, ["--prefill", "1", "--decode", "1", "--port", str(base),
                                              "--grpc-port", str(base + 1), "--max-model-len", "256"], {}))
    parser = build_parser()
    ports = set()
    for s in plan.workers:
        args = parser.parse_args(s.argv)
        w = parse_options(WorkerConfig, args, {}, fixed={"role": args.role})
        ports |= {w.port, w.metrics_port}
    assert ports == set(range(base + 2, base + 6))
