"""`run_router_group`: a router of several processes (`--processes N`) on the same ports, and their supervisor.

One Python process serves about one core's worth of requests (its HTTP parsing, dispatch and gRPC calls run on one
event loop). With N processes the supervisor holds the HTTP and gRPC ports (bound with SO_REUSEPORT, never
listening), and N spawned processes each run the whole router (`router_server.serve`) listening on them with
SO_REUSEPORT: the kernel spreads incoming connections over them (a connection stays with its process: a gRPC
client's stream and its `Abort` usually meet). `--admin-port` is process 0's alone.

What they share, and how:
- Admission bounds: `max_in_flight` and `max_queued` are divided between the processes (their shares sum to the
  bounds: the router never holds more); a process may refuse (429) while another still has room, by at most its
  share.
- The per-key limit is over all processes: one table in shared memory (`SharedKeyQuota`), under a lock the kernel
  releases when its holder dies; a dead process's counts are dropped before it is started again.
- `/metrics` is every process's, summed: prometheus_client's multiprocess mode (each process writes its series to
  files in a directory of the supervisor's; the scraped process reads them all); gauges are refreshed in every
  process at the scrape (`publish_gauges`).
- Workers: `POST`/`DELETE /workers` reach every process in one order (`PeerLink.ask`), so `/workers` lists the same
  workers, named alike, in all of them; each process polls their health and load itself (its view can lag another's
  by a poll). DNS discovery runs in each process, from the same records.
- The cache-aware policy keeps a prompt's prefix on one worker across processes: a prefix none of a process's
  requests has seen goes to the worker its first block hashes to (among those within the balance threshold),
  which is where the other processes sent it too (`CacheAware.hash_on_miss`).
- `Abort` by request id, from a connection other than the request's, is asked of every process.

A process that exits is started again (after `RESTART_DELAY_S`); one that fails before its first ready line stops
the router (a configuration error would fail again). SIGTERM/SIGINT stop every process (each drains as a
single-process router does); SIGHUP reaches each (keys reload).
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import json
import logging
import multiprocessing
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import Any

from pdspark.config import RouterConfig
from pdspark.router.auth.shared_key_quota import SharedKeyQuota
from pdspark.router.peer_link import PeerLink
from pdspark.router.router_server import GroupMember, run_router

logger = logging.getLogger(__name__)

# The asks that change the workers: a process started later replays them before it serves.
WORKER_OPS = ("add_worker", "remove_worker")
# A process that exits is started again after this: a crash loop costs a start a second, not a spinning CPU.
RESTART_DELAY_S = 1.0
# Each process loads the tokenizer and connects to its workers before its ready line (the single router's start).
READY_TIMEOUT_S = 120.0
# Stopping: each process drains as one router does (its gRPC server's 5 s grace); past this it is killed.
STOP_TIMEOUT_S = 30.0


def share(total: int, parts: int, index: int) -> int:
    """Part `index` of `total` split into `parts` shares that differ by at most one and sum to `total`."""
    return total // parts + (1 if index < total % parts else 0)


def member_config(cfg: RouterConfig, index: int, ports: GroupPorts) -> RouterConfig:
    """Process `index`'s configuration: the group's ports, its shares of the admission bounds, one process."""
    a = cfg.admission
    admission = dataclasses.replace(a, max_in_flight=share(a.max_in_flight, cfg.processes, index),
                                    max_queued=share(a.max_queued, cfg.processes, index),
                                    max_in_flight_per_key=a.key_in_flight_limit)
    return dataclasses.replace(cfg, port=ports.http, grpc_port=ports.grpc, admin_port=ports.admin,
                               admission=admission, processes=1)


def reserve_port(host: str, port: int) -> socket.socket:
    """A socket bound to (`host`, `port`; 0: a free one) with SO_REUSEPORT and not listening: the port stays the
    group's while its processes come and go, and takes no connection itself."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    s = socket.socket(family, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    s.bind((host, port))
    return s


@dataclass(frozen=True)
class GroupPorts:
    """The ports the supervisor holds for its processes (`reserve_port`)."""

    http: int
    grpc: int
    admin: int | None


