"""Certificates as cert-manager issues them, on real processes (router, prefill and decode workers over mutual TLS,
the cache over Mooncake): each worker's certificate names only Service DNS names (`*.pdspark-prefill.test.svc`: no
IP, no localhost), the router and the decode worker check them by name (`--tls-peer-name
'{ip}.pdspark-{role}.test.svc'`), and every certificate is rotated under load — first to certificates of a new CA
trusted beside the old one, then to the new CA alone — as Secret volumes rotate them (the files swapped in one step,
nobody signalled):

- no request fails, and every answer equals the offline engine's;
- new connections to each worker get its new certificate;
- the router and the decode worker present their new certificates too: a prefill worker started again trusting
  only the new CA serves them (a channel made before the rotation would offer a certificate of the old CA, which
  the new worker refuses).
"""

from __future__ import annotations

import functools
import os
import socket
import ssl
import threading
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdspark import SamplingParams
from pdspark.rpc.throwaway_ca import ThrowawayCA
from pdspark.testing.services import ready, spawn_worker, start_router
from pdspark.testing.time_scale import scaled
from pdspark.testing.waiting import wait_until

MODEL = "dsv4-tiny"
ENGINE = ["--max-model-len", "256", "--max-num-seqs", "8"]
PEER_NAME = "{ip}.pdspark-{role}.test.svc"
NAMES = {"router": ("pdspark-router.test.svc",), "prefill": ("*.pdspark-prefill.test.svc",),
         "decode": ("*.pdspark-decode.test.svc",)}
PROMPTS = [f"def task_{i}(items):\n" for i in range(4)]
MAX_TOKENS = 8
CLIENTS = 3  # requests in flight at once, each client sending one after the other


class SecretVolume:
    """A directory laid out as the kubelet lays out a Secret volume: `tls.crt` -> `..data/tls.crt`, `..data` ->
    a timestamped directory; an update writes a new directory and swaps `..data` in one rename."""

    FILES = ("tls.crt", "tls.key", "ca.crt")

    def __init__(self, path: Path):
        self.path = path
        path.mkdir()
        self._versions = 0

    def write(self, cert: bytes, key: bytes, ca: bytes) -> None:
        self._versions += 1
        version = self.path / f"..v{self._versions}"
        version.mkdir()
        for name, data in zip(self.FILES, (cert, key, ca)):
            (version / name).write_bytes(data)
        (version / "tls.key").chmod(0o600)
        link = self.path / "..data_tmp"
        os.symlink(version.name, link)
        os.replace(link, self.path / "..data")  # (the one atomic step)
        for name in self.FILES:
            if not (self.path / name).is_symlink():
                os.symlink(f"..data/{name}", self.path / name)

    def flags(self) -> list[str]:
        return ["--tls-cert", str(self.path / "tls.crt"), "--tls-key", str(self.path / "tls.key"),
                "--tls-ca", str(self.path / "ca.crt"), "--tls-peer-name", PEER_NAME]


def issue(ca: ThrowawayCA, role: str) -> tuple[bytes, bytes]:
    issued = ca.issue(role, role, NAMES[role], loopback=False)
    return Path(issued.cert).read_bytes(), Path(issued.key).read_bytes()


def served_certificate(address: str, name: str, volume: SecretVolume) -> bytes:
    """The DER certificate a new TLS connection to `address` is shown, checked for `name` against `volume`'s CA,
    presenting `volume`'s certificate."""
    host, port = address.rsplit(":", 1)
    ctx = ssl.create_default_context(cafile=str(volume.path / "ca.crt"))
    ctx.load_cert_chain(str(volume.path / "tls.crt"), str(volume.path / "tls.key"))
    ctx.set_alpn_protocols(["h2"])
    with socket.create_connection((host, int(port)), timeout=scaled(10)) as raw, \
            ctx.wrap_socket(raw, server_hostname=name) as tls:
        der = tls.getpeercert(binary_form=True)
    assert der is not None
    return der


def health(address: str, volume: SecretVolume, name: str | None) -> bool:
    """A health check of the worker at `address` with `volume`'s certificate, its certificate checked for `name`
    (None: the address dialled)."""
    credentials = grpc.ssl_channel_credentials(*(Path(volume.path / f).read_bytes()
                                                 for f in ("ca.crt", "tls.key", "tls.crt")))
    options = [] if name is None else [("grpc.ssl_target_name_override", name)]
    with grpc.secure_channel(address, credentials, options=options) as channel:
        try:
            stub = health_pb2_grpc.HealthStub(channel)
            return stub.Check(health_pb2.HealthCheckRequest(), timeout=scaled(5)).status == \
                health_pb2.HealthCheckResponse.SERVING
        except grpc.RpcError:
            return False


def dns_name(address: str, role: str) -> str:
    return PEER_NAME.format(role=role, ip=address.rsplit(":", 1)[0].replace(".", "-"))


def ready_status(router) -> int:
    try:
        with urllib.request.urlopen(router.info["http"] + "/health", timeout=scaled(5)) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


