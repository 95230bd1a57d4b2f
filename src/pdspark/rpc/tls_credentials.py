"""gRPC and HTTPS credentials from the TLS options (`TLSConfig`, the router's `ssl_certfile`/`ssl_keyfile`), and the
channels every pdspark service opens to its peers.

- Between services (`TLSConfig`): mutual TLS. A worker's server requires a client certificate chaining to
  `tls_ca`; the router's and a decode worker's channels present their own and verify the peer's against the same
  CA (and its host name or IP against the certificate's SANs, as gRPC always does).
- The router's public ports: a server certificate only (HTTPS on the HTTP port, TLS on the gRPC port); clients
  authenticate with API keys, not certificates.

Files are read when the credentials are made (at start): a path that cannot be read is a `ConfigError` naming
the option, never a traceback with the file's contents. Key material never reaches a log or an error message. A
worker's server reads its certificate, key and CA again when they change (a rotation: a Secret volume swaps them
atomically): each new handshake checks the files' identity (inode, size, modification time) and, once they changed,
uses the new pair and CA; connections already made finish on theirs.
"""

from __future__ import annotations

import logging
import os
import ssl
from collections.abc import Sequence

import grpc

from pdspark.config import TLSConfig
from pdspark.errors import ConfigError

logger = logging.getLogger(__name__)


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
    """(certificate chain, private key, CA) of an enabled `tls`."""
    assert tls.tls_cert is not None and tls.tls_key is not None and tls.tls_ca is not None, "TLS is off"
    return (read_pem(tls.tls_cert, "tls_cert"), read_pem(tls.tls_key, "tls_key"), read_pem(tls.tls_ca, "tls_ca"))


def server_credentials(tls: TLSConfig) -> grpc.ServerCredentials:
    """A worker's: only peers whose certificate chains to the CA get past the handshake; the files read again once
    they change (the module doc)."""
    files = _ServerFiles(tls)
    return grpc.dynamic_ssl_server_credentials(files.configuration(), files.changed_configuration,
                                               require_client_authentication=True)


class _ServerFiles:
    """A server's certificate, key and CA files, and the identity they had when last read."""

    def __init__(self, tls: TLSConfig):
        self.tls = tls
        self._read_at = self._identity()

    def _identity(self) -> tuple:
        out: list[tuple[int, int, int] | None] = []
        for path in (self.tls.tls_cert, self.tls.tls_key, self.tls.tls_ca):
            try:
                st = os.stat(path)  # type: ignore[arg-type]  # (TLS is on: every path is set)
                out.append((st.st_ino, st.st_size, st.st_mtime_ns))
            except OSError:
                out.append(None)
        return tuple(out)

    def configuration(self) -> grpc.ServerCertificateConfiguration:
        cert, key, ca = _files(self.tls)
        return grpc.ssl_server_certificate_configuration([(key, cert)], root_certificates=ca)

    def changed_configuration(self) -> grpc.ServerCertificateConfiguration | None:
        """(gRPC, at each new handshake) The files again when they changed since last read; None: keep the pair in
        use (unchanged, or unreadable now: said once, and read when they change again)."""
        now = self._identity()
        if now == self._read_at:
            return None
        try:
            config = self.configuration()
        except ConfigError as e:
            logger.error("certificate files changed but cannot be read; the previous ones stay in use: %s", e)
            self._read_at = now
            return None
        self._read_at = now
        logger.info("certificate files changed: new connections use them")
        return config


def channel_credentials(tls: TLSConfig) -> grpc.ChannelCredentials:
    cert, key, ca = _files(tls)
    return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)


def aio_channel(address: str, tls: TLSConfig | None, options: Sequence[tuple[str, int]],
                credentials: grpc.ChannelCredentials | None = None) -> grpc.aio.Channel:
    """A channel to a peer service: mutual TLS when `tls` is enabled (pass `credentials` made once to skip reading
    the files again), else plain text."""
    if tls is None or not tls.enabled:
        return grpc.aio.insecure_channel(address, options=options)
    return grpc.aio.secure_channel(address, credentials or channel_credentials(tls), options=options)


def public_server_credentials(certfile: str, keyfile: str) -> grpc.ServerCredentials:
    """The router's gRPC port: TLS without client certificates."""
    pair = (read_pem(keyfile, "ssl_keyfile"), read_pem(certfile, "ssl_certfile"))
    return grpc.ssl_server_credentials([pair], require_client_auth=False)


def public_ssl_context(certfile: str, keyfile: str) -> ssl.SSLContext:
    """The router's HTTPS port (TLS 1.2 or later)."""
    read_pem(certfile, "ssl_certfile")  # the option named when a file is missing, as for gRPC
    read_pem(keyfile, "ssl_keyfile")
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        context.load_cert_chain(certfile, keyfile)
    except ssl.SSLError as e:  # a key that does not match the certificate, say
        raise ConfigError(f"`ssl_certfile` {certfile} / `ssl_keyfile` {keyfile}: {e.reason or e}") from None
    return context
