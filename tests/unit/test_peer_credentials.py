"""The certificates a service dials its peers with (`PeerCredentials`) and serves HTTPS with (`PublicCertificate`):
read again once their files change, never taken half-rotated; the name a peer's certificate must carry."""

from __future__ import annotations

import os
import shutil
import socket
import ssl
import threading
from pathlib import Path

import pytest

from pdspark.config import TLSConfig
from pdspark.errors import ConfigError
from pdspark.rpc.throwaway_ca import ThrowawayCA
from pdspark.rpc.tls_credentials import PeerCredentials, PublicCertificate, peer_name
from pdspark.testing.time_scale import scaled


@pytest.fixture
def pki(tmp_path) -> tuple[ThrowawayCA, TLSConfig]:
    ca = ThrowawayCA(tmp_path)
    issued = ca.issue("router", "router")
    cert, key = tmp_path / "tls.crt", tmp_path / "tls.key"
    shutil.copy(issued.cert, cert)
    shutil.copy(issued.key, key)
    return ca, TLSConfig(tls_cert=str(cert), tls_key=str(key), tls_ca=ca.ca_path)


def rotate(ca: ThrowawayCA, tls: TLSConfig, *, key_too: bool = True) -> None:
    issued = ca.issue("router", "router")
    if key_too:
        os.replace(issued.key, tls.tls_key)
    os.replace(issued.cert, tls.tls_cert)


def test_a_changed_pair_is_read_again_and_a_half_written_one_waits(pki):
    ca, tls = pki
    clock = [0.0]
    peer = PeerCredentials(tls, check_every_s=1.0, clock=lambda: clock[0])
    first = peer.credentials
    assert not peer.refresh()  # (too soon, and unchanged)
    clock[0] = 1.0
    assert not peer.refresh() and peer.generation == 0  # unchanged
    rotate(ca, tls, key_too=False)  # the certificate replaced, its key not yet
    clock[0] = 2.0
    assert not peer.refresh() and peer.credentials is first and peer.generation == 0
    rotate(ca, tls)
    assert not peer.refresh()  # looked at no more than every second
    clock[0] = 3.0
    assert peer.refresh() and peer.credentials is not first and peer.generation == 1
    clock[0] = 4.0
    assert not peer.refresh() and peer.generation == 1


def test_a_missing_or_mismatched_file_at_start_is_a_config_error_naming_the_option(pki, tmp_path):
    ca, tls = pki
    other = ca.issue("other", "router")
    with pytest.raises(ConfigError, match="`tls_key` is not the private key of `tls_cert`"):
        PeerCredentials(TLSConfig(tls_cert=tls.tls_cert, tls_key=other.key, tls_ca=ca.ca_path))
    with pytest.raises(ConfigError, match="cannot read `tls_ca`"):
        PeerCredentials(TLSConfig(tls_cert=tls.tls_cert, tls_key=tls.tls_key, tls_ca=str(tmp_path / "none.pem")))


@pytest.mark.parametrize("template, role, address, name", [
    (None, "prefill", "10.0.0.1:50051", None),
    ("{ip}.rel-{role}.ns.svc", "prefill", "10.0.0.1:50051", "10-0-0-1.rel-prefill.ns.svc"),
    ("{ip}.rel-{role}.ns.svc", "decode", "[fd00::1]:50051", "fd00--1.rel-decode.ns.svc"),
    ("pdspark-workers.ns.svc", "decode", "10.0.0.1:50051", "pdspark-workers.ns.svc"),
])
def test_the_name_a_peer_must_carry(template, role, address, name):
    assert peer_name(template, role, address) == name


@pytest.mark.parametrize("template, message", [
    ("{host}.rel.svc", r"unknown field \{host\}; allowed: \{role\}, \{ip\}"),
    ("{ip}.Rel_{role}.svc", "a lower-case DNS name once"),
    ("{ip", "expected '}'"),
])
def test_a_bad_peer_name_is_refused_naming_the_field(template, message, pki):
    _, tls = pki
    with pytest.raises(ConfigError, match=r"`tls_peer_name`.*" + message):
        TLSConfig(tls_cert=tls.tls_cert, tls_key=tls.tls_key, tls_ca=tls.tls_ca, tls_peer_name=template)
    with pytest.raises(ConfigError, match="`tls_peer_name` is given without"):
        TLSConfig(tls_peer_name="{ip}.rel.svc")


def test_the_https_pair_is_loaded_again_once_its_files_changed(pki):
    ca, tls = pki
    public = PublicCertificate(tls.tls_cert, tls.tls_key)
    assert not public.refresh()
    rotate(ca, tls, key_too=False)
    assert not public.refresh()  # a key that is not the certificate's: the pair in use stays
    rotate(ca, tls)
    assert public.refresh()
    # The context serves the new pair: a handshake over a socket pair shows it.
    client = ssl.create_default_context(cafile=ca.ca_path)
    served = _handshake(public.context, client)
    assert served == ssl.PEM_cert_to_DER_cert(Path(tls.tls_cert).read_text())


def _handshake(server_ctx: ssl.SSLContext, client_ctx: ssl.SSLContext) -> bytes:
    """The DER certificate `server_ctx` shows a client (over a connected socket pair)."""
    a, b = socket.socketpair()
    b.settimeout(scaled(10))  # (every wait bounded: a handshake on one machine takes milliseconds)
    a.settimeout(scaled(10))

    def serve():
        with server_ctx.wrap_socket(a, server_side=True) as s:
            s.recv(1)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    with client_ctx.wrap_socket(b, server_hostname="localhost") as c:
        der = c.getpeercert(binary_form=True) or b""
        c.sendall(b"x")
    thread.join(scaled(10))
    assert not thread.is_alive()
    return der
