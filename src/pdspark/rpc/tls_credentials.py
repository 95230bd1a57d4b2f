"""gRPC and HTTPS credentials from the TLS options (`TLSConfig`, the router's `ssl_certfile`/`ssl_keyfile`), and the
channels every pdspark service opens to its peers.

- Between services (`TLSConfig`): mutual TLS. A worker's server requires a client certificate chaining to
  `tls_ca`; the router's and a decode worker's channels present their own and verify the peer's against the same
  CA (and its host name or IP against the certificate's SANs, as gRPC always does).
- The router's public ports: a server certificate only (HTTPS on the HTTP port, TLS on the gRPC port); clients
  authenticate with API keys, not certificates.

- Which name a worker's certificate must carry: the address dialled (gRPC's check), or `tls_peer_name` — a
  Service DNS name such as `{ip}.pdspark-prefill.ns.svc` (`peer_name`), which cert-manager can put in a
  certificate (`*.pdspark-prefill.ns.svc`) where it cannot put a pod's IP.

Files are read when the credentials are made (at start): a path that cannot be read is a `ConfigError` naming
the option, never a traceback with the file's contents. Key material never reaches a log or an error message.
Rotation (a Secret volume swaps the files atomically; nobody signals the process): every certificate is read again
once its files' identity (inode, size, modification time) changed and the new key matches the new certificate (a
pair caught half-written is read again at the next check). A worker's server checks at each new handshake
(`server_credentials`); the router's public ports when the router's file watch sees the change
(`PublicCertificate`); a service's channels to its peers through `PeerCredentials`, whose `generation` tells their
owner to make new channels (which present the new pair) while the calls on the old ones finish. Connections
already made always finish on what they were made with.
"""

from __future__ import annotations

import logging
import os
import ssl
import time
from collections.abc import Callable, Sequence
from typing import Generic, TypeVar

import grpc

from pdspark.config import TLSConfig
from pdspark.errors import ConfigError

logger = logging.getLogger(__name__)
T = TypeVar("T")


def read_pem(path: str, option: str) -> bytes:
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise ConfigError(f"cannot read `{option}` {path}: {e.strerror}") from None
    if b"-----BEGIN " not in data:
        raise ConfigError(f"`{option}` {path} holds no PEM block")
    return data


def _files(tls: TLSConfig) -> tuple[bytes, bytes, bytes]:
    """(certificate chain, private key, CA) of an enabled `tls`, the key checked to be the certificate's."""
    assert tls.tls_cert is not None and tls.tls_key is not None and tls.tls_ca is not None, "TLS is off"
    cert, key = read_pem(tls.tls_cert, "tls_cert"), read_pem(tls.tls_key, "tls_key")
    check_pair(cert, key, "tls_cert", "tls_key")
    return cert, key, read_pem(tls.tls_ca, "tls_ca")


def check_pair(cert: bytes, key: bytes, cert_option: str, key_option: str) -> None:
    """ConfigError unless `key` (PEM) is the private key of `cert`'s first certificate: a pair read while a
    rotation replaced one file and not yet the other would fail every handshake made with it."""
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    try:
        public = x509.load_pem_x509_certificate(cert).public_key()
        private = serialization.load_pem_private_key(key, password=None)
    except (ValueError, TypeError) as e:
        raise ConfigError(f"`{cert_option}` / `{key_option}` cannot be parsed: {type(e).__name__}") from None
    spki = serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    if public.public_bytes(*spki) != private.public_key().public_bytes(*spki):
        raise ConfigError(f"`{key_option}` is not the private key of `{cert_option}`")


def files_identity(paths: Sequence[str | None]) -> tuple:
    """What changes when one of `paths` is replaced or rewritten: each one's inode, size and modification time (a
    Kubernetes Secret volume swaps a symlink to new files; an editor rewrites in place); None for one missing."""
    out: list[tuple[int, int, int] | None] = []
    for path in paths:
        try:
            st = os.stat(path)  # type: ignore[arg-type]  # (None: fails as missing)
            out.append((st.st_ino, st.st_size, st.st_mtime_ns))
        except (OSError, TypeError):
            out.append(None)
    return tuple(out)


class WatchedFiles(Generic[T]):
    """What `read()` makes of some files, made again once they change: `value` at start (a bad file raises there,
    a `ConfigError` naming its option), then `changed()` — the new value when the files' identity changed and
    `read()` succeeds, else None (the value in use stays). A change that cannot be used yet (a file missing, a key
    not the certificate's: a rotation half done) is said once and read again only when the files change again."""

    def __init__(self, paths: Sequence[str | None], read: Callable[[], T], what: str):
        """`what`: the files, as the log names them ("public certificate files (HTTPS port)")."""
        self.paths, self.read, self.what = tuple(paths), read, what
        self._read_at = files_identity(self.paths)
        self._refused_at: tuple | None = None  # the identity of files that could not be used
        self.value = read()

    def changed(self) -> T | None:
        now = files_identity(self.paths)
        if now == self._read_at or now == self._refused_at:
            return None
        try:
            value = self.read()
        except ConfigError as e:
            logger.warning("%s changed but cannot be used yet; the previous ones stay: %s", self.what, e)
            self._refused_at = now
            return None
        self._read_at, self.value = now, value
        logger.info("%s changed: new connections use them", self.what)
        return value


def _server_configuration(tls: TLSConfig) -> grpc.ServerCertificateConfiguration:
    cert, key, ca = _files(tls)
    return grpc.ssl_server_certificate_configuration([(key, cert)], root_certificates=ca)