@dataclass
class _Member:
    index: int
    process: BaseProcess
    conn: Connection
    ready: dict | None = None


@dataclass
class _Ask:
    origin: int
    expected: set[int]
    values: dict[int, Any] = field(default_factory=dict)


class RouterGroup:
    """The supervisor's state: its processes, the asks in flight between them, and whether it is stopping."""

    def __init__(self, cfg: RouterConfig, ports: GroupPorts, metrics_dir: str):
        self.cfg = cfg
        self.ports = ports
        self.metrics_dir = metrics_dir
        self.ctx = multiprocessing.get_context("spawn")  # a fresh interpreter: no gRPC state forked
        self.quota = SharedKeyQuota.create(cfg.admission.key_in_flight_limit, cfg.processes,
                                           os.path.join(metrics_dir, "key-quota.lock"), self.ctx)
        self.members: dict[int, _Member] = {}
        self.asks: dict[str, _Ask] = {}
        self.restart_at: dict[int, float] = {}
        self.stopping = False
        self.announced = False
        self.worker_ops: list[dict] = []  # every worker addition and removal asked, in order

    def start(self, index: int) -> None:
        parent, child = self.ctx.Pipe()
        process = self.ctx.Process(target=run_member, name=f"pdspark-router-{index}", daemon=False,
                                   args=(member_config(self.cfg, index, self.ports), index, child,
                                         self.quota.for_process(index), list(self.worker_ops)))
        process.start()
        child.close()
        self.members[index] = _Member(index, process, parent)

    def signal_all(self, sig: int) -> None:
        for m in self.members.values():
            with contextlib.suppress(ProcessLookupError):
                if m.process.pid is not None:
                    os.kill(m.process.pid, sig)

    def on_message(self, m: _Member, message: dict) -> None:
        kind = message["kind"]
        if kind == "ready":
            m.ready = message
            self.announce()
        elif kind == "ask":
            # Every process, a starting one too (it reads its pipe before its ready line); one started later gets
            # the worker changes in its arguments.
            if message["op"] in WORKER_OPS:
                self.worker_ops.append({"op": message["op"], "args": message["args"]})
            self.asks[message["token"]] = _Ask(m.index, set(self.members))
            for i in list(self.members):
                self._send(i, message)
        elif kind == "answer":
            ask = self.asks.get(message["token"])
            if ask is not None:
                ask.values[m.index] = message["value"]
                self._settle(message["token"], ask)

    def on_exit(self, m: _Member) -> None:
        from prometheus_client import multiprocess

        del self.members[m.index]
        m.conn.close()
        self.quota.forget_process(m.index)  # its requests are gone: their keys' counts with them
        if m.process.pid is not None:
            multiprocess.mark_process_dead(m.process.pid, self.metrics_dir)
        for token, ask in list(self.asks.items()):
            ask.expected.discard(m.index)
            self._settle(token, ask)
        if self.stopping:
            return
        if m.ready is None and not self.announced:
            raise SystemExit(f"router process {m.index} exited ({m.process.exitcode}) before it was ready")
        logger.error("router process %d (pid %s) exited with %s: starting it again in %.0f s", m.index,
                     m.process.pid, m.process.exitcode, RESTART_DELAY_S)
        self.restart_at[m.index] = time.monotonic() + RESTART_DELAY_S

    def announce(self) -> None:
        """The group's one ready line, once every process has said it is ready."""
        if self.announced or len(self.members) < self.cfg.processes:
            return
        if any(m.ready is None for m in self.members.values()):
            return
        self.announced = True
        first = dict(self.members[0].ready or {})
        first.pop("kind", None)
        first.update(processes=self.cfg.processes, pids=[self.members[i].process.pid for i in sorted(self.members)])
        print(json.dumps({"event": "ready", **first}), flush=True)

    def _settle(self, token: str, ask: _Ask) -> None:
        if not ask.expected <= ask.values.keys():
            return
        del self.asks[token]
        if ask.origin in self.members:
            self._send(ask.origin, {"kind": "answers", "token": token,
                                    "values": dict(ask.values)})

    def _send(self, index: int, message: dict) -> None:
        with contextlib.suppress(OSError):  # a process gone meanwhile: its exit settles what it owed
            self.members[index].conn.send(message)


