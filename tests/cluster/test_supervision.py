"""`pdspark up`'s own supervision: the ready line, a crash loop reported without taking the cluster down, Ctrl-C and
a killed launcher leaving no child behind, `--no-restart`. What a killed or stopped service does to the requests and
how the router re-admits it is the failure matrix's (`test_chaos.py`, on the shared fault cluster).

One 1 prefill + 2 decode cluster is shared by the first tests, which run in order and end with its Ctrl-C.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import urllib.error
import urllib.request

import pytest

from pdspark.launch.service_process import ServiceProcess, start_service
from pdspark.testing.time_scale import scaled
from pdspark.testing.waiting import wait_until

ENGINE = ["--model", "dsv4-tiny", "--max-model-len", "512", "--max-num-seqs", "4", "--port", "0", "--grpc-port", "0"]
# Threads: shared 2-core machines; the children inherit the launcher's environment.
ENV = {"OMP_NUM_THREADS": "1"}
# A crash loop after 3 failed restarts, 1 s apart (the backoff capped at its first value): the crash-loop test stays
# short.
BACKOFF_S = 1.0
SUPERVISION = ["--restart-backoff-s", str(BACKOFF_S), "--max-restart-backoff-s", str(BACKOFF_S),
               "--crash-loop-restarts", "3"]


def health(info: dict) -> dict[str, bool]:
    """The router's view: worker address -> healthy."""
    with urllib.request.urlopen(info["http"] + "/workers", timeout=scaled(10)) as r:
        return {w["address"]: w["healthy"] for w in json.loads(r.read())}


def complete(info: dict, prompt: str = "def fibonacci(n):") -> int:
    """One small completion through the router; its completion token count (fails the test on an error)."""
    body = json.dumps({"prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True}).encode()
    req = urllib.request.Request(info["http"] + "/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=scaled(60)) as r:
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
    return start_service("pdspark up", ["up", *ENGINE, *args], timeout=scaled(240), env=ENV)


@pytest.fixture(scope="module")
def cluster():
    service = up("--prefill", "1", "--decode", "2", *SUPERVISION)
    try:
        yield service
    finally:
        service.stop()  # already stopped by the last test, unless an earlier one failed


def test_ready_line_lists_every_service(cluster):
    services = cluster.info["services"]
    assert sorted(services) == ["decode-1", "decode-2", "prefill-0", "router"]
    assert all(alive(s["pid"]) for s in services.values())
    assert set(health(cluster.info)) == {s["address"] for name, s in services.items() if name != "router"}
    assert services["router"]["address"] == cluster.info["grpc"]


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
    assert cluster.proc.wait(scaled(60)) == 0
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
        service.proc.wait(scaled(10))
        wait_until(lambda: not [pid for pid in pids if alive(pid)], 30, "every child exits after the launcher")
    finally:
        service.stop()


def test_no_restart_stops_the_cluster_when_a_service_exits():
    service = up("--prefill", "1", "--decode", "1", "--no-restart")
    try:
        pids = [s["pid"] for s in service.info["services"].values()]
        os.kill(service.info["services"]["prefill-0"]["pid"], signal.SIGKILL)
        assert service.proc.wait(scaled(60)) == 1
        assert not [pid for pid in pids if alive(pid)]
        service.drain()
        assert "prefill-0 exited (killed by SIGKILL); shutting down (--no-restart)" in service.tail()
    finally:
        service.stop()