def server_credentials(tls: TLSConfig) -> grpc.ServerCredentials:
    """A worker's: only peers whose certificate chains to the CA get past the handshake; the files read again once
    they change, looked at by each new handshake (the module doc)."""
    files = WatchedFiles((tls.tls_cert, tls.tls_key, tls.tls_ca), lambda: _server_configuration(tls),
                         "certificate files")
    return grpc.dynamic_ssl_server_credentials(files.value, files.changed, require_client_authentication=True)


def channel_credentials(tls: TLSConfig) -> grpc.ChannelCredentials:
    cert, key, ca = _files(tls)
    return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)


def peer_name(template: str | None, role: str, address: str) -> str | None:
    """The name `address`'s certificate must carry under `tls_peer_name` `template` (None: the address itself):
    `{role}` filled in, `{ip}` the dialled host with '-' for '.' and ':' (a pod's name under a headless Service:
    10-0-0-1.pdspark-prefill.ns.svc)."""
    if template is None:
        return None
    host = address.rsplit(":", 1)[0].strip("[]")  # (host:port, [v6]:port)
    return template.format(role=role, ip=host.replace(".", "-").replace(":", "-"))


class PeerCredentials:
    """What a service dials its peers with under mutual TLS: its certificate and key, the CA, and the name a
    peer's certificate must carry (`tls_peer_name`). Read at start (a bad file is a `ConfigError` naming the
    option) and again by `refresh` once the files changed: `generation` counts the pairs read, and channels made
    after a refresh present the new pair. The owner of a channel made before replaces it and lets its calls finish
    (a gRPC channel keeps the credentials it was made with for every reconnection)."""

    def __init__(self, tls: TLSConfig, check_every_s: float = 1.0, clock: Callable[[], float] = time.monotonic):
        """`check_every_s`: `refresh` looks at the files at most this often (three `stat`s)."""
        self.tls = tls
        self._files = WatchedFiles((tls.tls_cert, tls.tls_key, tls.tls_ca), lambda: channel_credentials(tls),
                                   "certificate files (of channels to peers)")
        self.generation = 0
        self.check_every_s = check_every_s
        self._clock = clock
        self._next_check = clock() + check_every_s

    @property
    def credentials(self) -> grpc.ChannelCredentials:
        return self._files.value

    def refresh(self) -> bool:
        """Read the files again when they changed (looked at no more than every `check_every_s`); True when a new
        pair is in use from now on (`WatchedFiles.changed`)."""
        now = self._clock()
        if now < self._next_check:
            return False
        self._next_check = now + self.check_every_s
        if self._files.changed() is None:
            return False
        self.generation += 1
        return True

    def channel(self, address: str, role: str, options: Sequence[tuple[str, int | str]]) -> grpc.aio.Channel:
        """A mutual-TLS channel to the `role` worker at `address`, its certificate checked for `peer_name`."""
        name = peer_name(self.tls.tls_peer_name, role, address)
        if name is not None:
            options = [*options, ("grpc.ssl_target_name_override", name)]
        return grpc.aio.secure_channel(address, self.credentials, options=options)


def aio_channel(address: str, role: str, options: Sequence[tuple[str, int]],
                peer: PeerCredentials | None = None) -> grpc.aio.Channel:
    """A channel to the `role` peer service at `address`: mutual TLS with `peer`'s credentials, else plain text."""
    if peer is None:
        return grpc.aio.insecure_channel(address, options=options)
    return peer.channel(address, role, options)


def _public_pair(certfile: str, keyfile: str) -> tuple[bytes, bytes]:
    """The router's public (certificate, key), the key checked to be the certificate's."""
    cert, key = read_pem(certfile, "ssl_certfile"), read_pem(keyfile, "ssl_keyfile")
    check_pair(cert, key, "ssl_certfile", "ssl_keyfile")
    return cert, key


def public_server_credentials(certfile: str, keyfile: str) -> grpc.ServerCredentials:
    """The router's gRPC port: TLS without client certificates, the pair read again at a new handshake once its
    files changed (as a worker's)."""
    def configuration() -> grpc.ServerCertificateConfiguration:
        cert, key = _public_pair(certfile, keyfile)
        return grpc.ssl_server_certificate_configuration([(key, cert)])

    files = WatchedFiles((certfile, keyfile), configuration, "public certificate files (gRPC port)")
    return grpc.dynamic_ssl_server_credentials(files.value, files.changed, require_client_authentication=False)


class PublicCertificate:
    """The router's HTTPS context (TLS 1.2 or later), its pair loaded again by `refresh` once the files changed:
    OpenSSL copies a context's certificate into each connection as it starts, so new connections get the new pair
    and those made before keep theirs."""

    def __init__(self, certfile: str, keyfile: str):
        self.certfile, self.keyfile = certfile, keyfile
        self.context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        self.context.minimum_version = ssl.TLSVersion.TLSv1_2
        self._files = WatchedFiles((certfile, keyfile), self._load, "public certificate files (HTTPS port)")

    def _load(self) -> bool:
        _public_pair(self.certfile, self.keyfile)  # (the option named, as for gRPC)
        try:
            self.context.load_cert_chain(self.certfile, self.keyfile)
        except ssl.SSLError as e:  # (the files changed again between the check and the load)
            raise ConfigError(f"`ssl_certfile` {self.certfile} / `ssl_keyfile` {self.keyfile}: "
                              f"{e.reason or e}") from None
        return True

    def refresh(self) -> bool:
        """Load the pair again when its files changed; True when new connections get a new one."""
        return self._files.changed() is not None
