"""Rungs 7-8: through `pdspark up` (router + workers as processes), the official `openai` client and the gRPC SDK
get exactly the offline engine's greedy tokens; routing, bad requests and disconnects behave."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import time
import urllib.error
import urllib.request

import openai
import pytest

from cluster_pool import ADMIN_KEY
from conftest import random_prompts
from pdspark import SamplingParams
from pdspark.client import AsyncClient, Client
from pdspark.testing.services import start_router
from pdspark.testing.time_scale import scaled
from pdspark.testing.waiting import wait_until
from pdspark.testing.worker_load import WorkerAt, is_idle

# A stream with far more chunks left than the one or two a router writes before it notices a client gone (the
# shared `one_by_one` cluster serves 2,048 tokens of context).
LONG_TOKENS = 2000
# Worker administration needs an admin key (generation stays open: no API key); it travels by environment.
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
PROMPTS = ["def fibonacci(n):", "import os\nimport sys\n", "class Stack:\n    def push(self, x):"]


@pytest.fixture
def cluster(one_by_one) -> dict:
    """The shared 1 prefill + 1 decode cluster's ready line."""
    return one_by_one.info


@pytest.fixture(scope="module")
def offline(offline_reference, draft_ckpt):
    return offline_reference.engine(draft_ckpt)


def openai_client(info) -> openai.OpenAI:
    return openai.OpenAI(base_url=info["http"] + "/v1", api_key="none", max_retries=0)


def expected(offline, prompt: str, n: int) -> str:
    return offline.generate([prompt], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))[0].text


@pytest.mark.parametrize("stream", [False, True])
def test_openai_completions_equal_offline(cluster, offline, stream):
    client = openai_client(cluster)
    for prompt in PROMPTS:
        kw = dict(model=cluster["model"], prompt=prompt, max_tokens=20, temperature=0, extra_body={"ignore_eos": True})
        if stream:
            text = "".join(c.choices[0].text for c in client.completions.create(stream=True, **kw) if c.choices)
        else:
            resp = client.completions.create(**kw)
            text = resp.choices[0].text
            assert resp.usage.completion_tokens == 20 and resp.choices[0].finish_reason == "length"
        assert text == expected(offline, prompt, 20)


@pytest.mark.parametrize("stream", [False, True])
def test_openai_chat_equals_offline(cluster, offline, stream):
    client = openai_client(cluster)
    messages = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "a stack class"}]
    prompt = offline.engine.tokenizer.decode(
        offline.engine.tokenizer.encode(_render(offline, messages)), skip_special_tokens=False)
    kw = dict(model=cluster["model"], messages=messages, max_tokens=16, temperature=0, extra_body={"ignore_eos": True})
    if stream:
        chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert chunks[-1].usage.completion_tokens == 16 and chunks[0].choices[0].delta.role == "assistant"
    else:
        resp = client.chat.completions.create(**kw)
        text = resp.choices[0].message.content
    assert text == expected(offline, prompt, 16)


def _render(offline, messages) -> str:
    from pdspark.router.openai.chat_template import ChatTemplate

    return ChatTemplate(offline.engine.tokenizer.chat_template).render(messages)


def test_sdk_generate_and_stream_match(cluster, offline):
    with Client(cluster["grpc"], timeout=scaled(60)) as client:
        for prompt in PROMPTS[:2]:
            want = expected(offline, prompt, 18)
            result = client.generate(prompt, max_tokens=18, temperature=0, ignore_eos=True)
            assert result.text == want and result.completion_tokens == 18 and result.finish_reason == "length"
            streamed = "".join(c.text for c in client.stream(prompt, max_tokens=18, temperature=0, ignore_eos=True))
            assert streamed == want


def test_a_router_of_two_processes_serves_the_offline_tokens(one_by_one, offline, draft_ckpt):
    """`--processes 2` in front of the shared workers: the OpenAI API (each request on a connection of its own, so
    both processes serve: all on one, probability 2^-11) and the SDK give the offline tokens, and `/metrics` counts
    every request once."""
    services = one_by_one.info["services"]

    class At:
        def __init__(self, role: str):
            self.address = next(s["address"] for name, s in services.items() if name.startswith(role))

    router = start_router(str(draft_ckpt), [At("prefill")], [At("decode")], "--processes", "2",
                          "--served-model-name", one_by_one.info["model"])
    try:
        info = router.info
        assert info["processes"] == 2
        prompts = PROMPTS * 4
        seen = set()
        for prompt in prompts:
            with openai_client(info) as c:  # a client, and so a connection, of its own
                text = c.completions.create(model=info["model"], prompt=prompt, max_tokens=12, temperature=0,
                                            extra_body={"ignore_eos": True}).choices[0].text
            assert text == expected(offline, prompt, 12)
            with urllib.request.urlopen(info["http"] + "/live", timeout=scaled(10)) as r:
                seen.add(json.loads(r.read())["process"])
        assert seen == {0, 1}
        with Client(info["grpc"], timeout=scaled(60)) as client:
            streamed = "".join(c.text for c in client.stream(PROMPTS[0], max_tokens=12, temperature=0,
                                                             ignore_eos=True))
        assert streamed == expected(offline, PROMPTS[0], 12)
        with urllib.request.urlopen(info["http"] + "/metrics", timeout=scaled(10)) as r:
            metrics = r.read().decode()
        assert f'pdspark_router_requests_total{{api="completions",outcome="ok"}} {len(prompts)}.0' in metrics
        assert 'pdspark_router_requests_total{api="grpc",outcome="ok"} 1.0' in metrics
    finally:
        router.stop()


