"""`pdspark up` supervises its services: a worker or router that dies is restarted on the same ports and the router
re-admits it, while the rest of the cluster keeps serving; a crash loop is reported without taking the cluster
down; Ctrl-C (and a killed launcher) leaves no child behind.

Liveness (docs/operations.md): a killed worker is marked down in `/workers` within 2 s and is back, restarted and
re-admitted, within 30 s; a stopped (hung) one is marked down within 2 s and re-admitted once it answers again.

One 2 prefill + 2 decode cluster is shared by the tests below, which run in order and end with its Ctrl-C.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest

from pdspark.launch.service_process import ServiceProcess, start_service
from pdspark.testing.waiting import wait_until

ENGINE = ["--model", "dsv4-tiny", "--max-model-len", "512", "--max-num-seqs", "4", "--port", "0", "--grpc-port", "0"]
# Threads: shared 2-core machines; the children inherit the launcher's environment.
ENV = {"OMP_NUM_THREADS": "1"}
DETECT_S = 2.0  # a dead or hung worker is marked down within this (docs/operations.md, "Liveness")
BACK_S = 30.0  # a killed worker is restarted and re-admitted within this
# The first restart waits long enough that the router (two failed health checks, 0.5 s apart) has marked the worker
# unhealthy before it is back, so the test sees it down: the backoff alone is DETECT_S, the most that marking may
# take, and the restarted worker still has to load its model. The backoff capped at the same value and a crash loop
# after 3 failures keep the crash-loop test short.
BACKOFF_S = DETECT_S
SUPERVISION = ["--restart-backoff-s", str(BACKOFF_S), "--max-restart-backoff-s", str(BACKOFF_S),
               "--crash-loop-restarts", "3"]

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


@contextlib.contextmanager
def requests_meanwhile(info: dict) -> Iterator[dict]:
    """Send small completions from a thread while the block runs, about 4 a second (paced, not flooding the CPU the
    restarting worker needs); yields `{"ok", "failed"}`."""
    results: dict = {"ok": 0, "failed": []}
    done = threading.Event()

    def send() -> None:
        while True:
            try:
                assert complete(info) == 4
                results["ok"] += 1
            except Exception as e:  # noqa: BLE001 -- reported by the test, whatever it is
                results["failed"].append(repr(e))
            if done.wait(0.25):
                return

    thread = threading.Thread(target=send, daemon=True)
    thread.start()
    try:
        yield results
    finally:
        done.set()
        thread.join(90)  # one request's own timeout bounds this


def kill_and_watch_readmission(cluster: ServiceProcess, name: str) -> str:
    """SIGKILL worker `name`; check the router marks it unhealthy within `DETECT_S`, the launcher restarts it at
    the same address and the router marks it healthy again, `BACK_S` after the kill at most, with requests sent
    meanwhile succeeding (a request in flight on the killed worker could fail: the requests start after the kill).
    Returns the timings, for `pytest -s`."""
    info = cluster.info
    before = current(cluster, name)
    assert health(info)[before["address"]] is True
    restarts = len(events(cluster, "restarted", name))
    os.kill(before["pid"], signal.SIGKILL)
    killed = time.monotonic()
    with requests_meanwhile(info) as sent:
        wait_until(lambda: health(info)[before["address"]] is False, DETECT_S,
                   f"/workers shows {name} unhealthy after SIGKILL")
        unhealthy_s = time.monotonic() - killed
        wait_until(lambda: len(events(cluster, "restarted", name)) > restarts, BACK_S - unhealthy_s,
                   f"the launcher restarts {name}")
        restarted_s = time.monotonic() - killed
        after = current(cluster, name)
        assert after["address"] == before["address"] and after["pid"] != before["pid"]
        wait_until(lambda: health(info)[after["address"]], BACK_S - restarted_s,
                   f"/workers shows {name} healthy again, {BACK_S}s after its SIGKILL")
        healthy_s = time.monotonic() - killed
    assert sent["failed"] == [] and sent["ok"] >= 1
    assert all(complete(info) == 4 for _ in range(3))
    (exited,) = [e for e in events(cluster, "exited", name) if e["pid"] == before["pid"]]
    assert exited["returncode"] == -signal.SIGKILL and exited["restart_in_s"] == BACKOFF_S
    assert cluster.alive and all(health(info).values())
    return (f"{name} SIGKILL -> unhealthy in /workers {unhealthy_s:.2f}s, ready again {restarted_s:.2f}s "
            f"(restart backoff {BACKOFF_S:.0f} s), healthy in /workers {healthy_s:.2f}s; {sent['ok']} requests "
            "meanwhile")


def stop_and_watch_readmission(cluster: ServiceProcess, name: str) -> str:
    """SIGSTOP worker `name` (hung: its sockets stay open); check the router marks it unhealthy within `DETECT_S`
    while requests sent meanwhile succeed on the others (one that started on it is retried elsewhere once it is
    marked down); SIGCONT it and check the router re-admits it (the same process: nothing was restarted), which
    then serves again. Returns the timings."""
    info = cluster.info
    before = current(cluster, name)
    restarts = len(events(cluster, "restarted", name))
    assert health(info)[before["address"]] is True
    os.kill(before["pid"], signal.SIGSTOP)
    try:
        stopped = time.monotonic()
        with requests_meanwhile(info) as sent:
            wait_until(lambda: health(info)[before["address"]] is False, DETECT_S,
                       f"/workers shows {name} unhealthy after SIGSTOP")
            unhealthy_s = time.monotonic() - stopped
            ok = sent["ok"]
            wait_until(lambda: sent["ok"] >= ok + 2 or sent["failed"], 30, "requests served without the worker")
    finally:
        os.kill(before["pid"], signal.SIGCONT)
    resumed = time.monotonic()
    wait_until(lambda: health(info)[before["address"]], DETECT_S, f"/workers shows {name} healthy again after SIGCONT")
    back_s = time.monotonic() - resumed
    assert sent["failed"] == [] and sent["ok"] >= 2
    assert current(cluster, name)["pid"] == before["pid"] and len(events(cluster, "restarted", name)) == restarts
    assert all(complete(info) == 4 for _ in range(3))
    assert cluster.alive and all(health(info).values())
    return (f"{name} SIGSTOP -> unhealthy in /workers {unhealthy_s:.2f}s ({sent['ok']} requests meanwhile); "
            f"SIGCONT -> healthy in /workers {back_s:.2f}s")


def test_ready_line_lists_every_service(cluster):
    services = cluster.info["services"]
    assert sorted(services) == ["decode-2", "decode-3", "prefill-0", "prefill-1", "router"]
    assert all(alive(s["pid"]) for s in services.values())
    assert set(health(cluster.info)) == {s["address"] for name, s in services.items() if name != "router"}
    assert services["router"]["address"] == cluster.info["grpc"]


def test_killed_decode_worker_is_restarted_and_readmitted(cluster):
    print(kill_and_watch_readmission(cluster, "decode-3"))


def test_killed_prefill_worker_is_restarted_and_readmitted(cluster):
    print(kill_and_watch_readmission(cluster, "prefill-0"))


def test_stopped_decode_worker_is_marked_down_and_readmitted_after_sigcont(cluster):
    print(stop_and_watch_readmission(cluster, "decode-2"))


def test_stopped_prefill_worker_is_marked_down_and_readmitted_after_sigcont(cluster):
    print(stop_and_watch_readmission(cluster, "prefill-1"))


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
    service = up("--prefill", "1", "--decode", "1", "--restart-backoff-s", "0.1")
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


def test_no_restart_stops_the_cluster_when_a_service_exits():
    service = up("--prefill", "1", "--decode", "1", "--no-restart")
    try:
        pids = [s["pid"] for s in service.info["services"].values()]
        os.kill(service.info["services"]["prefill-0"]["pid"], signal.SIGKILL)
        assert service.proc.wait(60) == 1
        assert not [pid for pid in pids if alive(pid)]
        service.drain()
        assert "prefill-0 exited (killed by SIGKILL); shutting down (--no-restart)" in service.tail()
    finally:
        service.stop()
