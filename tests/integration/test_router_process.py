"""The router as its own process (`pdspark serve router`, on uvloop) over stub workers: it serves completions, logs a
line per HTTP request only when started with `--access-log`, and with `--admin-port` serves the admin routes there
(named on its ready line) and not on its main port."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from pdspark.launch.service_process import ServiceProcess
from pdspark.testing.services import start_router
from pdspark.testing.time_scale import scaled

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def stub_pair():
    proc = subprocess.Popen([sys.executable, str(ROOT / "bench" / "stub_workers.py"), "--tokens", "2"],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        info = json.loads(proc.stdout.readline())
        yield (ServiceProcess("prefill", proc, {"address": info["prefill"]}),
               ServiceProcess("decode", proc, {"address": info["decode"]}))
    finally:
        proc.terminate()
        proc.wait(scaled(10))


def _complete(router: ServiceProcess) -> dict:
    body = json.dumps({"prompt": "def fibonacci(n):", "max_tokens": 2}).encode()
    req = urllib.request.Request(f"{router.info['http']}/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=scaled(30)) as resp:
        return json.loads(resp.read())


@pytest.mark.parametrize("flags, logged", [((), False), (("--access-log",), True)], ids=["default", "access-log"])
def test_the_router_process_serves_and_logs_requests_only_when_asked(stub_pair, flags, logged):
    router = start_router("dsv4-tiny", [stub_pair[0]], [stub_pair[1]], *flags)
    try:
        reply = _complete(router)
    finally:
        router.stop()
        router.drain()
    assert reply["usage"]["completion_tokens"] == 2
    assert reply["choices"][0]["finish_reason"] == "length"
    access = [line for line in router.errors if "aiohttp.access" in line and "/v1/completions" in line]
    assert len(access) == (1 if logged else 0), router.stderr_tail()


def _status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=scaled(30)) as resp:
            return resp.status
    except urllib.error.HTTPError as e:
        return e.code


def test_the_router_process_serves_the_admin_routes_on_the_admin_port(stub_pair):
    router = start_router("dsv4-tiny", [stub_pair[0]], [stub_pair[1]], "--admin-port", "0")
    try:
        admin = router.info["admin"]
        assert admin == f"http://127.0.0.1:{router.info['admin_port']}" and admin != router.info["http"]
        # A development router (loopback, no keys): listing is open, on the admin port only.
        assert [_status(admin + path) for path in ("/workers", "/prometheus/targets")] == [200, 200]
        assert [_status(router.info["http"] + path) for path in ("/workers", "/prometheus/targets")] == [404, 404]
        assert _complete(router)["usage"]["completion_tokens"] == 2
    finally:
        router.stop()
        router.drain()
