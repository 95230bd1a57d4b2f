"""Mutual TLS on real processes: the shared `keys_tls` cluster (`pdspark up --api-key K --admin-api-key A
--api-key-file F --tls` on the shipped model; tests/cluster_pool.py), every request to the router with the key K.
The `openai` client (trusting the printed CA) and the SDK (`TLSOptions` + API key) generate, greedy equal to the
offline engine, so the prefill -> decode transfer ran under mTLS; a plain-text client reaches neither the router nor
a worker, nor does a TLS client without a certificate of the cluster's CA; a worker takes each RPC only from the
role that makes it; no key or certificate material shows in the output, the events or any /metrics; the
certificates are private while the cluster runs and gone when it stops (checked by the pool as it stops the shape:
`ClusterPool.release`).

The cluster is shared with test_security.py (one boot, about 20 s on 2 shared cores): a test leaves it as it found
it.
"""

from __future__ import annotations

import json
import os
import ssl
import stat
import urllib.request
from pathlib import Path

import grpc
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cluster_pool import ADMIN_KEY, API_KEY
from pdspark import SamplingParams
from pdspark.client import Client, ClientError, TLSOptions
from pdspark.errors import ErrorCode
from pdspark.launch.service_process import ServiceProcess
from pdspark.testing.time_scale import scaled
from pdspark.v1 import worker_pb2, worker_pb2_grpc

K, A = API_KEY, ADMIN_KEY
PROMPT = "def fibonacci(n):"
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def cluster(keys_tls) -> ServiceProcess:
    return keys_tls


@pytest.fixture(scope="module")
def ca(cluster) -> str:
    return cluster.info["ca"]


@pytest.fixture(scope="module")
def offline_greedy(offline_reference) -> list[int]:
    return offline_reference.output("dsv4-tiny", PROMPT, SamplingParams(temperature=0, max_tokens=MAX_TOKENS,
                                                                        ignore_eos=True)).token_ids


def workers(cluster: ServiceProcess) -> dict[str, str]:
    return {name: s["address"] for name, s in cluster.info["services"].items() if name != "router"}


def credentials(ca: str, name: str | None) -> grpc.ChannelCredentials:
    """Trusting the cluster's CA; presenting service `name`'s certificate (None: no client certificate)."""
    folder = Path(ca).parent
    if name is None:
        return grpc.ssl_channel_credentials(Path(ca).read_bytes())
    return grpc.ssl_channel_credentials(Path(ca).read_bytes(), (folder / f"{name}.key").read_bytes(),
                                        (folder / f"{name}.pem").read_bytes())


def health_check(channel: grpc.Channel) -> grpc.StatusCode:
    try:
        health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=scaled(5))
    except grpc.RpcError as e:
        return e.code()
    return grpc.StatusCode.OK


def test_the_openai_client_generates_over_https_trusting_the_ca(cluster, ca, offline_greedy):
    assert cluster.info["http"].startswith("https://")
    client = openai.OpenAI(base_url=cluster.info["http"] + "/v1", api_key=K, max_retries=0,
                           http_client=openai.DefaultHttpxClient(verify=ssl.create_default_context(cafile=ca)))
    reply = client.completions.create(model=cluster.info["model"], prompt=PROMPT, max_tokens=MAX_TOKENS,
                                      temperature=0, extra_body={"ignore_eos": True})
    assert reply.usage.completion_tokens == MAX_TOKENS
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=cluster.info["http"] + "/v1", api_key="wrong-key-0123456789", max_retries=0,
                      http_client=openai.DefaultHttpxClient(verify=ssl.create_default_context(cafile=ca))
                      ).completions.create(model=cluster.info["model"], prompt="x", max_tokens=2)
    # A client that does not trust the CA, or speaks plain HTTP to the HTTPS port, gets nothing.
    with pytest.raises(openai.APIConnectionError):
        openai.OpenAI(base_url=cluster.info["http"] + "/v1", api_key=K, max_retries=0
                      ).completions.create(model=cluster.info["model"], prompt="x", max_tokens=2)
    with pytest.raises(openai.APIConnectionError):
        openai.OpenAI(base_url=cluster.info["http"].replace("https://", "http://") + "/v1", api_key=K,
                      max_retries=0, timeout=scaled(10)).completions.create(model=cluster.info["model"], prompt="x",
                                                                     max_tokens=2)