def test_async_sdk(cluster, offline):
    import asyncio

    async def run():
        async with AsyncClient(cluster["grpc"], timeout=scaled(60)) as client:
            result = await client.generate(token_ids=[5, 6, 7, 8], max_tokens=10, temperature=0, ignore_eos=True)
            parts = [c.text async for c in client.stream(PROMPTS[0], max_tokens=10, temperature=0, ignore_eos=True)]
            return result, "".join(parts)

    result, streamed = asyncio.run(run())
    assert len(result.token_ids) == 10
    assert streamed == expected(offline, PROMPTS[0], 10)


def post(info, path, body: bytes | dict, content_type="application/json", headers: dict | None = None):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(info["http"] + path, data=data, headers={"Content-Type": content_type,
                                                                           **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=scaled(30)) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.mark.parametrize("path, body, status, param", [
    ("/v1/completions", b"{not json", 400, None),
    ("/v1/completions", {"model": "other-model", "prompt": "x"}, 404, "model"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 100000}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {"prompt": "x", "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"prompt": 12}, 422, "prompt"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, 400, "messages[0].role"),
    ("/v1/chat/completions", {"messages": "hello"}, 422, "messages"),
])
def test_bad_requests_get_openai_errors(cluster, path, body, status, param):
    # The earlier tests' last streams may still be ending on the workers (the router stops reading at a stream's
    # last chunk and cancels the rest): a bad request must find them idle and leave them so.
    wait_until(lambda: workers_idle(cluster), 10, "the workers idle before the bad request")
    code, reply = post(cluster, path, body)
    assert code == status
    err = reply["error"]
    assert err["param"] == param and err["message"] and err["type"] == "invalid_request_error"
    if param:
        assert param.split("[")[0] in err["message"]
    assert workers_idle(cluster)


def list_workers(info) -> list[dict]:
    request = urllib.request.Request(info["http"] + "/workers", headers=ADMIN)
    with urllib.request.urlopen(request, timeout=scaled(10)) as r:
        return json.loads(r.read())


def router_outcomes(info, api: str) -> dict[str, int]:
    """`pdspark_router_requests_total` of `api` by outcome, from the router's /metrics."""
    prefix = f'pdspark_router_requests_total{{api="{api}",outcome="'
    with urllib.request.urlopen(info["http"] + "/metrics", timeout=scaled(10)) as r:
        return {line[len(prefix):].split('"')[0]: int(float(line.rsplit(" ", 1)[1]))
                for line in r.read().decode().splitlines() if line.startswith(prefix)}


def new_outcomes(info, api: str, before: dict[str, int]) -> dict[str, int]:
    return {k: n - before.get(k, 0) for k, n in router_outcomes(info, api).items() if n != before.get(k, 0)}


@contextlib.contextmanager
def decode_stopped(info):
    """The decode worker stopped (SIGSTOP) for the block: a stream it serves cannot end meanwhile, so a cancel or a
    disconnect made in the block provably comes before the stream's end (a random tiny model writes 2,000 tokens in
    well under a second, so no stream length makes that a matter of time). SIGCONT whatever happens; then the
    router lists the worker healthy again (a stop past its health checks' bound marks it down)."""
    pid = info["services"]["decode-1"]["pid"]
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)
    wait_until(lambda: all(w["healthy"] for w in list_workers(info)), 30, "the decode worker healthy again")


def ended_by_the_client(info, api: str, before: dict[str, int], what: str) -> None:
    """The router ended the request as cancelled (not served) because of `what`, and the workers hold nothing
    after it."""
    wait_until(lambda: new_outcomes(info, api, before), 30, f"the router ends the request after {what}")
    assert new_outcomes(info, api, before) == {"cancelled": 1}
    wait_until(lambda: workers_idle(info), 30, f"nothing held at the workers after {what}")


def workers_idle(info) -> bool:
    return all(is_idle(WorkerAt(w["role"], w["address"])) for w in list_workers(info))


def decode_outcomes(info) -> dict[str, int]:
    """`pdspark_worker_requests_total` by outcome, summed over the decode workers' /metrics."""
    prefix, counts = 'pdspark_worker_requests_total{outcome="', {}
    for w in list_workers(info):
        if w["role"] == "decode":
            with urllib.request.urlopen(w["metrics_url"], timeout=scaled(10)) as r:
                for line in r.read().decode().splitlines():
                    if line.startswith(prefix) and (n := int(float(line.rsplit(" ", 1)[1]))):
                        outcome = line[len(prefix):].split('"')[0]
                        counts[outcome] = counts.get(outcome, 0) + n
    return counts


def test_streams_read_to_their_last_chunk_count_ok_on_the_decode_worker(cluster):
    """The router stops reading a stream at its last chunk and cancels the call before its status comes: the decode
    worker still counts the request served (`ok`), not `cancelled` (which would read as clients going away)."""
    wait_until(lambda: workers_idle(cluster), 10, "the workers idle before the requests")
    before = decode_outcomes(cluster)
    client = openai_client(cluster)
    for prompt in PROMPTS * 2:
        chunks = client.completions.create(model=cluster["model"], prompt=prompt, max_tokens=3, temperature=0,
                                           stream=True, extra_body={"ignore_eos": True})
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    wait_until(lambda: workers_idle(cluster), 10, "the workers idle after the requests")
    after = decode_outcomes(cluster)
    assert {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)} == {"ok": 2 * len(PROMPTS)}