def run_member(cfg: RouterConfig, index: int, conn: Connection, key_quota: SharedKeyQuota,
               worker_ops: list[dict]) -> None:
    """Process `index` of the group (spawned by `RouterGroup.start`): the router on the group's ports."""
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C reaches the supervisor, which stops us
    sys.exit(run_router(cfg, GroupMember(PeerLink(conn, index), key_quota, worker_ops)))


def _die_with_parent() -> None:
    """SIGTERM when the supervisor dies, even by SIGKILL (Linux's parent-death signal)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1: PR_SET_PDEATHSIG


def run_router_group(cfg: RouterConfig) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    held = {"http": reserve_port(cfg.host, cfg.port), "grpc": reserve_port(cfg.host, cfg.grpc_port)}
    if cfg.admin_port is not None:
        held["admin"] = reserve_port(cfg.host, cfg.admin_port)
    ports = GroupPorts(held["http"].getsockname()[1], held["grpc"].getsockname()[1],
                       held["admin"].getsockname()[1] if "admin" in held else None)
    metrics_dir = tempfile.mkdtemp(prefix="pdspark-router-metrics-")
    # Read by prometheus_client as each process imports it: the spawned processes inherit it.
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir
    group = RouterGroup(cfg, ports, metrics_dir)
    wake_r, wake_w = socket.socketpair()
    wake_r.setblocking(False)
    wake_w.setblocking(False)
    caught: list[int] = []

    def on_signal(sig: int, _frame: object) -> None:
        caught.append(sig)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, on_signal)
    signal.set_wakeup_fd(wake_w.fileno())
    try:
        for index in range(cfg.processes):
            group.start(index)
        return _supervise(group, wake_r, caught)
    finally:
        group.stopping = True
        group.signal_all(signal.SIGKILL)
        for m in list(group.members.values()):
            m.process.join(5)
        for s in (*held.values(), wake_r, wake_w):
            s.close()
        shutil.rmtree(metrics_dir, ignore_errors=True)


def _supervise(group: RouterGroup, wake: socket.socket, caught: list[int]) -> int:
    """The supervisor's loop until every process has stopped (0) or one failed to start (SystemExit)."""
    started = time.monotonic()
    stop_deadline: float | None = None
    while group.members or (not group.stopping and group.restart_at):
        now = time.monotonic()
        while caught:
            sig = caught.pop(0)
            if sig == signal.SIGHUP:
                group.signal_all(signal.SIGHUP)
            elif not group.stopping:
                logger.info("router group stopping")
                group.stopping = True
                group.restart_at.clear()
                group.signal_all(signal.SIGTERM)
                stop_deadline = now + STOP_TIMEOUT_S
        if not group.announced and now - started > READY_TIMEOUT_S:
            raise SystemExit(f"the router's processes were not all ready within {READY_TIMEOUT_S:.0f} s")
        if stop_deadline is not None and now > stop_deadline:
            logger.error("router processes still running %.0f s after SIGTERM: killing them", STOP_TIMEOUT_S)
            group.signal_all(signal.SIGKILL)
            stop_deadline = None
        for index, at in list(group.restart_at.items()):
            if now >= at:
                del group.restart_at[index]
                group.start(index)
        timeout = min([*(at - now for at in group.restart_at.values()), 1.0])
        by_object: dict[Any, tuple[str, _Member]] = {}
        for m in group.members.values():
            by_object[m.conn] = ("message", m)
            by_object[m.process.sentinel] = ("exit", m)
        for ready in wait([*by_object, wake], max(timeout, 0.0)):
            if ready is wake:
                with contextlib.suppress(BlockingIOError):
                    wake.recv(4096)
                continue
            what, m = by_object[ready]
            if m.index not in group.members or group.members[m.index] is not m:
                continue
            if what == "message":
                try:
                    message = m.conn.recv()
                except (EOFError, OSError):
                    continue  # its exit follows (the sentinel)
                group.on_message(m, message)
            else:
                m.process.join()
                group.on_exit(m)
    return 0