def test_the_sdk_generates_over_tls_and_equals_offline_greedy(cluster, ca, offline_greedy, monkeypatch):
    monkeypatch.delenv("PDSPARK_API_KEY", raising=False)
    tls = TLSOptions.from_files(ca=ca)
    with Client(cluster.info["grpc"], timeout=scaled(60), tls=tls, api_key=K) as client:
        result = client.generate(PROMPT, max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    # Greedy through router -> prefill -> (Mooncake) -> decode, every control RPC on mTLS, equals the offline run.
    assert result.token_ids == offline_greedy
    with (Client(cluster.info["grpc"], timeout=scaled(60), tls=tls, api_key="") as client,
          pytest.raises(ClientError) as e):
        client.generate(PROMPT, max_tokens=2)
    assert e.value.error_code is ErrorCode.UNAUTHENTICATED
    with Client(cluster.info["grpc"], timeout=scaled(10), api_key=K) as plain, pytest.raises(ClientError) as e:
        plain.generate(PROMPT, max_tokens=2)
    assert e.value.code == "UNAVAILABLE"


def test_a_worker_talks_only_to_peers_with_a_certificate_of_the_ca(cluster, ca):
    for name, address in workers(cluster).items():
        with grpc.insecure_channel(address) as plain:
            assert health_check(plain) == grpc.StatusCode.UNAVAILABLE, name
        with grpc.secure_channel(address, credentials(ca, None)) as anonymous:
            assert health_check(anonymous) == grpc.StatusCode.UNAVAILABLE, name
        with grpc.secure_channel(address, credentials(ca, "router")) as router:
            assert health_check(router) == grpc.StatusCode.OK, name


def test_a_worker_takes_each_rpc_only_from_the_role_that_makes_it(cluster, ca):
    addresses = workers(cluster)
    prefill, decode = addresses["prefill-0"], addresses["decode-1"]
    with grpc.secure_channel(prefill, credentials(ca, "router")) as channel:
        stub = worker_pb2_grpc.PrefillWorkerStub(channel)
        assert stub.GetLoad(worker_pb2.LoadRequest(), timeout=scaled(10)).running == 0
        with pytest.raises(grpc.RpcError) as e:  # a plan names memory to write: decode workers only
            stub.SubmitPlan(worker_pb2.TransferPlan(transfer_id="t"), timeout=scaled(10))
        assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
    with grpc.secure_channel(decode, credentials(ca, "prefill-0")) as channel:
        stub = worker_pb2_grpc.DecodeWorkerStub(channel)
        for call in (lambda: stub.GetLoad(worker_pb2.LoadRequest(), timeout=scaled(10)),
                     lambda: next(stub.Generate(worker_pb2.GenerateRequest(request_id="r"), timeout=scaled(10)))):
            with pytest.raises(grpc.RpcError) as e:
                call()
            assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED


def test_certificates_are_private_and_no_material_shows(cluster, ca):
    folder = Path(ca).parent
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    keys = sorted(folder.glob("*.key"))
    assert [k.stem for k in keys] == ["decode-1", "prefill-0", "router"]
    assert all(stat.S_IMODE(k.stat().st_mode) == 0o600 for k in keys)
    secrets = [k.read_text() for k in keys] + [p.read_text() for p in folder.glob("*.pem")]
    context = ssl.create_default_context(cafile=ca)
    texts = ["".join(cluster.log), json.dumps(cluster.events)]
    with urllib.request.urlopen(cluster.info["http"] + "/metrics", timeout=scaled(10), context=context) as r:
        texts.append(r.read().decode())
    for name, service in cluster.info["services"].items():
        if name != "router":
            with urllib.request.urlopen(f"http://127.0.0.1:{flag(service['pid'], '--metrics-port')}/metrics",
                                        timeout=scaled(10)) as r:
                texts.append(r.read().decode())
        texts.append(" ".join(argv_of(service["pid"])))
    for text in texts:
        assert "-----BEGIN" not in text and K not in text and A not in text
        for secret in secrets:
            body = "".join(secret.splitlines()[1:-1])  # the base64 of a key or certificate, in one piece
            assert body[:40] not in text.replace("\n", "")


def argv_of(pid: int) -> list[str]:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read().decode().split("\0")


def flag(pid: int, name: str) -> str:
    argv = argv_of(pid)
    return argv[argv.index(name) + 1]


def test_the_services_get_paths_not_contents(cluster, ca):
    for name, service in cluster.info["services"].items():
        assert flag(service["pid"], "--tls-ca") == ca, name
        assert os.path.dirname(flag(service["pid"], "--tls-key")) == os.path.dirname(ca), name
