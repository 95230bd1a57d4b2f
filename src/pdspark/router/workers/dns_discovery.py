"""`DnsDiscovery`: workers found by resolving DNS names (`--prefill-dns`/`--decode-dns name:port`).

Made for Kubernetes headless Services, whose name resolves to the addresses of the ready pods behind it, and works
wherever DNS does: no Kubernetes API access, no RBAC. Every `interval_s` each name is resolved again (all its A and
AAAA addresses, `loop.getaddrinfo`):
- an address that appears is added to the registry as a worker of the name's role; the health checks decide when
  it serves, as for any worker;
- an address that vanishes is retired (`WorkerRegistry.retire`): no new request picks it, the calls on it may end
  within `drain_s`, and the policies forget it, as `DELETE /workers` does;
- a name whose resolver answers that it has no address (NXDOMAIN or no data: what a headless Service with no
  ready pod answers) for `empty_confirm_s` in a row (3 intervals by default) has zero workers: its addresses are
  retired. One such answer alone changes nothing (a pod set being replaced can answer empty for a moment);
- a name that fails to resolve otherwise (no answer in time, a temporary failure, the hosts file unreadable) keeps
  its last known addresses: a DNS outage never empties the cluster. A change of a name's state (failing, empty,
  resolving again) is logged once, not at every poll.
Only addresses discovery added are retired by it: workers from `--prefill`/`--decode` or `POST /workers` stay;
one of its own removed by `DELETE /workers` stays out until its address vanishes from DNS and appears again.
A worker's name (`prefill-3`) is the registry's, stable per address, so one that comes back keeps its series.

NOTE: `hosts_file` is a test/dev hook: a file in /etc/hosts format, re-read at every poll and consulted before DNS
(a name listed there is not looked up). Tests rewrite it to make addresses appear and vanish; a Helm chart rendered
and run as local processes resolves its Services' names through it.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
from collections.abc import Callable

from pdspark.config import DnsTarget
from pdspark.router.workers.worker_registry import WorkerInfo, WorkerRegistry

logger = logging.getLogger(__name__)
DRAIN_S = 30.0  # how long the calls on a vanished worker may go on (a terminating pod drains on SIGTERM)


class ResolveError(Exception):
    """A name did not resolve (no answer in time, a temporary failure): nothing is known of its addresses."""


class EmptyAnswer(ResolveError):
    """The resolver answered: the name has no address (NXDOMAIN, no data, an empty answer)."""


# getaddrinfo's codes for an answer that the name has no address (not an outage)
_NO_ADDRESS = {socket.EAI_NONAME, getattr(socket, "EAI_NODATA", socket.EAI_NONAME)}


def read_hosts_file(path: str) -> dict[str, list[str]]:
    """name (lower case) -> its addresses in file order, from a file in /etc/hosts format."""
    hosts: dict[str, list[str]] = {}
    with open(path, encoding="utf-8") as f:
        for line in f:
            fields = line.split("#", 1)[0].split()
            if len(fields) < 2:
                continue
            try:
                ip = str(ipaddress.ip_address(fields[0]))
            except ValueError:
                logger.warning("hosts file %s: %r is not an IP address; line skipped", path, fields[0])
                continue
            for name in fields[1:]:
                addresses = hosts.setdefault(name.lower(), [])
                if ip not in addresses:
                    addresses.append(ip)
    return hosts


def worker_address(ip: str, port: int) -> str:
    """The registry's `host:port` (IPv6 in brackets)."""
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"


