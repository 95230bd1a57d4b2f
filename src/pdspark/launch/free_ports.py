"""Ports picked now for a service that binds them later (`pdspark up` gives every service fixed ports, so a restart
comes back at the address its peers know).

NOTE: outside the ephemeral range. A port found free is only free until its service binds it. The kernel hands out
ports of its ephemeral range (`ip_local_port_range`, 32768-60999 by default) to every `bind(port 0)` and every
outgoing connection, which is where a machine's churn is: Ray's workers and agents and gRPC's clients, starting
while the cluster starts, took a picked port from a worker group before it bound it. A port from below that range
(and above Ray's worker ports, 10002-19999, and Mooncake's handshake and transport ports, 12001 and 15000-17000) or
from above it is only taken by another process that picks fixed ports. Where the range cannot be read (not Linux)
or leaves nothing outside it, the kernel picks (`bind` to port 0) as before.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

_LOWEST = 20000  # see the note: the fixed ports of Ray and Mooncake lie below
_EPHEMERAL = Path("/proc/sys/net/ipv4/ip_local_port_range")
_TRIES = 200  # candidates tried per port wanted before giving up: each is taken with odds of (ports in use)/(range)
# The OS's randomness, not the `random` module's state: processes forked from one parent (which share that state)
# must not try the same ports in the same order.
_RANDOM = random.SystemRandom()


def free_ports(host: str, n: int, *, consecutive: bool = False, avoid: frozenset[int] = frozenset()) -> list[int]:
    """`n` distinct ports free on `host` now (all held while picking, so they differ), none of them in `avoid`
    (ports picked before and not bound yet); with `consecutive`, P, P+1, ... P+n-1. Another process may still take
    one before its service binds it (the note says why that is rare): a restart that fails so is retried like any
    failure, a first start stops `pdspark up` with the service's error."""
    if n == 0:
        return []
    family, _, _, _, address = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0]
    ranges = outside_ephemeral()
    held: list[socket.socket] = []
    try:
        for _ in range(_TRIES * n):
            if consecutive:  # a whole run from one candidate, or none of it
                for s in held:
                    s.close()
                held = []
                first = _bind(family, address, _candidate(ranges, n), avoid)
                if first is not None:
                    held.append(first)
                    for port in range(first.getsockname()[1] + 1, first.getsockname()[1] + n):
                        nxt = _bind(family, address, port, avoid)
                        if nxt is None:
                            break
                        held.append(nxt)
            else:  # one port more (a candidate taken, or one of these, is just tried again)
                one = _bind(family, address, _candidate(ranges, 1), avoid)
                if one is not None:
                    held.append(one)
            if len(held) == n:
                return [s.getsockname()[1] for s in held]
        raise OSError(f"no {n} free ports on {host} after {_TRIES * n} tries")
    finally:
        for s in held:
            s.close()


def outside_ephemeral() -> list[range]:
    """The port ranges from `_LOWEST` up that the kernel never hands out by itself; [] where it cannot be told."""
    try:
        low, high = (int(v) for v in _EPHEMERAL.read_text().split())
    except (OSError, ValueError):
        return []
    return [r for r in (range(_LOWEST, low), range(max(high + 1, _LOWEST), 65536)) if len(r) > 0]


def _candidate(ranges: list[range], run: int) -> int:
    """A random port with `run - 1` more after it inside one of `ranges`; 0 (the kernel picks) without ranges."""
    fits = [r for r in ranges if len(r) >= run]
    if not fits:
        return 0
    r = _RANDOM.choices(fits, weights=[len(r) - run + 1 for r in fits])[0]
    return _RANDOM.randrange(r.start, r.stop - run + 1)


def _bind(family: socket.AddressFamily, address: tuple, port: int, avoid: frozenset[int]) -> socket.socket | None:
    if port > 65535 or port in avoid:  # a consecutive run past the last port; a port promised elsewhere
        return None
    s = socket.socket(family, socket.SOCK_STREAM)
    try:
        s.bind((address[0], port, *address[2:]))
    except OSError:
        s.close()
        return None
    if s.getsockname()[1] in avoid:  # the kernel picked (port 0) one promised elsewhere
        s.close()
        return None
    return s
