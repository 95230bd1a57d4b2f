"""`pdspark up` supervises its services: a worker or router that dies is restarted on the same ports and the router
re-admits it, while the rest of the cluster keeps serving; a crash loop is reported without taking the cluster
down; Ctrl-C (and a killed launcher) leaves no child behind.

One 2 prefill + 2 decode cluster is shared by the tests below, which run in order and end with its Ctrl-C.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

import pytest

from pdspark.service_process import ServiceProcess, start_service

ENGINE = ["--model", "dsv4-tiny", "--max-model-len", "512", "--max-num-seqs", "4", "--port", "0", "--grpc-port", "0"]
# The first restart waits longer than the router takes to mark a dead worker unhealthy (two failed health polls,
# 2 s apart), so /workers shows it down before it is back; backoff capped at the same value and a crash loop
# after 3 failures keep the crash-loop test short.
SUPERVISION = ["--restart-backoff", "4", "--max-restart-backoff", "4", "--crash-loop-restarts", "3"]
# Threads: shared 2-core machines; the children inherit the launcher's environment.
ENV = {"OMP_NUM_THREADS": "1"}


def wait_until(condition: Callable[[], Any], timeout: float, what: str) -> Any:
    """Poll `condition` until it returns something truthy (returned), failing with `what` after `timeout` s."""
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        assert time.monotonic() < deadline, f"not within {timeout}s: {what}"
        time.sleep(0.1)
    return value


def health(info: dict) -> dict[str, bool]:
    """The router's view: worker address -> healthy."""
    with urllib.request.urlopen(info["http"] + "/workers", timeout=10) as r:
        return {w["address"]: w["healthy"] for w in json.loads(r.read())}


