"""API and admin keys on real processes: `pdspark up --api-key K --admin-api-key A` on the shipped model.
Generation needs K (HTTP and gRPC), the official `openai` client and the SDK work with it and fail without it;
only A administers workers; hostile values are 4xx; no key shows on a child's command line, in the launcher's
output or in /metrics; a key added to the key file works after SIGHUP, and a removed one stops working.

One cluster for the whole module (about 20 s to start on 2 shared cores).
"""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.error
import urllib.request

import openai
import pytest

from pdspark.client import Client, ClientError
from pdspark.errors import ErrorCode
from pdspark.launch.service_process import ServiceProcess, start_service
from pdspark.testing.time_scale import scaled

K, A = "k-client-0123456789abcdef", "a-admin-0123456789abcdef"
ROTATED = "k-rotated-0123456789abcdef"
ENGINE = ["--model", "dsv4-tiny", "--max-model-len", "256", "--max-num-seqs", "4", "--port", "0", "--grpc-port", "0"]


@pytest.fixture(scope="module")
def key_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("keys") / "api-keys"
    path.write_text(f"# the file's keys join --api-key's\n{ROTATED}-old\n")
    path.chmod(0o600)
    return path


@pytest.fixture(scope="module")
def cluster(key_file):
    service = start_service("pdspark up", ["up", *ENGINE, "--api-key", K, "--admin-api-key", A, "--api-key-file",
                                           str(key_file)], timeout=scaled(240), env={"OMP_NUM_THREADS": "1"})
    yield service
    assert service.stop() == 0


def request(cluster: ServiceProcess, method: str, path: str, body: bytes | dict | None = None,
            key: str | None = None) -> tuple[int, dict]:
    data = body if body is None or isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    req = urllib.request.Request(cluster.info["http"] + path, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=scaled(60)) as r:
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
    model = cluster.info["model"]
    client = openai.OpenAI(base_url=cluster.info["http"] + "/v1", api_key=K, max_retries=0)
    reply = client.completions.create(model=model, prompt="def fibonacci(n):", max_tokens=4, temperature=0)
    assert reply.usage.completion_tokens >= 1
    chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert chat.choices[0].message.role == "assistant"
    wrong = openai.OpenAI(base_url=cluster.info["http"] + "/v1", api_key="wrong-key-0123456789", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.completions.create(model=model, prompt="x", max_tokens=2)


def test_the_sdk_with_and_without_the_key(cluster, monkeypatch):
    monkeypatch.delenv("PDSPARK_API_KEY", raising=False)
    with Client(cluster.info["grpc"], timeout=scaled(60), api_key=K) as client:
        assert client.generate("def f():", max_tokens=3, temperature=0, ignore_eos=True).completion_tokens == 3
    for kwargs in ({}, {"api_key": "wrong-key-0123456789"}):
        with Client(cluster.info["grpc"], timeout=scaled(60), **kwargs) as client, pytest.raises(ClientError) as e:
            client.generate("def f():", max_tokens=3)
        assert (e.value.code, e.value.error_code) == ("UNAUTHENTICATED", ErrorCode.UNAUTHENTICATED)
    monkeypatch.setenv("PDSPARK_API_KEY", K)
    with Client(cluster.info["grpc"], timeout=scaled(60)) as client:
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
    with urllib.request.urlopen(cluster.info["http"] + "/metrics", timeout=scaled(10)) as r:  # open: for scrapers
        metrics = r.read().decode()
    assert 'pdspark_router_auth_failures_total{api="http",reason="invalid_key"}' in metrics
    for text in (output, metrics):
        assert K not in text and A not in text and ROTATED not in text
    assert "127.0.0.1:" not in metrics  # workers are named there, not addressed


def test_a_key_file_is_read_again_on_sighup(cluster, key_file):
    assert request(cluster, "GET", "/v1/models", None, f"{ROTATED}-old")[0] == 200
    key_file.write_text(f"{ROTATED}\n")
    os.kill(cluster.pid, signal.SIGHUP)  # the launcher passes it to the router
    deadline = time.monotonic() + scaled(10)
    while request(cluster, "GET", "/v1/models", None, ROTATED)[0] != 200:
        assert time.monotonic() < deadline, "the new key is not accepted 10 s after SIGHUP"
        time.sleep(0.1)
    assert request(cluster, "GET", "/v1/models", None, f"{ROTATED}-old")[0] == 401
    assert request(cluster, "GET", "/v1/models", None, K)[0] == 200  # --api-key's keys stay