class DnsDiscovery:
    """Admits and retires the workers behind `targets`; `run()` until cancelled.

    Args:
        registry: where workers are added and retired.
        targets: the names to resolve (`DiscoveryConfig.dns_targets`).
        interval_s: seconds between resolutions; one resolution may take as long before it counts as failed.
        hosts_file: the test/dev override consulted before DNS (module doc).
        on_admit: called with each worker added.
        on_retire: called with each worker retired (the policies forget it, metrics drop its series).
        drain_s: how long the calls on a retired worker may go on.
        empty_confirm_s: how long a name must answer "no address" before its workers are retired (default: 3
            intervals).
    """

    def __init__(self, registry: WorkerRegistry, targets: tuple[DnsTarget, ...], interval_s: float,
                 hosts_file: str | None = None, on_admit: Callable[[WorkerInfo], None] | None = None,
                 on_retire: Callable[[WorkerInfo], None] | None = None, drain_s: float = DRAIN_S,
                 empty_confirm_s: float | None = None):
        self.registry = registry
        self.targets = targets
        self.interval_s = interval_s
        self.hosts_file = hosts_file
        self.on_admit = on_admit
        self.on_retire = on_retire
        self.drain_s = drain_s
        self.known: dict[DnsTarget, frozenset[str]] = {t: frozenset() for t in targets}  # last addresses resolved
        self.failing: dict[DnsTarget, str] = {}  # target -> why its last resolution failed
        self.empty_confirm_s = 3 * interval_s if empty_confirm_s is None else empty_confirm_s
        self.empty_since: dict[DnsTarget, float] = {}  # target -> when its answers turned "no address"
        self.owned: dict[str, str] = {}  # address -> role, for the workers discovery added
        self.polls = 0  # resolution rounds done (tests wait on it)

    async def run(self) -> None:
        while True:
            started = asyncio.get_running_loop().time()
            try:
                await self.poll()
            except Exception:  # a bug in one round must not end discovery for good
                logger.exception("DNS discovery round failed")
            elapsed = asyncio.get_running_loop().time() - started
            await asyncio.sleep(max(0.0, self.interval_s - elapsed))

    async def poll(self) -> None:
        """One round: resolve every name, then admit and retire to match."""
        for target in self.targets:
            try:
                addresses = await self.resolve(target.name, target.port)
            except EmptyAnswer as e:
                self._empty(target, str(e))
                continue
            except ResolveError as e:
                if self.failing.get(target) != str(e):
                    logger.warning("%s DNS name %s does not resolve (%s); keeping its %d known address(es)",
                                   target.role, target.name, e, len(self.known[target]))
                self.failing[target] = str(e)
                continue
            if self.failing.pop(target, None) is not None:
                logger.info("%s DNS name %s resolves again", target.role, target.name)
            self.empty_since.pop(target, None)
            self.known[target] = addresses
        self._reconcile()
        self.polls += 1

    def _empty(self, target: DnsTarget, why: str) -> None:
        """A "no address" answer: zero workers once it has held for `empty_confirm_s`."""
        now = asyncio.get_running_loop().time()
        since = self.empty_since.setdefault(target, now)
        state = "empty" if now - since >= self.empty_confirm_s else "empty, unconfirmed"
        if self.failing.get(target) != state:
            if state == "empty":
                logger.warning("%s DNS name %s has answered no address for %.0f s (%s): zero workers; retiring its "
                               "%d address(es)", target.role, target.name, now - since, why, len(self.known[target]))
            else:
                logger.warning("%s DNS name %s answers no address (%s); its %d known address(es) stay until that "
                               "holds for %.0f s", target.role, target.name, why, len(self.known[target]),
                               self.empty_confirm_s)
        self.failing[target] = state
        if state == "empty":
            self.known[target] = frozenset()

    async def resolve(self, name: str, port: int) -> frozenset[str]:
        """Every `host:port` of `name` (the hosts file first, then DNS). Raises EmptyAnswer (the name has no
        address) or ResolveError (nothing known)."""
        if self.hosts_file is not None:
            try:
                hosts = read_hosts_file(self.hosts_file)
            except OSError as e:
                raise ResolveError(f"hosts file {self.hosts_file}: {e}") from e
            if name.lower() in hosts:
                return frozenset(worker_address(ip, port) for ip in hosts[name.lower()])
        loop = asyncio.get_running_loop()
        try:
            infos = await asyncio.wait_for(loop.getaddrinfo(name, port, type=socket.SOCK_STREAM), self.interval_s)
        except socket.gaierror as e:
            if e.errno in _NO_ADDRESS:
                raise EmptyAnswer(str(e)) from e
            raise ResolveError(str(e)) from e
        except (TimeoutError, OSError) as e:
            raise ResolveError(str(e) or "no answer in time") from e
        addresses = frozenset(worker_address(str(info[4][0]), port) for info in infos)
        if not addresses:
            raise EmptyAnswer("no addresses")
        return addresses

    def _reconcile(self) -> None:
        wanted: dict[str, str] = {}  # address -> role
        for target, addresses in self.known.items():
            for address in addresses:
                wanted.setdefault(address, target.role)
        for address, role in list(self.owned.items()):
            if wanted.get(address) != role:
                del self.owned[address]
                w = self.registry.workers.get(address)
                if w is None:  # removed meanwhile (DELETE /workers)
                    continue
                self.registry.retire(address, self.drain_s)
                logger.info("%s worker %s (%s) vanished from DNS; retired", w.role, w.name, address)
                if self.on_retire is not None:
                    self.on_retire(w)
        for address, role in sorted(wanted.items()):
            if address in self.owned or address in self.registry.workers:  # ours already, or from flags/POST
                continue
            w = self.registry.add(role, address)
            self.owned[address] = role
            logger.info("%s worker %s (%s) appeared in DNS; admitted", role, w.name, address)
            if self.on_admit is not None:
                self.on_admit(w)
