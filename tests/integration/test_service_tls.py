"""Mutual TLS between services, in one process: stub workers served as `WorkerServer` serves them under `--tls-*`
(client certificates required, `PeerRoleInterceptor`), the router's `WorkerRegistry` calling them. Only peers with a
certificate of the cluster's CA get through (plain text, no certificate, another CA's: no answer); each RPC is
taken only from the role that makes it, streams included; the options and the certificates `pdspark up --tls`
makes for every service. The real-process acceptance is tests/cluster/test_tls.py."""

from __future__ import annotations

import asyncio
import dataclasses
import stat
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from grpc_health.v1 import health_pb2_grpc

from pdspark.cli import build_parser
from pdspark.config import RouterConfig, TLSConfig, UpConfig, WorkerConfig
from pdspark.errors import ConfigError, ErrorCode
from pdspark.launch.plan import plan_cluster
from pdspark.options import parse_args, parse_options
from pdspark.router.workers.worker_registry import WorkerRegistry
from pdspark.rpc.keepalive import SERVER_OPTIONS
from pdspark.rpc.multiplexed_client import MultiplexedClient
from pdspark.rpc.peer_roles import PeerRoleInterceptor
from pdspark.rpc.status import failure_from_rpc_error
from pdspark.rpc.throwaway_ca import ROLE_URI_PREFIX, ThrowawayCA
from pdspark.rpc.tls_credentials import PeerCredentials, aio_channel, server_credentials
from pdspark.testing.time_scale import scaled
from pdspark.testing.worker_stubs import StubDecode, StubHealth
from pdspark.v1 import worker_pb2, worker_pb2_grpc


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """A CA with a certificate per role, and a second CA's router certificate (a stranger)."""
    folder = tmp_path_factory.mktemp("pki")
    ca = ThrowawayCA(folder)
    certs = {role: ca.issue(role, role) for role in ("router", "prefill", "decode")}
    other = ThrowawayCA(tmp_path_factory.mktemp("other"))
    stranger = other.issue("router", "router")
    tls = {role: TLSConfig(c.cert, c.key, ca.ca_path) for role, c in certs.items()}
    tls["stranger"] = TLSConfig(stranger.cert, stranger.key, ca.ca_path)
    unnamed = ca.issue("unnamed", None)  # as an operator's PKI without the role SAN would issue it
    tls["unnamed"] = TLSConfig(unnamed.cert, unnamed.key, ca.ca_path)
    return tls


async def serve_decode(tls: TLSConfig) -> tuple[grpc.aio.Server, StubDecode, str]:
    server = grpc.aio.server(options=SERVER_OPTIONS, interceptors=[PeerRoleInterceptor()])
    stub = StubDecode(tokens=3)
    worker_pb2_grpc.add_DecodeWorkerServicer_to_server(stub, server)
    health_pb2_grpc.add_HealthServicer_to_server(StubHealth(), server)
    port = server.add_secure_port("127.0.0.1:0", server_credentials(tls))
    await server.start()
    return server, stub, f"127.0.0.1:{port}"


def test_only_peers_with_a_certificate_of_the_ca_reach_a_worker(pki):
    async def main():
        server, _, address = await serve_decode(pki["decode"])
        try:
            results = {}
            for name, tls in (("router", pki["router"]), ("plain", None), ("stranger", pki["stranger"])):
                registry = WorkerRegistry(health_timeout_s=2.0, tls=tls)
                w = registry.add("decode", address)
                results[name] = await registry.check(w)
                await registry.channel(w).close()
            return results
        finally:
            await server.stop(None)

    assert asyncio.run(main()) == {"router": True, "plain": False, "stranger": False}