class Load:
    """`CLIENTS` threads sending completions (greedy, streamed every other one) until stopped: what came back."""

    def __init__(self, router, expected: dict[str, str]):
        self.client = openai.OpenAI(base_url=router.info["http"] + "/v1", api_key="none", max_retries=0,
                                    timeout=scaled(60))
        self.expected = expected
        self.done = 0
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(CLIENTS)]

    def __enter__(self) -> Load:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(scaled(60))  # (each request is bounded by the client's 60 s timeout)
        assert not any(t.is_alive() for t in self._threads)

    def _run(self, i: int) -> None:
        n = 0
        while not self._stop.is_set():
            prompt = PROMPTS[(i + n) % len(PROMPTS)]
            stream = n % 2 == 1
            n += 1
            try:
                if stream:
                    text = "".join(c.choices[0].text for c in self.client.completions.create(
                        model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, stream=True))
                else:
                    text = self.client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS,
                                                          temperature=0).choices[0].text
                ok = text == self.expected[prompt]
                outcome = None if ok else f"{prompt!r}: {text!r} != {self.expected[prompt]!r}"
            except openai.OpenAIError as e:
                outcome = f"{prompt!r}: {type(e).__name__}: {e}"
            with self._lock:
                self.done += 1
                if outcome is not None:
                    self.failures.append(outcome)

    def count(self) -> int:
        with self._lock:
            return self.done

    def wait_for(self, more: int, what: str) -> None:
        """Until `more` requests after now completed (bounded: each takes well under a second here)."""
        target = self.count() + more
        wait_until(lambda: self.count() >= target, 60, what, lambda: f"{self.count()} of {target} done; "
                   f"failures: {self.failures[:3]}")


@pytest.fixture(scope="module")
def expected(offline_reference) -> dict[str, str]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    outs = offline_reference.outputs(MODEL, PROMPTS, [params] * len(PROMPTS))
    return {p: o.text for p, o in zip(PROMPTS, outs)}


def test_service_name_certificates_rotate_under_load_without_a_failed_request(tmp_path, expected):
    for name in ("old-ca", "new-ca"):
        (tmp_path / name).mkdir()
    old_ca, new_ca = ThrowawayCA(tmp_path / "old-ca"), ThrowawayCA(tmp_path / "new-ca", "pdspark second CA")
    old_pem, new_pem = Path(old_ca.ca_path).read_bytes(), Path(new_ca.ca_path).read_bytes()
    volumes = {role: SecretVolume(tmp_path / role) for role in NAMES}
    for role, volume in volumes.items():
        volume.write(*issue(old_ca, role), old_pem)
    prefill, decode = ready(spawn_worker("prefill", MODEL, *ENGINE, *volumes["prefill"].flags()),
                            spawn_worker("decode", MODEL, *ENGINE, *volumes["decode"].flags()))
    services = [prefill, decode]
    try:
        router = start_router(MODEL, [prefill], [decode], *volumes["router"].flags())
        services.append(router)
        p_addr, d_addr = prefill.info["address"], decode.info["address"]
        # Only the Service name verifies: dialled by its IP the worker's certificate matches nothing.
        assert not health(p_addr, volumes["router"], None)
        assert health(p_addr, volumes["router"], dns_name(p_addr, "prefill"))
        with Load(router, expected) as load:
            load.wait_for(2 * CLIENTS, "requests before the rotation")
            # 1. Every certificate from the new CA; both CAs trusted (a rotation's overlap).
            for role, volume in volumes.items():
                volume.write(*issue(new_ca, role), old_pem + new_pem)
            for address, role in ((p_addr, "prefill"), (d_addr, "decode")):
                fresh = ssl.PEM_cert_to_DER_cert((volumes[role].path / "tls.crt").read_text())
                shows = functools.partial(served_certificate, address, dns_name(address, role), volumes["router"])
                wait_until(lambda shows=shows, fresh=fresh: shows() == fresh, 10,
                           f"new connections to the {role} worker get its new certificate")
            load.wait_for(4 * CLIENTS, "requests after the first step")
            # 2. The old CA no longer trusted anywhere.
            for volume in volumes.values():
                volume.write((volume.path / "tls.crt").read_bytes(), (volume.path / "tls.key").read_bytes(),
                             new_pem)
            load.wait_for(4 * CLIENTS, "requests after the second step")
        assert not load.failures, load.failures
        # The router's and the decode worker's channels present the new certificates: a prefill worker started
        # again on its port (trusting only the new CA) serves through them.
        prefill.stop()
        wait_until(lambda: ready_status(router) == 503, 30, "the router sees the prefill worker gone")
        (prefill,) = ready(spawn_worker("prefill", MODEL, *ENGINE, *volumes["prefill"].flags(),
                                        "--port", p_addr.rsplit(":", 1)[1]))
        services[0] = prefill
        wait_until(lambda: ready_status(router) == 200, 30, "the router takes the prefill worker back")
        client = openai.OpenAI(base_url=router.info["http"] + "/v1", api_key="none", max_retries=0,
                               timeout=scaled(60))
        for prompt in PROMPTS:
            got = client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
            assert got.choices[0].text == expected[prompt]
        assert load.done >= 10 * CLIENTS
    finally:
        for service in reversed(services):
            service.stop()
