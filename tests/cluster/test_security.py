"""API and admin keys on real processes: the shared `keys_tls` cluster (`pdspark up --api-key K --admin-api-key A
--api-key-file F --tls` on the shipped model; tests/cluster_pool.py), every request over HTTPS or gRPC over TLS
trusting the run's CA. Generation needs K (HTTP and gRPC), the official `openai` client and the SDK work with it and
fail without it; only A administers workers; hostile values are 4xx; no key shows on a child's command line, in the
launcher's output (its services' stderr included) or in /metrics; a key added to the key file works after SIGHUP,
and a removed one stops working (the file and its keys are put back after).

The cluster is shared with test_tls.py (one boot, about 20 s on 2 shared cores): a test leaves it as it found it.
"""

from __future__ import annotations

import functools
import json
import os
import signal
import ssl
import time
import urllib.error
import urllib.request
from pathlib import Path

import openai
import pytest

from cluster_pool import ADMIN_KEY, API_KEY, FILE_KEY
from pdspark.client import Client, ClientError, TLSOptions
from pdspark.errors import ErrorCode
from pdspark.launch.service_process import ServiceProcess
from pdspark.testing.time_scale import scaled

K, A = API_KEY, ADMIN_KEY
ROTATED = "k-rotated-0123456789abcdef"  # the key the SIGHUP test puts in the key file in place of FILE_KEY


@pytest.fixture(scope="module")
def cluster(keys_tls) -> ServiceProcess:
    return keys_tls


@pytest.fixture(scope="module")
def key_file(cluster_pool) -> Path:
    return cluster_pool.key_file


@functools.cache
def trusting(ca: str) -> ssl.SSLContext:
    """An HTTPS context trusting the run's CA (and only it)."""
    return ssl.create_default_context(cafile=ca)


def openai_client(cluster: ServiceProcess, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=cluster.info["http"] + "/v1", api_key=key, max_retries=0,
                         http_client=openai.DefaultHttpxClient(verify=trusting(cluster.info["ca"])))


def request(cluster: ServiceProcess, method: str, path: str, body: bytes | dict | None = None,
            key: str | None = None) -> tuple[int, dict]:
    data = body if body is None or isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    req = urllib.request.Request(cluster.info["http"] + path, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=scaled(60), context=trusting(cluster.info["ca"])) as r:
            raw = r.read()
            return r.status, json.loads(raw) if r.headers.get_content_type() == "application/json" else {}
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
GENERATION = [("POST", "/v1/completions", {"prompt": "def f():", "max_tokens": 2}),
              ("POST", "/v1/chat/completions", CHAT), ("GET", "/v1/models", None),
              ("POST", "/generate", {"text": "x", "sampling_params": {"max_new_tokens": 2}})]


def test_generation_needs_the_api_key(cluster):
    for method, path, body in GENERATION:
        for key in (None, "wrong-key-0123456789"):
            status, reply = request(cluster, method, path, body, key)
            assert status == 401 and reply["error"]["type"] == "authentication_error", (path, reply)
        assert request(cluster, method, path, body, K)[0] == 200, path
    assert request(cluster, "GET", "/health")[0] == 200  # probes need no key


def test_the_openai_client_works_with_the_key_only(cluster):
    assert cluster.info["http"].startswith("https://")
    model = cluster.info["model"]
    client = openai_client(cluster, K)
    reply = client.completions.create(model=model, prompt="def fibonacci(n):", max_tokens=4, temperature=0)
    assert reply.usage.completion_tokens >= 1
    chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert chat.choices[0].message.role == "assistant"
    wrong = openai_client(cluster, "wrong-key-0123456789")
    with pytest.raises(openai.AuthenticationError):
        wrong.completions.create(model=model, prompt="x", max_tokens=2)


def test_the_sdk_with_and_without_the_key(cluster, monkeypatch):
    monkeypatch.delenv("PDSPARK_API_KEY", raising=False)
    tls = TLSOptions.from_files(ca=cluster.info["ca"])
    with Client(cluster.info["grpc"], timeout=scaled(60), tls=tls, api_key=K) as client:
        assert client.generate("def f():", max_tokens=3, temperature=0, ignore_eos=True).completion_tokens == 3
    for kwargs in ({}, {"api_key": "wrong-key-0123456789"}):
        with (Client(cluster.info["grpc"], timeout=scaled(60), tls=tls, **kwargs) as client,
              pytest.raises(ClientError) as e):
            client.generate("def f():", max_tokens=3)
        assert (e.value.code, e.value.error_code) == ("UNAUTHENTICATED", ErrorCode.UNAUTHENTICATED)
    monkeypatch.setenv("PDSPARK_API_KEY", K)
    with Client(cluster.info["grpc"], timeout=scaled(60), tls=tls) as client:
        assert client.generate("x", max_tokens=2, ignore_eos=True).completion_tokens == 2