def test_each_rpc_only_from_the_role_that_makes_it(pki):
    async def call(role: str, address: str) -> tuple[list[str], ErrorCode | None]:
        async with aio_channel(address, "decode", [], PeerCredentials(pki[role])) as channel:
            stub = worker_pb2_grpc.DecodeWorkerStub(channel)
            # The Generate call as it is, and multiplexed on a `Calls` stream (`--worker-calls multiplexed`).
            calls = MultiplexedClient(channel, "/pdspark.v1.DecodeWorker/Calls")
            chunks, codes = [], set()
            for call in (lambda: stub.Generate(worker_pb2.GenerateRequest(request_id="r"), timeout=scaled(10)),
                         lambda: calls.call("generate", worker_pb2.GenerateRequest(request_id="m"),
                                            timeout=scaled(10))):
                try:
                    chunks += [c.text async for c in call()]
                except grpc.aio.AioRpcError as e:
                    codes.add(failure_from_rpc_error(e).code)
            try:
                await stub.GetLoad(worker_pb2.LoadRequest(), timeout=scaled(10))
            except grpc.aio.AioRpcError as e:
                codes.add(failure_from_rpc_error(e).code)
            assert len(codes) <= 1, codes  # each call refused alike, or none
            return chunks, codes.pop() if codes else None

    async def main():
        server, stub, address = await serve_decode(pki["decode"])
        try:
            return {role: await call(role, address) for role in ("router", "prefill", "decode", "unnamed")}, stub
        finally:
            await server.stop(None)

    results, stub = asyncio.run(main())
    assert results["router"] == (["r;"] * 3 + ["m;"] * 3, None)  # the streams pass through the check whole
    assert results["prefill"] == results["decode"] == ([], ErrorCode.PERMISSION_DENIED)
    # A certificate naming no role: the CA is the whole boundary (docs/operations.md, Security).
    assert results["unnamed"] == (["r;"] * 3 + ["m;"] * 3, None)
    # Refused before the handler ran: the worker never saw those calls.
    assert [c.request_id for c in stub.calls] == ["r", "m", "r", "m"]


def test_half_a_tls_configuration_is_refused():
    with pytest.raises(ConfigError, match="tls_cert"):
        parse_args(WorkerConfig, ["--tls-cert", "c.pem", "--tls-key", "k.pem"], {}, role="decode")
    with pytest.raises(ConfigError, match="ssl_keyfile"):
        parse_args(RouterConfig, ["--ssl-certfile", "c.pem"], {})
    cfg = parse_args(WorkerConfig, [], {"PDSPARK_TLS_CERT": "c", "PDSPARK_TLS_KEY": "k", "PDSPARK_TLS_CA": "a"},
                     role="decode")
    assert cfg.tls.enabled and not WorkerConfig(role="decode").tls.enabled


def test_an_unreadable_certificate_is_a_configuration_error_naming_the_option(pki, tmp_path):
    with pytest.raises(ConfigError, match="`tls_key`"):
        server_credentials(dataclasses.replace(pki["decode"], tls_key=str(tmp_path / "missing.key")))
    (tmp_path / "junk.pem").write_text("not a certificate")
    with pytest.raises(ConfigError, match="`tls_ca`.*no PEM"):
        server_credentials(dataclasses.replace(pki["decode"], tls_ca=str(tmp_path / "junk.pem")))


def test_up_tls_gives_every_service_its_own_certificate(tmp_path):
    folder = tmp_path / "certs"
    folder.mkdir(mode=0o700)
    cfg = parse_args(UpConfig, ["--tls", "--prefill", "1", "--decode", "2", "--port", "0", "--grpc-port", "0",
                                "--max-model-len", "256"], {})
    plan = plan_cluster(cfg, str(folder))
    parser = build_parser()
    ca = str(folder / "ca.pem")
    for s in plan.workers:
        args = parser.parse_args(s.argv)
        w = parse_options(WorkerConfig, args, {}, fixed={"role": args.role})
        assert w.tls == TLSConfig(str(folder / f"{s.name}.pem"), str(folder / f"{s.name}.key"), ca), s.name
        cert = x509.load_pem_x509_certificate(Path(w.tls.tls_cert).read_bytes())
        sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        assert sans.get_values_for_type(x509.UniformResourceIdentifier) == [ROLE_URI_PREFIX + args.role]
        assert "localhost" in sans.get_values_for_type(x509.DNSName)
    router = parse_options(RouterConfig, parser.parse_args(plan.router.argv), {})
    assert router.tls.tls_ca == ca and router.ssl_certfile == router.tls.tls_cert == str(folder / "router.pem")
    assert sorted(p.name for p in folder.iterdir()) == sorted(
        ["ca.pem"] + [f"{n}.{ext}" for n in ("prefill-0", "decode-1", "decode-2", "router") for ext in ("pem", "key")])
    assert all(stat.S_IMODE(k.stat().st_mode) == 0o600 for k in folder.glob("*.key"))
    assert not any("BEGIN" in a for s in plan.services for a in s.argv)  # paths on the command line, no PEM