def test_client_disconnect_frees_both_workers(cluster):
    before = router_outcomes(cluster, "completions")
    host, port = cluster["http"].removeprefix("http://").split(":")
    body = json.dumps({"prompt": "def main():", "max_tokens": LONG_TOKENS, "temperature": 0.8, "stream": True,
                       "ignore_eos": True}).encode()
    sock = socket.create_connection((host, int(port)), timeout=scaled(30))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    received = b""
    while received.count(b"data:") < 3:
        received += sock.recv(4096)
    with decode_stopped(cluster):
        sock.close()  # the router learns it at its next write: the stream's next chunk, after the worker resumes
    ended_by_the_client(cluster, "completions", before, "the disconnect")


def test_models_health_workers_metrics(cluster):
    with urllib.request.urlopen(cluster["http"] + "/v1/models", timeout=scaled(10)) as r:
        assert json.loads(r.read())["data"][0]["id"] == cluster["model"]
    with urllib.request.urlopen(cluster["http"] + "/health", timeout=scaled(10)) as r:
        assert json.loads(r.read())["status"] == "ok"
    workers = list_workers(cluster)
    assert sorted(w["role"] for w in workers) == ["decode", "prefill"]
    assert all({"role", "address", "healthy", "load", "metrics_url"} <= set(w) for w in workers)
    # The router learns each worker's metrics URL from its load reports (health polls every 2 s).
    deadline = time.monotonic() + scaled(10)
    while not all(w["metrics_url"] for w in workers):
        assert time.monotonic() < deadline, f"/workers still lacks metrics URLs: {workers}"
        time.sleep(0.1)
        workers = list_workers(cluster)
    for w in workers:
        with urllib.request.urlopen(w["metrics_url"], timeout=scaled(10)) as r:
            assert "pdspark_pool_used_pages" in r.read().decode()
    with urllib.request.urlopen(cluster["http"] + "/metrics", timeout=scaled(10)) as r:
        text = r.read().decode()
    assert "pdspark_router_requests_total" in text and "pdspark_router_time_to_first_token_seconds" in text


