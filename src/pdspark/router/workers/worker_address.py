"""`address_problem`: whether a worker's address given at run time (`POST /workers`) is host:port: a DNS name, an IPv4
address or an IPv6 address in brackets, then a port in [1, 65535]. Checked before the registry takes it, so that a
typo is refused naming the field, not registered as a worker that never passes a health check."""

from __future__ import annotations

import ipaddress
import re

EXPECTED = "host:port (a DNS name, an IPv4 address or an IPv6 address in brackets; a port in [1, 65535])"
# A DNS label (RFC 1123): letters, digits and inner hyphens, 1 to 63 of them.
_LABEL = re.compile(r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)")
_MAX_NAME_CHARS = 253
_SHOWN_CHARS = 100  # of a refused address in the message: a body may hold megabytes of one


def address_problem(address: str, field: str = "address") -> str | None:
    """Why `address` is not a worker's host:port, as a message naming `field` and the expected form; None when it
    is one."""
    host, colon, port = address.rpartition(":")
    if colon and port.isascii() and port.isdigit() and 0 < int(port) <= 65535 and _is_host(host):
        return None
    shown = address if len(address) <= _SHOWN_CHARS else address[:_SHOWN_CHARS] + "..."
    hint = "; an IPv6 address goes in brackets ([::1]:50051)" if host.count(":") > 0 and "[" not in host else ""
    return f"`{field}` must be {EXPECTED}, not {shown!r}{hint}"


def _is_host(host: str) -> bool:
    if host.startswith("[") and host.endswith("]"):
        return _is_ip(host[1:-1], ipaddress.IPv6Address)
    labels = host.removesuffix(".").split(".")  # a fully qualified name may end in a dot
    if all(label.isascii() and label.isdigit() for label in labels):  # numbers only: an IPv4 address or nothing
        return _is_ip(host, ipaddress.IPv4Address)
    return len(host) <= _MAX_NAME_CHARS and all(_LABEL.fullmatch(label) for label in labels)


def _is_ip(text: str, kind: type[ipaddress.IPv4Address] | type[ipaddress.IPv6Address]) -> bool:
    try:
        kind(text)
    except ValueError:
        return False
    return True