def complete(info: dict, prompt: str = "def fibonacci(n):") -> int:
    """One small completion through the router; its completion token count (fails the test on an error)."""
    body = json.dumps({"prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True}).encode()
    req = urllib.request.Request(info["http"] + "/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return json.loads(r.read())["usage"]["completion_tokens"]
    except urllib.error.HTTPError as e:
        raise AssertionError(f"request failed: {e.code} {e.read()!r}") from None


def events(cluster: ServiceProcess, kind: str, service: str) -> list[dict]:
    return [e for e in cluster.events if e.get("event") == kind and e.get("service") == service]


def current(cluster: ServiceProcess, service: str) -> dict:
    """`{"pid", "address"}` of the service's current run: its last restart, else the ready line."""
    restarted = events(cluster, "restarted", service)
    return restarted[-1] if restarted else cluster.info["services"][service]


def alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, dead but not yet reaped by whoever inherited it, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def up(*args: str) -> ServiceProcess:
    return start_service("pdspark up", ["up", *ENGINE, *args], timeout=240, env=ENV)


@pytest.fixture(scope="module")
def cluster():
    service = up("--prefill", "2", "--decode", "2", *SUPERVISION)
    try:
        yield service
    finally:
        service.stop()  # already stopped by the last test, unless an earlier one failed


def kill_and_watch_readmission(cluster: ServiceProcess, name: str) -> float:
    """SIGKILL worker `name`; check the router marks it unhealthy, the launcher restarts it at the same address and
    the router marks it healthy again, with requests succeeding throughout. Returns the seconds from the kill
    to healthy again."""
    info = cluster.info
    before = current(cluster, name)
    assert health(info)[before["address"]] is True
    restarts = len(events(cluster, "restarted", name))
    os.kill(before["pid"], signal.SIGKILL)
    killed = time.monotonic()
    served = 0

    def down() -> bool:
        nonlocal served
        served += complete(info) > 0  # requests sent while the worker is down still succeed (on the other pair)
        return health(info)[before["address"]] is False

    wait_until(down, 8, f"/workers shows {name} unhealthy")
    wait_until(lambda: len(events(cluster, "restarted", name)) > restarts, 60, f"the launcher restarts {name}")
    after = current(cluster, name)
    assert after["address"] == before["address"] and after["pid"] != before["pid"]
    wait_until(lambda: health(info)[after["address"]], 30, f"/workers shows {name} healthy again")
    readmitted_s = time.monotonic() - killed
    assert served >= 1 and all(complete(info) == 4 for _ in range(3))
    (exited,) = [e for e in events(cluster, "exited", name) if e["pid"] == before["pid"]]
    assert exited["returncode"] == -signal.SIGKILL and exited["restart_in_s"] == 4.0
    assert cluster.alive and all(health(info).values())
    return readmitted_s


def test_ready_line_lists_every_service(cluster):
    services = cluster.info["services"]
    assert sorted(services) == ["decode-2", "decode-3", "prefill-0", "prefill-1", "router"]
    assert all(alive(s["pid"]) for s in services.values())
    assert set(health(cluster.info)) == {s["address"] for name, s in services.items() if name != "router"}
    assert services["router"]["address"] == cluster.info["grpc"]


def test_killed_decode_worker_is_restarted_and_readmitted(cluster):
    seconds = kill_and_watch_readmission(cluster, "decode-3")
    print(f"decode-3: SIGKILL -> healthy in /workers again in {seconds:.1f}s")


def test_killed_prefill_worker_is_restarted_and_readmitted(cluster):
    seconds = kill_and_watch_readmission(cluster, "prefill-0")
    print(f"prefill-0: SIGKILL -> healthy in /workers again in {seconds:.1f}s")


def test_killed_router_is_restarted_on_the_same_ports(cluster):
    info = cluster.info
    before = current(cluster, "router")
    os.kill(before["pid"], signal.SIGKILL)
    wait_until(lambda: events(cluster, "restarted", "router"), 30, "the launcher restarts the router")
    assert current(cluster, "router")["address"] == info["grpc"]
    assert complete(info) == 4  # the same HTTP endpoint serves again
    from pdspark.client import Client

    with Client(info["grpc"], timeout=60) as client:  # and the same gRPC one
        assert len(client.generate("x = 1", max_tokens=3, temperature=0, ignore_eos=True).token_ids) == 3
    assert all(health(info).values())


def test_crash_loop_is_reported_and_the_cluster_keeps_serving(cluster):
    info = cluster.info
    name = "decode-2"
    before = current(cluster, name)
    host, port = before["address"].rsplit(":", 1)
    os.kill(before["pid"], signal.SIGKILL)
    # Hold the worker's port, so every restart fails at start (the "port briefly taken" case, made lasting).
    # SO_REUSEADDR: the dead worker's connections may sit in TIME_WAIT; a listening socket still blocks the worker.
    holder = socket.socket()
    holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        def grab() -> bool:
            try:
                holder.bind((host, int(port)))
            except OSError:  # the killed worker's socket is not closed yet
                return False
            return True

        wait_until(grab, 3, f"binding {name}'s port after killing it")
        holder.listen()
        loop = wait_until(lambda: events(cluster, "crash_loop", name), 90, f"a crash loop reported for {name}")
        assert loop[0]["failures"] == 3
        assert complete(info) == 4 and cluster.alive  # the other decode worker serves meanwhile
        failed = [e for e in events(cluster, "exited", name) if e["pid"] != before["pid"]]
        assert len(failed) >= 2 and all(e["returncode"] == 1 for e in failed)  # restarts that failed at start
        text = cluster.tail(400)
        assert f"ERROR: {name} is in a crash loop" in text
        assert f"{host}:{port}" in text  # the child's stderr (gRPC's bind error naming the port) is shown
        restarts = len(events(cluster, "restarted", name))
    finally:
        holder.close()
    # Restarts go on at the capped backoff: with the port free again, the worker comes back.
    wait_until(lambda: len(events(cluster, "restarted", name)) > restarts, 30, f"{name} restarted after the loop")
    assert current(cluster, name)["address"] == before["address"]
    assert complete(info) == 4


def test_ctrl_c_stops_every_child(cluster):
    pids = [current(cluster, name)["pid"] for name in cluster.info["services"]]
    assert all(alive(pid) for pid in pids)
    cluster.proc.send_signal(signal.SIGINT)
    assert cluster.proc.wait(60) == 0
    assert not [pid for pid in pids if alive(pid)]  # the launcher waits for each child before exiting


def test_children_die_with_a_killed_launcher_restarted_ones_too():
    service = up("--prefill", "1", "--decode", "1", "--restart-backoff", "0.5")
    try:
        decode = service.info["services"]["decode-1"]
        os.kill(decode["pid"], signal.SIGKILL)
        wait_until(lambda: events(service, "restarted", "decode-1"), 60, "the launcher restarts decode-1")
        pids = [current(service, name)["pid"] for name in service.info["services"]]
        # No Ctrl-C handling here: children go because PR_SET_PDEATHSIG signals them when their creating thread
        # (the launcher's main thread, which also spawns restarts) dies.
        service.proc.kill()
        service.proc.wait(10)
        wait_until(lambda: not [pid for pid in pids if alive(pid)], 30, "every child exits after the launcher")
    finally:
        service.stop()
