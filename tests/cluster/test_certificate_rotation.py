"""A worker's certificate rotated in place (as a Kubernetes Secret volume swaps its files): new connections get the
new certificate without a restart, a connection made before keeps working on the old one."""

from __future__ import annotations

import os
import socket
import ssl
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdspark.rpc.throwaway_ca import ThrowawayCA
from pdspark.testing.services import ready, spawn_worker
from pdspark.testing.time_scale import scaled


def served_certificate(address: str, ca: str, client_cert: str, client_key: str) -> bytes:
    """The DER certificate a new TLS connection to `address` is shown (presenting a client certificate of the CA)."""
    host, port = address.rsplit(":", 1)
    ctx = ssl.create_default_context(cafile=ca)
    ctx.load_cert_chain(client_cert, client_key)
    ctx.set_alpn_protocols(["h2"])
    with socket.create_connection((host, int(port)), timeout=scaled(10)) as raw, \
            ctx.wrap_socket(raw, server_hostname=host) as tls:
        der = tls.getpeercert(binary_form=True)
    assert der is not None
    return der


def der_of(pem_path: str) -> bytes:
    return ssl.PEM_cert_to_DER_cert(Path(pem_path).read_text())


def serving(channel: grpc.Channel) -> bool:
    answer = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=scaled(10))
    return answer.status == health_pb2.HealthCheckResponse.SERVING


def test_a_rotated_worker_certificate_serves_new_connections_and_old_ones_go_on(draft_ckpt, tmp_path):
    ca = ThrowawayCA(tmp_path)
    served = tmp_path / "served"
    served.mkdir()
    issued = ca.issue("prefill", "prefill")
    cert, key = str(served / "tls.crt"), str(served / "tls.key")
    os.replace(issued.key, key)
    os.replace(issued.cert, cert)
    client = ca.issue("router", "router")
    (worker,) = ready(spawn_worker("prefill", str(draft_ckpt), "--page-size", "16", "--max-model-len", "128",
                                   "--tls-cert", cert, "--tls-key", key, "--tls-ca", ca.ca_path))
    try:
        address = worker.info["address"]
        first = der_of(cert)
        assert served_certificate(address, ca.ca_path, client.cert, client.key) == first
        credentials = grpc.ssl_channel_credentials(*(Path(p).read_bytes() for p in (ca.ca_path, client.key,
                                                                                    client.cert)))
        with grpc.secure_channel(address, credentials) as before:
            assert serving(before)  # (a connection made on the first certificate)
            # The rotation, as a Secret volume does it: the new pair replaces the files, nobody signals the worker.
            renewed = ca.issue("prefill", "prefill")
            os.replace(renewed.key, key)
            os.replace(renewed.cert, cert)
            second = der_of(cert)
            assert second != first
            deadline = time.monotonic() + scaled(10)
            while served_certificate(address, ca.ca_path, client.cert, client.key) != second:
                assert time.monotonic() < deadline, "new connections still get the old certificate 10 s on"
                time.sleep(0.1)
            assert serving(before)  # the connection made before goes on
    finally:
        worker.stop()
