"""Serving under load, on a real `pdspark up` cluster with its defaults (1 prefill + 1 decode worker, DSpark on
dsv4-tiny, the router in front): 256 concurrent requests — OpenAI completions and native `/generate`, streamed and
not — all complete with the offline engine's greedy output while `/health` and `/workers` keep answering, and the
workers hold nothing afterwards. A second router with tiny queue bounds in front of the same workers shows the
flood path: 429 + `Retry-After` at once, then normal service.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import urllib.request

import aiohttp
import grpc
import pytest

from pdspark import SamplingParams
from pdspark.testing.services import start_router
from pdspark.testing.time_scale import scaled
from pdspark.v1 import worker_pb2, worker_pb2_grpc

CONCURRENCY = 256
MAX_TOKENS = 12
# Distinct prompts (code-like, as dsv4-tiny was trained on), so the requests are not one prefix-cache hit.
PROMPTS = [f"def {name}_{i}(x):\n    " for i in range(16) for name in ("parse", "load", "merge", "split")]


@pytest.fixture(scope="module")
def cluster(dsv4_tiny_cluster):
    """The shared cluster of `pdspark up`'s defaults."""
    return dsv4_tiny_cluster


@pytest.fixture(scope="module")
def offline(offline_reference) -> dict[str, tuple[list[int], str]]:
    """Greedy token ids and text of every prompt from the offline engine (the bottom rung of the equality ladder)."""
    refs = offline_reference.outputs("dsv4-tiny", PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS,
                                                                          ignore_eos=True))
    return {p: (r.token_ids, r.text) for p, r in zip(PROMPTS, refs)}


def _get(url: str, timeout: float = 10) -> tuple[int, bytes]:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.status, r.read()


def _loads(http: str) -> list:
    _, body = _get(http + "/workers")
    loads = []
    for w in json.loads(body):
        stub = worker_pb2_grpc.PrefillWorkerStub if w["role"] == "prefill" else worker_pb2_grpc.DecodeWorkerStub
        with grpc.insecure_channel(w["address"]) as channel:
            loads.append(stub(channel).GetLoad(worker_pb2.LoadRequest(), timeout=scaled(10)))
    return loads


def _idle(http: str) -> bool:
    """No request running or waiting, and every used page is one the prefix cache holds (none held by a request)."""
    return all(r.running == 0 and r.waiting == 0 and all(r.pages_used[k] == r.pages_cached[k] for k in r.pages_used)
               for r in _loads(http))


class Prober(threading.Thread):
    """Times `/health` and `/workers` every 100 ms while the load runs (the control plane must keep answering)."""

    def __init__(self, http: str):
        super().__init__(daemon=True)
        self.http, self.stop = http, threading.Event()
        self.worst: dict[str, float] = {"/health": 0.0, "/workers": 0.0}
        self.failures: list[str] = []

    def run(self) -> None:
        while not self.stop.wait(0.1):
            for path in self.worst:
                t0 = time.monotonic()
                try:
                    status, _ = _get(self.http + path, timeout=scaled(5))
                    if status != 200:
                        self.failures.append(f"{path}: {status}")
                except OSError as e:
                    self.failures.append(f"{path}: {e}")
                self.worst[path] = max(self.worst[path], time.monotonic() - t0)


async def _one(session: aiohttp.ClientSession, http: str, i: int) -> tuple[str, list[int] | str]:
    """Request `i`: a quarter each of completions / `/generate`, streamed / not. Returns (prompt, ids or text)."""
    prompt = PROMPTS[i % len(PROMPTS)]
    stream = bool(i % 2)
    if i % 4 < 2:
        body = {"model": "dsv4-tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
                "ignore_eos": True, "stream": stream}
        async with session.post(http + "/v1/completions", json=body) as r:
            assert r.status == 200, (r.status, await r.text())
            if not stream:
                return prompt, (await r.json())["choices"][0]["text"]
            text = []
            async for line in r.content:
                if line.startswith(b"data: {"):
                    text.append(json.loads(line[6:])["choices"][0]["text"])
            return prompt, "".join(text)
    body = {"text": prompt, "stream": stream,
            "sampling_params": {"max_new_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}}
    async with session.post(http + "/generate", json=body) as r:
        assert r.status == 200, (r.status, await r.text())
        if not stream:
            return prompt, (await r.json())["output_ids"]
        ids: list[int] = []
        async for line in r.content:
            if line.startswith(b"data: {"):
                ids += json.loads(line[6:])["output_ids"]
        return prompt, ids


async def _all(http: str, n: int) -> list[tuple[str, list[int] | str]]:
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        return await asyncio.gather(*(_one(session, http, i) for i in range(n)))


def test_256_concurrent_requests_equal_offline_and_leave_nothing_held(cluster, offline):
    http = cluster.info["http"]
    prober = Prober(http)
    prober.start()
    t0 = time.monotonic()
    try:
        results = asyncio.run(_all(http, CONCURRENCY))
    finally:
        prober.stop.set()
        prober.join(scaled(10))
    elapsed = time.monotonic() - t0
    for prompt, got in results:
        ids, text = offline[prompt]
        assert got == (text if isinstance(got, str) else ids), (prompt, got, ids, text)
    assert not prober.failures, prober.failures[:5]
    assert max(prober.worst.values()) < 1.0, prober.worst
    deadline = time.monotonic() + scaled(10)
    while not _idle(http):
        assert time.monotonic() < deadline, "workers still hold pages or requests 10 s after the load"
        time.sleep(0.1)
    print(f"{CONCURRENCY} requests in {elapsed:.1f}s; worst control-plane latency {prober.worst}")


def test_a_flood_above_the_queue_bound_gets_429_at_once_then_service_resumes(cluster, offline):
    workers = json.loads(_get(cluster.info["http"] + "/workers")[1])

    class Addr:
        def __init__(self, address):
            self.address = address

    prefill = [Addr(w["address"]) for w in workers if w["role"] == "prefill"]
    decode = [Addr(w["address"]) for w in workers if w["role"] == "decode"]
    router = start_router("dsv4-tiny", prefill, decode, "--max-in-flight", "2", "--max-queued", "2")
    try:
        http = router.info["http"]

        async def flood() -> list[tuple[int, float, str | None]]:
            body = {"model": "dsv4-tiny", "prompt": PROMPTS[0], "max_tokens": MAX_TOKENS, "temperature": 0,
                    "ignore_eos": True}

            async def one(session):
                t0 = time.monotonic()
                async with session.post(http + "/v1/completions", json=body) as r:
                    await r.read()
                    return r.status, time.monotonic() - t0, r.headers.get("Retry-After")

            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
                return await asyncio.gather(*(one(session) for _ in range(32)))

        answers = asyncio.run(flood())
        refused = [a for a in answers if a[0] == 429]
        served = [a for a in answers if a[0] == 200]
        assert len(served) + len(refused) == len(answers), answers
        assert len(served) >= 4 and len(refused) >= 16, answers  # 2 in flight + 2 queued at any time
        assert all(a[2] is not None and int(a[2]) >= 1 for a in refused)
        assert max(a[1] for a in refused) < 1.0, "a refused request waited instead of getting 429 at once"
        body = json.dumps({"model": "dsv4-tiny", "prompt": PROMPTS[1], "max_tokens": MAX_TOKENS, "temperature": 0,
                           "ignore_eos": True}).encode()
        req = urllib.request.Request(http + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=scaled(60)) as r:
            assert r.status == 200  # right after the flood, normal service
    finally:
        assert router.stop() == 0
