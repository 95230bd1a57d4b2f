"""The launcher's supervision policy, without processes: restart delays, its options, and the fixed ports every
service is started with (what lets a restarted worker keep its address)."""

from __future__ import annotations

import shutil
import subprocess
import textwrap
import threading

import pytest

from pdspark.cli import build_parser
from pdspark.config import AuthConfig, RouterConfig, UpConfig, WorkerConfig
from pdspark.errors import ConfigError
from pdspark.launch.up import Launcher, restart_delay, scrape_config
from pdspark.options import parse_args, parse_options


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
    launcher = Launcher(cfg, threading.Event())
    parser = build_parser()
    workers = {}
    for s in launcher.workers:
        args = parser.parse_args(s.argv)
        workers[s.name] = parse_options(WorkerConfig, args, {}, fixed={"role": args.role})
    assert list(workers) == ["prefill-0", "prefill-1", "decode-2"]
    router = parse_options(RouterConfig, parser.parse_args(launcher.router.argv), {})
    ports = [p for w in workers.values() for p in (w.port, w.metrics_port)] + [router.port, router.grpc_port]
    assert 0 not in ports and len(set(ports)) == len(ports)
    # The router looks for each worker where it will always be, restarts included.
    assert router.prefill == tuple(f"127.0.0.1:{workers[n].port}" for n in ("prefill-0", "prefill-1"))
    assert router.decode == (f"127.0.0.1:{workers['decode-2'].port}",)
    assert workers["decode-2"].engine.scheduler.max_model_len == 256 and router.max_model_len == 256
    # Ports the user chose are kept.
    chosen = Launcher(parse_args(UpConfig, ["--port", "18123", "--grpc-port", "18124"], {}), threading.Event())
    router = parse_options(RouterConfig, parser.parse_args(chosen.router.argv), {})
    assert (router.port, router.grpc_port) == (18123, 18124)


@pytest.mark.parametrize("endpoint", [None, "http://collector:4317"])
def test_the_otlp_endpoint_reaches_the_router_and_every_worker(endpoint):
    flags = ["--otlp-endpoint", endpoint] if endpoint else []
    launcher = Launcher(parse_args(UpConfig, [*flags, "--max-model-len", "256"], {}), threading.Event())
    parser = build_parser()
    for s in launcher.workers:
        args = parser.parse_args(s.argv)
        assert parse_options(WorkerConfig, args, {}, fixed={"role": args.role}).otlp_endpoint == endpoint, s.name
    assert parse_options(RouterConfig, parser.parse_args(launcher.router.argv), {}).otlp_endpoint == endpoint
    # And by variable, as every option.
    assert parse_args(RouterConfig, [], {"PDSPARK_OTLP_ENDPOINT": "http://c:4317"}).otlp_endpoint == "http://c:4317"


def test_keys_reach_the_router_by_its_environment_only():
    env = {"PDSPARK_API_KEY": "client-key-0123456789", "PDSPARK_ADMIN_API_KEY": "admin-key-0123456789"}
    cfg = parse_args(UpConfig, ["--api-key-file", "/run/keys", "--max-model-len", "256"], env)
    launcher = Launcher(cfg, threading.Event())
    for s in launcher.services:
        assert not [a for a in s.argv if "key-0123456789" in a], s.name
    assert launcher.router.env == env
    assert all(w.env == {"PDSPARK_API_KEY": "", "PDSPARK_ADMIN_API_KEY": ""} for w in launcher.workers)
    router = parse_options(RouterConfig, build_parser().parse_args(launcher.router.argv), launcher.router.env)
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
                         text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


def test_a_router_that_needs_an_admin_key_for_discovery_says_so():
    assert "needs an admin key" in scrape_config("http://10.0.0.1:8000", AuthConfig(), "0.0.0.0")
    assert "needs an admin key" in scrape_config("http://127.0.0.1:8000", AuthConfig(api_key=("k" * 20,)),
                                                 "127.0.0.1")
