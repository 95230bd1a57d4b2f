"""`ApiKeys`: the router's API and admin keys, who presented which, and what each caller may do.

The rules (docs/operations.md, "Security"):
- Generation (`/v1/*`, `/generate`, the gRPC `Router` service) needs an API key or an admin key once API keys are
  configured; without any it is open, as a development router is.
- Registering and removing workers (`POST`/`DELETE /workers`) needs an admin key, and is off while none is
  configured. An API key never administers workers.
- Listing workers (`GET /workers`, and `GET /prometheus/targets`, Prometheus's service discovery) and seeing their
  addresses anywhere else (`/generate`'s `meta_info`, gRPC chunks, error messages) needs an admin key too, except
  on a development router: no key of either kind configured and bound to a loopback address, whose only callers are
  this machine's users.
- `/health`, `/live`, `/metrics` and `/openapi.json` are open: probes and scrapers carry no key, and none shows a key,
  a prompt or a worker's address (per-worker metrics are labelled by the worker's name).

NOTE: keys are held only as SHA-256 digests, and a presented key's digest is compared with every configured one by
`hmac.compare_digest`, all of them on every call: neither which key matched nor any key's length shows in the
timing, and no key is kept in memory to leak into a log, a repr or a traceback.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import ipaddress
import logging
import os
import stat
from dataclasses import dataclass
from pathlib import Path

from pdspark.config import AuthConfig
from pdspark.errors import ConfigError, ErrorCode, RequestFailed

logger = logging.getLogger(__name__)

# Shorter keys are guessable by brute force over the network: said at startup (without the key).
MIN_KEY_CHARS = 16
_ADMIN_OPTION = "--admin-api-key (or PDSPARK_ADMIN_API_KEY, --admin-api-key-file)"


class Access(enum.Enum):
    """What a route or a response needs, from the least to the most."""

    OPEN = "open"
    GENERATE = "generate"
    LIST_WORKERS = "list workers"  # also: see a worker's address
    MANAGE_WORKERS = "register or remove workers"


class Role(enum.IntEnum):
    ANONYMOUS = 0  # no key, or one that matches none
    CLIENT = 1  # an API key
    ADMIN = 2  # an admin key (it may generate too)


@dataclass(frozen=True)
class Caller:
    """Who sent a request, as far as its key tells."""

    role: Role
    key_id: str = ""  # an opaque name of the key (not the key): per-key limits count by it; "" without a valid key
    presented: bool = False  # whether the request carried a key at all (a missing key and a wrong one read apart)


ANONYMOUS = Caller(Role.ANONYMOUS)


def bearer_token(authorization: str | None) -> str | None:
    """The key of an `Authorization: Bearer <key>` value (HTTP header or gRPC metadata), else None."""
    if not authorization:
        return None
    scheme, _, token = authorization.strip().partition(" ")
    return (token.strip() or None) if scheme.lower() == "bearer" else None


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve anywhere
        return False


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def _read_keys(path: str | None, option: str) -> list[str]:
    """One key per line; blank lines and `#` comments are skipped."""
    if path is None:
        return []
    try:
        text = Path(path).read_text()
        mode = os.stat(path).st_mode
    except OSError as e:
        raise ConfigError(f"cannot read `{option}` {path}: {e.strerror}") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        logger.warning("%s %s is readable by other users of this machine (chmod 600 it)", option, path)
    keys = [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    if not keys:
        raise ConfigError(f"`{option}` {path} holds no key")
    return keys


class ApiKeys:
    def __init__(self, auth: AuthConfig, host: str):
        """Raises ConfigError when a key file cannot be read or holds no key."""
        self.auth = auth
        # A development router: nothing configured and only this machine can reach it.
        self.development = not auth.configured and is_loopback(host)
        self._client: tuple[bytes, ...] = ()
        self._admin: tuple[bytes, ...] = ()
        self.reload()

    def reload(self) -> None:
        """Read the keys again (the files may have changed: rotation). Raises ConfigError, keeping the keys in use,
        when a file cannot be read or a key would be both kinds."""
        client = [*self.auth.api_key, *_read_keys(self.auth.api_key_file, "api_key_file")]
        admin = [*self.auth.admin_api_key, *_read_keys(self.auth.admin_api_key_file, "admin_api_key_file")]
        if set(client) & set(admin):
            raise ConfigError("a key is both an API key and an admin key; give the admin a key of its own")
        short = sum(len(k) < MIN_KEY_CHARS for k in (*client, *admin))
        if short:
            logger.warning("%d of the configured keys are shorter than %d characters: guessable", short,
                           MIN_KEY_CHARS)
        self._client = tuple(_digest(k) for k in dict.fromkeys(client))
        self._admin = tuple(_digest(k) for k in dict.fromkeys(admin))
        if self.auth.configured:
            logger.info("keys loaded: %d API key(s), %d admin key(s)", len(self._client), len(self._admin))

    def files_version(self) -> tuple:
        """What changes when a key file changes: each file's inode, size and modification time (a Kubernetes Secret
        volume swaps a symlink to a new file; an editor rewrites in place). Unreadable files count as missing."""
        out: list[tuple[str, int | None, int | None, int | None]] = []
        for path in (self.auth.api_key_file, self.auth.admin_api_key_file):
            if path is None:
                continue
            try:
                st = os.stat(path)
                out.append((str(path), st.st_ino, st.st_size, st.st_mtime_ns))
            except OSError:
                out.append((str(path), None, None, None))
        return tuple(out)

    @property
    def generation_needs_key(self) -> bool:
        return bool(self._client)

    def identify(self, authorization: str | None) -> Caller:
        """The caller presenting the `Authorization` value `authorization` (`Bearer <key>`)."""
        token = bearer_token(authorization)
        if token is None:
            return Caller(Role.ANONYMOUS, presented=authorization is not None)
        digest = _digest(token)
        admin, client = _match(digest, self._admin), _match(digest, self._client)
        if admin:
            return Caller(Role.ADMIN, admin, True)
        if client:
            return Caller(Role.CLIENT, client, True)
        return Caller(Role.ANONYMOUS, presented=True)

    def refusal(self, caller: Caller, access: Access) -> RequestFailed | None:
        """Why `caller` may not have `access` (UNAUTHENTICATED: no valid key where one would do; PERMISSION_DENIED:
        no key could do, or the caller's cannot), or None when it may."""
        if access is Access.OPEN:
            return None
        if access is Access.GENERATE:
            if not self._client or caller.role >= Role.CLIENT:
                return None
            return _unauthenticated(caller, "an API key")
        if caller.role is Role.ADMIN or (access is Access.LIST_WORKERS and self.development):
            return None
        if not self._admin:
            off = "is off" if access is Access.MANAGE_WORKERS else "needs an admin key"
            return RequestFailed(ErrorCode.PERMISSION_DENIED, f"worker administration ({access.value}) {off}: start "
                                 f"the router with {_ADMIN_OPTION} and call with that key")
        if caller.role is Role.CLIENT:
            return RequestFailed(ErrorCode.PERMISSION_DENIED, f"an API key cannot {access.value}: use an admin key")
        return _unauthenticated(caller, "an admin key")

    def allows(self, caller: Caller, access: Access) -> bool:
        return self.refusal(caller, access) is None


def _match(digest: bytes, digests: tuple[bytes, ...]) -> str:
    """The key id of `digest` among `digests` ("" when none matches), after comparing it with every one."""
    found = ""
    for d in digests:
        if hmac.compare_digest(digest, d):
            found = d.hex()[:16]
    return found


def _unauthenticated(caller: Caller, which: str) -> RequestFailed:
    if caller.presented:
        return RequestFailed(ErrorCode.UNAUTHENTICATED, f"invalid key: this needs {which}")
    return RequestFailed(ErrorCode.UNAUTHENTICATED, f"this needs {which}: send it as `Authorization: Bearer <key>` "
                         "(an HTTP header, or gRPC metadata)")