def test_cache_aware_routing_keeps_a_shared_prefix_on_one_prefill_worker(faults, offline):
    """On the shared fault cluster (2 prefill workers), before its faults."""
    info = faults.info
    (system,) = random_prompts(1, [120], vocab=256, seed=50)
    outs = []
    for suffix in random_prompts(3, [8, 15, 22], vocab=256, seed=51):
        # With the admin key: `meta_info` names the workers (for admins only).
        code, reply = post(info, "/generate", {"input_ids": system + suffix,
                                               "sampling_params": {"max_new_tokens": 12, "temperature": 0,
                                                                   "ignore_eos": True}}, headers=ADMIN)
        assert code == 200
        outs.append(reply)
        ref = offline.generate(prompt_token_ids=[system + suffix],
                               sampling_params=SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
        assert reply["output_ids"] == ref[0].token_ids
    prefills = {o["meta_info"]["prefill_worker"] for o in outs}
    assert len(prefills) == 1, "cache_aware routing keeps a shared prefix on one prefill worker"
    assert all(o["meta_info"]["cached_tokens"] >= 96 for o in outs[1:])
    client = openai_client(info)
    texts = {client.completions.create(model=info["model"], prompt=p, max_tokens=12, temperature=0,
                                       extra_body={"ignore_eos": True}).choices[0].text for p in PROMPTS}
    assert texts == {expected(offline, p, 12) for p in PROMPTS}


def test_sdk_cancel_aborts_on_the_server(cluster):
    before = router_outcomes(cluster, "grpc")
    with Client(cluster["grpc"], timeout=scaled(60)) as client:
        stream = client.stream(PROMPTS[0], max_tokens=LONG_TOKENS, temperature=0.8, ignore_eos=True)
        chunks = iter(stream)
        next(chunks), next(chunks)
        with decode_stopped(cluster):
            stream.cancel()
            wait_until(lambda: new_outcomes(cluster, "grpc", before), 30, "the router ends the request")
    ended_by_the_client(cluster, "grpc", before, "cancel()")


def test_sdk_deadline_is_enforced(cluster):
    from pdspark.client import ClientError
    from pdspark.errors import ErrorCode

    with Client(cluster["grpc"]) as client:
        # A deadline of a quarter of what the request takes on this machine (a fixed one passed on fast CPUs).
        client.generate(PROMPTS[1], max_tokens=2, timeout=scaled(60))  # the prompt cached: the timed run is all decode
        t0 = time.monotonic()
        client.generate(PROMPTS[1], max_tokens=220, ignore_eos=True, timeout=scaled(60))
        whole = time.monotonic() - t0
        with pytest.raises(ClientError) as e:
            client.generate(PROMPTS[1], max_tokens=220, ignore_eos=True, timeout=whole / 4)
        assert e.value.code == "DEADLINE_EXCEEDED" and e.value.error_code is ErrorCode.DEADLINE
    wait_until(lambda: workers_idle(cluster), 2, "the workers idle once the deadline ended the request")


def test_workers_added_and_removed_at_run_time(cluster):
    code, added = post(cluster, "/workers", {"role": "decode", "address": "127.0.0.1:1"}, headers=ADMIN)
    assert code == 201 and added["address"] == "127.0.0.1:1"
    assert "127.0.0.1:1" in {w["address"] for w in list_workers(cluster)}
    # An unreachable decode worker is never picked once marked unhealthy; requests keep being served.
    client = openai_client(cluster)
    for _ in range(3):
        reply = client.completions.create(model=cluster["model"], prompt="x = 1", max_tokens=4)
        assert reply.usage.completion_tokens >= 1
    req = urllib.request.Request(cluster["http"] + "/workers?address=127.0.0.1:1", method="DELETE", headers=ADMIN)
    with urllib.request.urlopen(req, timeout=scaled(10)) as r:
        assert r.status == 200
    assert "127.0.0.1:1" not in {w["address"] for w in list_workers(cluster)}
    code, reply = post(cluster, "/workers", {"role": "cook", "address": "127.0.0.1:2"}, headers=ADMIN)
    assert code == 400 and "role" in reply["error"]["message"]


def test_seeded_sampling_through_the_router_equals_offline(cluster, offline_reference, draft_ckpt):
    """Same seed, same tokens: offline DSpark = router HTTP (completions) = SDK (sync stream), whatever else the
    cluster runs. Randomness comes from (seed, position, purpose), so the decode worker continues the prefill
    worker's stream without re-drawing token 1's randomness."""
    offline = offline_reference.engine(draft_ckpt, speculative="dspark")
    prompt, seed = PROMPTS[0], 1234
    want = offline.generate([prompt], SamplingParams(temperature=0.9, max_tokens=24, seed=seed, ignore_eos=True))[0]
    assert len(want.token_ids) == 24
    client = openai_client(cluster)
    got = client.completions.create(model=client.models.list().data[0].id, prompt=prompt, max_tokens=24,
                                    temperature=0.9, seed=seed, extra_body={"ignore_eos": True}).choices[0].text
    assert got == want.text
    with Client(cluster["grpc"], timeout=scaled(60)) as sdk:
        streamed = "".join(c.text for c in sdk.stream(prompt, max_tokens=24, temperature=0.9, seed=seed,
                                                       ignore_eos=True))
    assert streamed == want.text
    other = offline.generate([prompt], SamplingParams(temperature=0.9, max_tokens=24, seed=seed + 1,
                                                      ignore_eos=True))[0]
    assert other.text != want.text  # the seed matters (the comparison above is not vacuous)
