"""`WorkerRegistry`: the prefill and decode workers the router knows, their liveness and their load.

Workers come from flags or are added/removed at run time (`/workers`, DNS discovery); a worker's name is stable
per (role, address), so one that comes back keeps it (and its metric series), and `retire` removes one gently (its
calls may end first). The name of an address that is gone is kept for `name_retention_s` (a restarted pod, a DNS
blip), and of at most `max_gone_names` such addresses, the most recently gone: with address churn (every pod of a
rolling restart gets a new IP) the map stays bounded; an address back after that gets a new name.
Busy is not unhealthy, so the two are watched apart, each worker on tasks of its own (a slow worker never delays
another's checks):
- liveness: the standard gRPC health `Check`, every `health_interval_s`, each with a short `health_timeout_s`.
  A worker that misses `max_failures` checks in a row (no answer in time, unreachable, or NOT_SERVING) is marked
  unhealthy and skipped by the policies until it is re-admitted: a dead or hung worker is out within about
  `health_interval_s + max_failures * health_timeout_s`.
- re-admission: a worker marked unhealthy is checked on at the same interval and re-admitted once it has answered
  every check for a while: at once the first time it falls, then for `readmit_backoff_s`, doubled each time it
  falls again (up to `max_readmit_backoff_s`), so a worker that keeps falling over gets ever fewer requests. A
  worker that stays healthy for `stable_s` starts over.
- `on_down`: callbacks told (on the event loop) when a worker is marked unhealthy. With it the dispatcher ends the
  attempts that still need that worker, so that they are retried (or migrated) elsewhere now rather than when
  keepalive or the transfer timeout ends them.
- `on_closing`: callbacks told as the router is about to close its channel to a worker it no longer has: at once on
  `remove`, once the drain is over on `retire` (its last call ended, or `drain_s` passed). The dispatcher ends the
  attempts that still need that worker as `on_down` does (retried or migrated, never taken for a client's cancel),
  then the channel closes; from then on the worker is `closed` and nothing calls it again (an attempt skips the
  Abort it would send there: the closed channel ended the worker's calls, and the worker drops what they held).
- `wait_answering`: a request whose role has no other healthy worker left (its worker crashed) waits for one that
  answered a health check after the failure: a restarted worker answers at its first check (re-admitted at once
  the first time it falls), often before it was ever marked down.
- load: `GetLoad` every `load_interval_s` (running and waiting requests; a decode worker's reservation queue and
  quarantined request slots, which count as load too; and the worker's metrics URL). A slow or failed load report
  keeps the last one and never touches health.

Calls: `prefill_call` and `generate_call` make a request's two calls to its workers, one gRPC call each, or with
`multiplexed` on one long-lived `Calls` stream per worker (`rpc/multiplexed_client.py`), which fail alike. A
worker's channel, stubs and `Calls` client are made as it is added (`_connect`), never on a request's path.

Every channel to a worker has HTTP/2 keepalive, so a connection to a vanished host fails (and the calls on it
end) instead of hanging until their deadlines. With `tls` (mutual TLS) every channel, health checks and load reports
included, presents the router's certificate and verifies the worker's against the cluster's CA.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdspark.config import TLSConfig
from pdspark.rpc import convert
from pdspark.rpc.keepalive import CHANNEL_OPTIONS
from pdspark.rpc.multiplexed_client import MultiplexedCall, MultiplexedClient
from pdspark.rpc.tls_credentials import PeerCredentials, aio_channel
from pdspark.transfer.compat import CompatDescriptor
from pdspark.v1 import worker_pb2, worker_pb2_grpc

S = TypeVar("S")

logger = logging.getLogger(__name__)
ROLES = ("prefill", "decode")
# Each role's `Calls` method: the Prefill (prefill worker) or Generate (decode worker) calls, multiplexed.
_CALLS_METHOD = {role: f"/{worker_pb2.DESCRIPTOR.services_by_name[service].full_name}/Calls"
                 for role, service in (("prefill", "PrefillWorker"), ("decode", "DecodeWorker"))}
READMIT_BACKOFF_S = 1.0
MAX_READMIT_BACKOFF_S = 30.0
STABLE_S = 60.0
NAME_RETENTION_S = 3600.0  # how long the name of an address that is gone is kept for it
MAX_GONE_NAMES = 1024  # the names of at most this many addresses that are gone are kept (the most recently gone)
RENEW_DRAIN_S = 600.0  # calls on a channel replaced for a rotated certificate may go on this long (the router's default
# longest request: `AdmissionConfig.request_timeout_s`)


@dataclass
class WorkerInfo:
    role: str
    address: str
    metrics_url: str = ""
    healthy: bool = True
    # From the worker's last GetLoad: running + waiting requests, and on a decode worker also the requests in its
    # reservation queue (`queued`) and its quarantined request slots: a slot no request can take until no write of a
    # failed transfer can land is as busy as a running one, so a worker whose free slots are all quarantined is not
    # picked over one with room (it would refuse or queue the request until its deadline).
    reported_load: int = 0
    # From its load reports: what a peer must match to pair with it (None until one came, or from a worker that does
    # not report it: any pair with it is tried, and the plan's own check refuses a mismatch)
    compat: CompatDescriptor | None = None
    queued: int = 0  # decode: requests waiting for a slot and pages (its reservation queue)
    quarantined_slots: int = 0  # decode: request slots held by quarantined transfers
    quarantined_pages: dict[str, int] = field(default_factory=dict)  # decode: their pages, per pool
    # Its rank processes' states, rank 0 first (a worker group, `--ep-size`; one entry for one process; empty until
    # its first load report).
    ranks: list[str] = field(default_factory=list)
    # Legs of requests this router has on the worker right now and not answered: a prefill worker's until it
    # answered its Prefill call (after that the request needs it no more), a decode worker's until its stream ended.
    in_flight: int = 0
    failures: int = 0  # health checks missed in a row
    last_check: float = 0.0  # time.time() of the last health check
    last_load: float = 0.0  # time.time() of the last load report received
    downs: int = 0  # times marked unhealthy since it last stayed healthy for `stable_s` (sets the re-admission wait)
    healthy_since: float = 0.0  # time.monotonic() it was last (re-)admitted
    answered_at: float = 0.0  # time.monotonic() its last health check succeeded
    answering_since: float | None = None  # while unhealthy: time.monotonic() since when every check succeeded
    channel: grpc.aio.Channel | None = field(default=None, repr=False)
    # The stubs on `channel`, by class, made once: a stub builds a callable per method of its service.
    stubs: dict[Callable, Any] = field(default_factory=dict, repr=False)
    calls: MultiplexedClient | None = field(default=None, repr=False)  # on `channel`, made by the first call
    # What clients and /metrics call the worker (`prefill-0`): its address is for admins only (see `api_keys`).
    name: str = ""
    closed: bool = False  # removed (or retired and drained): its channel is closed, never to be called again

    @property
    def load(self) -> int:
        return max(self.reported_load, self.in_flight)

    def to_json(self) -> dict:
        return {"name": self.name, "role": self.role, "address": self.address, "healthy": self.healthy,
                "load": self.load, "in_flight": self.in_flight, "queued": self.queued,
                "quarantined_slots": self.quarantined_slots, "quarantined_pages": dict(self.quarantined_pages),
                "metrics_url": self.metrics_url, "ranks": list(self.ranks),
                "schema_version": self.compat.schema_version if self.compat is not None else None}


class WorkerRegistry:
    def __init__(self, health_interval_s: float = 0.5, health_timeout_s: float = 0.5, load_interval_s: float = 1.0,
                 max_failures: int = 2, readmit_backoff_s: float = READMIT_BACKOFF_S,
                 max_readmit_backoff_s: float = MAX_READMIT_BACKOFF_S, stable_s: float = STABLE_S,
                 tls: TLSConfig | None = None, multiplexed: bool = False,
                 name_retention_s: float = NAME_RETENTION_S, max_gone_names: int = MAX_GONE_NAMES,
                 renew_drain_s: float = RENEW_DRAIN_S):
        """`renew_drain_s`: how long the calls on a channel replaced by `renew_channels` may go on (the longest a
        request may take)."""
        self.tls = tls
        self.multiplexed = multiplexed
        # Read here (at start): a missing file is a configuration error, not a failure of every call later.
        self._peer = PeerCredentials(tls) if tls is not None and tls.enabled else None
        self.renew_drain_s = renew_drain_s
        self.health_interval_s = health_interval_s
        self.health_timeout_s = health_timeout_s
        self.load_interval_s = load_interval_s
        self.max_failures = max_failures
        self.readmit_backoff_s = readmit_backoff_s
        self.max_readmit_backoff_s = max_readmit_backoff_s
        self.stable_s = stable_s
        self.workers: dict[str, WorkerInfo] = {}
        self.on_down: list[Callable[[WorkerInfo], None]] = []  # called with a worker as it is marked unhealthy
        # Called with a worker whose channel is about to close (removed, or retired and drained).
        self.on_closing: list[Callable[[WorkerInfo], None]] = []
        self._registered = 0  # numbers the names: workers from flags are named as `pdspark up` names them
        # (role, address) -> name: a worker removed and added again (DNS discovery) keeps its name and its series.
        # The registered workers' and, for a while, those of workers gone (`_gone`).
        self._names: dict[tuple[str, str], str] = {}
        # (role, address) -> time.monotonic() it left the registry, for names kept of workers gone: oldest first.
        self._gone: OrderedDict[tuple[str, str], float] = OrderedDict()
        self.name_retention_s = name_retention_s
        self.max_gone_names = max_gone_names
        self._draining: set[asyncio.Task] = set()  # channel closes under way, retired workers' drains included
        # Set (and replaced by a fresh one) at each health check a worker answered: `wait_answering` wakes on it.
        self._answered = asyncio.Event()

    def add(self, role: str, address: str, metrics_url: str = "") -> WorkerInfo:
        if role not in ROLES:
            raise ValueError(f"unsupported worker role {role!r}; allowed: {', '.join(ROLES)}")
        if address in self.workers:
            raise ValueError(f"worker {address} is already registered")
        self._gone.pop((role, address), None)
        self._forget_names()
        if (role, address) not in self._names:
            self._names[role, address] = f"{role}-{self._registered}"
            self._registered += 1
        w = WorkerInfo(role, address, metrics_url, healthy_since=time.monotonic(), name=self._names[role, address])
        self.workers[address] = w
        self._connect(w)
        return w

    def _connect(self, w: WorkerInfo) -> None:
        """Build the worker's handle at admission: its channel, stubs and `Calls` client, so that no request pays
        for (or races on) making them. Outside an event loop (a registry built before one runs) they are made on
        first use instead: a grpc.aio channel belongs to the loop it is made on."""
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return
        self._stub(w, health_pb2_grpc.HealthStub)
        if w.role == "prefill":
            self.prefill_stub(w)
        else:
            self.decode_stub(w)
        if self.multiplexed:
            self._calls(w)

    def _left(self, w: WorkerInfo) -> None:
        """`w` left the registry: its name is kept for its address for a while (`_forget_names`)."""
        self._gone[w.role, w.address] = time.monotonic()
        self._gone.move_to_end((w.role, w.address))
        self._forget_names()

    def _forget_names(self) -> None:
        """Forget the names of addresses gone for `name_retention_s`, and beyond the `max_gone_names` most recently
        gone."""
        now = time.monotonic()
        while self._gone:
            key, since = next(iter(self._gone.items()))
            if len(self._gone) <= self.max_gone_names and now - since < self.name_retention_s:
                break  # oldest first: the rest are kept too
            del self._gone[key]
            self._names.pop(key, None)

    def remove(self, address: str) -> WorkerInfo:
        """Remove a worker now: the attempts that still need it end as a worker marked down's do (`on_closing`: the
        dispatcher retries or migrates them), then its channel closes."""
        w = self.workers.pop(address)
        self._left(w)
        self._close(w)
        return w

    def retire(self, address: str, drain_s: float) -> WorkerInfo:
        """Remove a worker gently: no request picks it from now on, while the calls already on it may go on for up
        to `drain_s` (its channel is closed when the last one ends, or then). The attempts still on it then end as
        on `remove` (the dispatcher retries or migrates them)."""
        w = self.workers.pop(address)
        self._left(w)
        task = asyncio.ensure_future(self._close_when_idle(w, drain_s))
        self._draining.add(task)
        task.add_done_callback(self._draining.discard)
        return w

    async def _close_when_idle(self, w: WorkerInfo, drain_s: float) -> None:
        deadline = time.monotonic() + drain_s
        while w.in_flight > 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        self._close(w)

    def _close(self, w: WorkerInfo) -> None:
        """Close the channel to `w`, a worker no longer registered: first the attempts that still need it are ended
        (`on_closing`), so that none takes the closed channel's cancel of its calls for its client's; `closed` keeps
        every later call off the channel."""
        if w.closed:
            return
        w.closed = True
        for callback in self.on_closing:
            try:
                callback(w)
            except Exception:  # one broken callback must not keep the others from their attempts, nor the close
                logger.exception("on_closing callback for %s worker %s failed", w.role, w.address)
        if w.channel is not None:
            task = asyncio.ensure_future(w.channel.close())
            self._draining.add(task)
            task.add_done_callback(self._draining.discard)

    def healthy(self, role: str) -> list[WorkerInfo]:
        return [w for w in self.workers.values() if w.role == role and w.healthy]

    def channel(self, w: WorkerInfo) -> grpc.aio.Channel:
        if w.channel is None:
            # Pings and reconnects as every channel a pdspark service opens (`rpc/keepalive.py`).
            w.channel = aio_channel(w.address, w.role, CHANNEL_OPTIONS, self._peer)
        return w.channel

    def renew_channels(self) -> bool:
        """Under mutual TLS, once this router's certificate files changed (`PeerCredentials.refresh`, which looks
        at most every second): every worker gets a new channel, its stubs and `Calls` client, so that calls from now
        on present the new certificate (a channel keeps its credentials for every reconnection, and the old
        certificate may expire); the calls on the old channel finish there, and it closes once they ended (at most
        `renew_drain_s` on). True when the channels were renewed."""
        if self._peer is None or not self._peer.refresh():
            return False
        for w in self.workers.values():
            if w.closed or w.channel is None:
                continue
            old_channel, old_calls = w.channel, w.calls
            w.channel, w.stubs, w.calls = None, {}, None
            self._connect(w)
            task = asyncio.ensure_future(_close_once_idle(old_channel, old_calls, self.renew_drain_s))
            self._draining.add(task)
            task.add_done_callback(self._draining.discard)
        logger.info("channels to %d workers renewed with the new certificate", len(self.workers))
        return True

    def prefill_stub(self, w: WorkerInfo) -> worker_pb2_grpc.PrefillWorkerStub:
        return self._stub(w, worker_pb2_grpc.PrefillWorkerStub)

    def decode_stub(self, w: WorkerInfo) -> worker_pb2_grpc.DecodeWorkerStub:
        return self._stub(w, worker_pb2_grpc.DecodeWorkerStub)

    def prefill_call(self, w: WorkerInfo, request: worker_pb2.PrefillRequest, timeout: float,
                     metadata: Sequence[tuple[str, str]] | None) -> Awaitable[worker_pb2.PrefillResponse]:
        """A Prefill call to `w`: awaited, its response; a failure raises `grpc.aio.AioRpcError`."""
        if self.multiplexed:
            return self._calls(w).call("prefill", request, timeout, metadata).response()
        return self.prefill_stub(w).Prefill(request, timeout=timeout, metadata=metadata)

    def generate_call(self, w: WorkerInfo, request: worker_pb2.GenerateRequest, timeout: float,
                      metadata: Sequence[tuple[str, str]] | None) -> grpc.aio.UnaryStreamCall | MultiplexedCall:
        """A Generate call to `w`: iterated, its chunks; a failure raises `grpc.aio.AioRpcError`; `cancel()` ends it
        (iterating it then raises `asyncio.CancelledError`)."""
        if self.multiplexed:
            return self._calls(w).call("generate", request, timeout, metadata)
        return self.decode_stub(w).Generate(request, timeout=timeout, metadata=metadata)

    def _calls(self, w: WorkerInfo) -> MultiplexedClient:
        if w.calls is None:
            w.calls = MultiplexedClient(self.channel(w), _CALLS_METHOD[w.role])
        return w.calls

    def _stub(self, w: WorkerInfo, kind: Callable[[grpc.aio.Channel], S]) -> S:
        stub = w.stubs.get(kind)
        if stub is None:
            stub = w.stubs[kind] = kind(self.channel(w))
        return stub

    async def check(self, w: WorkerInfo) -> bool:
        """One liveness check: True when the worker answered SERVING within `health_timeout_s`. Marks the worker
        unhealthy after `max_failures` misses in a row, and healthy again as the module doc says."""
        try:
            health = self._stub(w, health_pb2_grpc.HealthStub)
            reply = await health.Check(health_pb2.HealthCheckRequest(service=""), timeout=self.health_timeout_s)
            ok = reply.status == health_pb2.HealthCheckResponse.SERVING
        except (TimeoutError, grpc.aio.AioRpcError):
            ok = False
        now = time.monotonic()
        w.failures = 0 if ok else w.failures + 1
        w.last_check = time.time()
        if w.healthy:
            if w.failures >= self.max_failures:
                self._mark_down(w)
            elif ok and w.downs and now - w.healthy_since >= self.stable_s:
                w.downs = 0  # stable again: its next fall counts as a first one
        elif not ok:
            w.answering_since = None
        else:
            w.answering_since = w.answering_since if w.answering_since is not None else now
            if now - w.answering_since >= self.readmit_wait_s(w):
                logger.info("%s worker %s is healthy again", w.role, w.address)
                w.healthy, w.healthy_since, w.answering_since = True, now, None
        if ok:  # after the re-admission above: a waiter woken now finds the worker healthy
            w.answered_at = now
            self._answered.set()
            self._answered = asyncio.Event()
        return ok

    async def wait_answering(self, role: str, since: float, within_s: float) -> WorkerInfo | None:
        """A healthy worker of `role` that answered a health check after `since` (`time.monotonic()`): the first
        there is, waited for up to `within_s`; None when there is none by then."""
        deadline = time.monotonic() + within_s
        while True:
            answered = [w for w in self.healthy(role) if w.answered_at > since]
            if answered:
                return answered[0]
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._answered.wait(), remaining)

    def readmit_wait_s(self, w: WorkerInfo) -> float:
        """How long an unhealthy worker must answer every check before it is re-admitted."""
        if w.downs <= 1:
            return 0.0
        return min(self.readmit_backoff_s * 2.0 ** min(w.downs - 2, 62), self.max_readmit_backoff_s)

    def _mark_down(self, w: WorkerInfo) -> None:
        w.healthy, w.answering_since = False, None
        w.downs += 1
        logger.warning("%s worker %s missed %d health checks in a row; marking it unhealthy (re-admitted after "
                       "answering for %.1f s)", w.role, w.address, w.failures, self.readmit_wait_s(w))
        for callback in self.on_down:
            try:
                callback(w)
            except Exception:  # one broken callback must not stop the others, nor the health watch
                logger.exception("on_down callback for %s worker %s failed", w.role, w.address)

    async def poll_load(self, w: WorkerInfo) -> bool:
        """One load report; False when none came within `load_interval_s` (the last one stays)."""
        stub = self.prefill_stub(w) if w.role == "prefill" else self.decode_stub(w)
        try:
            load = await stub.GetLoad(worker_pb2.LoadRequest(), timeout=self.load_interval_s)
        except (TimeoutError, grpc.aio.AioRpcError) as e:
            logger.debug("%s worker %s sent no load report: %s", w.role, w.address, e)
            return False
        w.queued, w.quarantined_slots = load.queued, load.quarantined_slots
        w.quarantined_pages = dict(load.quarantined_pages)
        w.ranks = list(load.rank_states)
        w.reported_load = load.running + load.waiting + load.queued + load.quarantined_slots
        w.metrics_url = w.metrics_url or load.metrics_url  # a URL given at registration wins
        compat = convert.compat_from_pb(load.compat) if load.HasField("compat") else None
        if compat is not None and (w.compat is None or compat.schema_version != w.compat.schema_version):
            logger.info("%s worker %s reports transfer schema version %d", w.role, w.name, compat.schema_version)
        w.compat = compat
        w.last_load = time.time()
        return True

    async def poll_forever(self) -> None:
        """Watch every registered worker (those added later too) until cancelled."""
        watched: dict[str, tuple[WorkerInfo, list[asyncio.Task]]] = {}
        try:
            while True:
                for address, (w, tasks) in list(watched.items()):
                    if self.workers.get(address) is not w:  # removed (or replaced under the same address)
                        for t in tasks:
                            t.cancel()
                        del watched[address]
                for address, w in list(self.workers.items()):
                    if address not in watched:
                        watched[address] = (w, [asyncio.create_task(_every(self.health_interval_s, self.check, w)),
                                                asyncio.create_task(_every(self.load_interval_s, self.poll_load, w))])
                await asyncio.sleep(self.health_interval_s)  # how soon a worker added at run time is watched
        finally:
            for _, tasks in watched.values():
                for t in tasks:
                    t.cancel()


async def _close_once_idle(channel: grpc.aio.Channel, calls: MultiplexedClient | None, within_s: float) -> None:
    """Close a replaced channel once the calls on it ended, or `within_s` on (those still running then end
    CANCELLED, as when a worker is removed)."""
    deadline = time.monotonic() + within_s
    if calls is not None:  # (the `Calls` stream is one long call: wait for the calls multiplexed on it)
        while calls.in_flight > 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.1)  # (a poll period, not a bound: the deadline bounds the wait)
        await calls.close()
    await channel.close(grace=max(0.0, deadline - time.monotonic()))  # (waits for the per-request calls)


async def _every(interval_s: float, poll: Callable[[WorkerInfo], Awaitable[bool]], w: WorkerInfo) -> None:
    """`poll(w)` every `interval_s` (at once again when one took longer): a missed answer is followed up at once.
    Ends once the worker's channel is closed (removed: `poll_forever` cancels the watch at its next round)."""
    while not w.closed:
        started = time.monotonic()
        try:
            await poll(w)
        except Exception:  # a bug in one poll must not end the watch (an unwatched worker is never re-checked)
            logger.exception("polling %s worker %s failed", w.role, w.address)
        await asyncio.sleep(max(0.0, interval_s - (time.monotonic() - started)))