def test_only_the_admin_key_administers_workers(cluster):
    new = {"role": "decode", "address": "127.0.0.1:1"}
    for key, want in ((None, 401), (K, 403)):
        assert request(cluster, "POST", "/workers", new, key)[0] == want
        assert request(cluster, "GET", "/workers", None, key)[0] == want
        assert request(cluster, "DELETE", "/workers?address=127.0.0.1:1", None, key)[0] == want
    status, listed = request(cluster, "GET", "/workers", None, A)
    assert status == 200 and sorted(w["name"] for w in listed) == ["decode-1", "prefill-0"]
    assert request(cluster, "POST", "/workers", new, A)[0] == 201
    assert request(cluster, "DELETE", "/workers?address=127.0.0.1:1", None, A)[0] == 200
    # Worker addresses reach the admin only.
    body = {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 2}}
    assert request(cluster, "POST", "/generate", body, K)[1]["meta_info"]["decode_worker"] == ""
    assert request(cluster, "POST", "/generate", body, A)[1]["meta_info"]["decode_worker"].startswith("127.0.0.1:")


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {"prompt": "x", "seed": 2**70}, "seed"),
    ("/v1/completions", {"prompt": "x", "top_k": 2**40}, "top_k"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 10**12}, "max_tokens"),
    ("/v1/completions", {"prompt": {"text": "x"}}, "prompt"),
    ("/v1/completions", {"prompt": [5, 10**6]}, "prompt"),
    ("/generate", {"input_ids": [5, 2**31 - 1]}, "input_ids"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
])
def test_hostile_values_are_4xx(cluster, path, body, param):
    status, reply = request(cluster, "POST", path, body, K)
    assert 400 <= status < 500 and reply["error"]["param"] == param, reply


def test_an_80_mb_body_is_413_and_without_a_key_401(cluster):
    body = b'{"prompt": "' + b"x" * (80 << 20) + b'"}'
    status, reply = request(cluster, "POST", "/v1/completions", body, K)
    assert status == 413 and reply["error"]["code"] == "request_too_large"
    assert request(cluster, "POST", "/v1/completions", body)[0] == 401


def test_no_key_on_a_command_line_in_the_output_or_in_metrics(cluster):
    for name, service in cluster.info["services"].items():
        with open(f"/proc/{service['pid']}/cmdline", "rb") as f:
            argv = f.read().decode()
        assert K not in argv and A not in argv, name
        if name != "router":  # the router has its keys in its environment; the workers none
            with open(f"/proc/{service['pid']}/environ", "rb") as f:
                environ = f.read().decode()
            assert K not in environ and A not in environ, name
    output = "".join(cluster.log) + json.dumps(cluster.events)
    with urllib.request.urlopen(cluster.info["http"] + "/metrics", timeout=scaled(10),  # open: for scrapers
                                context=trusting(cluster.info["ca"])) as r:
        metrics = r.read().decode()
    assert 'pdspark_router_auth_failures_total{api="http",reason="invalid_key"}' in metrics
    for text in (output, metrics):
        assert K not in text and A not in text and ROTATED not in text and FILE_KEY not in text
    assert "127.0.0.1:" not in metrics  # workers are named there, not addressed


def test_a_key_file_is_read_again_on_sighup(cluster, key_file):
    assert request(cluster, "GET", "/v1/models", None, FILE_KEY)[0] == 200
    before = key_file.read_text()
    try:
        reload_keys(cluster, key_file, f"{ROTATED}\n", accepted=ROTATED)
        assert request(cluster, "GET", "/v1/models", None, FILE_KEY)[0] == 401
        assert request(cluster, "GET", "/v1/models", None, K)[0] == 200  # --api-key's keys stay
    finally:  # the shared cluster as it was: the file's old text, its key accepted, the rotated one not
        reload_keys(cluster, key_file, before, accepted=FILE_KEY)
    assert request(cluster, "GET", "/v1/models", None, ROTATED)[0] == 401


def test_a_changed_key_file_is_read_again_without_a_signal(cluster, key_file):
    """As a Kubernetes Secret volume updates it: the file is replaced (a new inode), nobody signals the router."""
    before = key_file.read_text()
    try:
        swap = key_file.with_name(key_file.name + ".new")
        swap.write_text(f"{ROTATED}\n")
        swap.chmod(0o600)
        os.replace(swap, key_file)
        deadline = time.monotonic() + scaled(10)  # (the router checks every 2 s)
        while request(cluster, "GET", "/v1/models", None, ROTATED)[0] != 200:
            assert time.monotonic() < deadline, "the rotated key is not accepted 10 s after the file changed"
            time.sleep(0.1)
        assert request(cluster, "GET", "/v1/models", None, FILE_KEY)[0] == 401
    finally:
        reload_keys(cluster, key_file, before, accepted=FILE_KEY)


def reload_keys(cluster: ServiceProcess, key_file: Path, text: str, accepted: str) -> None:
    """Write the key file, SIGHUP the launcher (it passes it to the router) and wait until `accepted` works."""
    key_file.write_text(text)
    os.kill(cluster.pid, signal.SIGHUP)
    deadline = time.monotonic() + scaled(10)
    while request(cluster, "GET", "/v1/models", None, accepted)[0] != 200:
        assert time.monotonic() < deadline, "the new key is not accepted 10 s after SIGHUP"
        time.sleep(0.1)
