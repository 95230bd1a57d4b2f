"""Leases, as real processes over real gRPC and Mooncake: every call between two services holds what the callee
keeps for it, and ends when the caller vanishes, with or without closing its sockets (rpc/keepalive.py).

- A prefill worker stopped mid-transfer (SIGSTOP: its sockets stay open): the decode worker's call breaks within a
  lease and the request fails UNAVAILABLE, long before its deadline. The destination pages stay quarantined (the
  prefill worker could still write into them) until the plan's deadline plus the write grace, then are freed.
- A decode worker stopped mid-transfer: the prefill worker drops a transfer that only had its plan within a lease
  (the plan's call cancelled), and one whose writes are blocked (the transfer engine waits for the stopped peer)
  once the deadline and the write grace passed; after SIGCONT the decode worker frees its reservations a write
  grace after it learns of the failure, since the held-up writes land as it resumes.
- A router SIGKILLed or SIGSTOPped with a request running: the decode worker aborts it and frees its pages
  (at once, or within a lease); a restarted router serves.
Each test ends with every pool back to its free counts and the pair serving.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import signal
import time
import urllib.request
import uuid
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from conftest import random_prompts
from helpers import GREEDY
from pdspark import SamplingParams
from pdspark.errors import ErrorCode
from pdspark.rpc import convert
from pdspark.rpc.keepalive import LEASE_S
from pdspark.rpc.status import failure_from_rpc_error
from pdspark.testing.services import ready, spawn_worker, start_router
from pdspark.testing.time_scale import scaled
from pdspark.testing.waiting import seen_at, wait_until
from pdspark.testing.worker_load import is_idle, load_of, pages_held
from pdspark.v1 import worker_pb2, worker_pb2_grpc

ARGS = ["--page-size", "16", "--max-model-len", "4096", "--max-num-seqs", "4", "--transfer-backend", "mooncake"]
# The transfer engine's batch timeout (the least it takes): a write into a stopped worker gives up after it, and the
# decode side's write grace is that long.
MC_TIMEOUT_S = 5
ENV = {"MC_TRANSFER_TIMEOUT": str(MC_TIMEOUT_S)}
PARAMS = SamplingParams(max_tokens=4, **GREEDY)
TIMEOUT_S = 6.0  # longer than a lease, so that the lease, not the deadline, ends a call to a stopped peer
SLACK_S = scaled(1.5)  # scheduling on a loaded 2-core machine; polling


@pytest.fixture(scope="module")
def workers(draft_ckpt):
    """The pair, and a prefill worker nothing talks to before `test_a_decode_worker_stopped_mid_transfer_...`
    (which needs one whose transfer engine never met the decode worker's), all loading at once."""
    prefill, decode, new_prefill = ready(spawn_worker("prefill", str(draft_ckpt), *ARGS, env=ENV),
                                         spawn_worker("decode", str(draft_ckpt), *ARGS, "--no-prefix-cache", env=ENV),
                                         spawn_worker("prefill", str(draft_ckpt), *ARGS, env=ENV))
    yield prefill, decode, new_prefill
    new_prefill.stop()  # stopped by its test already, unless that failed
    assert decode.stop() == 0 and prefill.stop() == 0


@pytest.fixture(scope="module")
def pair(workers):
    return workers[:2]


class Stop:
    at = 0.0  # just after the SIGSTOP
    resumed_at = 0.0  # just before the SIGCONT


@contextlib.contextmanager
def stopped(worker):
    """SIGSTOP `worker` for the block; SIGCONT whatever happens."""
    stop = Stop()
    os.kill(worker.pid, signal.SIGSTOP)
    stop.at = time.monotonic()
    try:
        yield stop
    finally:
        stop.resumed_at = time.monotonic()
        os.kill(worker.pid, signal.SIGCONT)


def metric_lines(worker) -> list[str]:
    url = f"http://127.0.0.1:{worker.info['metrics_port']}/metrics"
    with urllib.request.urlopen(url, timeout=scaled(5)) as resp:
        return resp.read().decode().splitlines()


def quarantined(worker) -> dict[str, float]:
    """`pdspark_pool_quarantined_pages` per pool, from the worker's /metrics."""
    prefix = 'pdspark_pool_quarantined_pages{pool="'
    return {line[len(prefix):].split('"')[0]: float(line.rsplit(" ", 1)[1]) for line in metric_lines(worker)
            if line.startswith(prefix)}


def ended(worker) -> dict[str, int]:
    """`pdspark_worker_requests_total` by outcome: the requests (decode: Generate streams) the worker ended so far."""
    prefix = 'pdspark_worker_requests_total{outcome="'
    return {line[len(prefix):].split('"')[0]: int(float(line.rsplit(" ", 1)[1])) for line in metric_lines(worker)
            if line.startswith(prefix)}


def generate(decode, prefill_address: str, prompt: list[int], request_id: str, transfer_id: str) -> dict:
    """The decode leg of a request (as the router sends it): its tokens, or its error, and when it ended."""
    out: dict = {"tokens": []}
    request = worker_pb2.GenerateRequest(
        request_id=request_id, transfer_id=transfer_id, prompt_token_ids=prompt,
        sampling=convert.sampling_to_pb(PARAMS), prefill_address=prefill_address, timeout_ms=int(TIMEOUT_S * 1000))
    with grpc.insecure_channel(decode.address) as channel:
        try:
            for chunk in worker_pb2_grpc.DecodeWorkerStub(channel).Generate(request, timeout=TIMEOUT_S + scaled(30)):
                out["tokens"] += chunk.token_ids
        except grpc.RpcError as e:
            out["error"] = e
    out["ended_at"] = time.monotonic()
    return out


def prefill_leg(prefill, prompt: list[int], request_id: str, transfer_id: str) -> worker_pb2.PrefillResponse:
    request = worker_pb2.PrefillRequest(request_id=request_id, transfer_id=transfer_id, prompt_token_ids=prompt,
                                        sampling=convert.sampling_to_pb(PARAMS), timeout_ms=int(TIMEOUT_S * 1000))
    with grpc.insecure_channel(prefill.address) as channel:
        return worker_pb2_grpc.PrefillWorkerStub(channel).Prefill(request, timeout=TIMEOUT_S + scaled(30))


def serve_one(prefill, decode, seed: int) -> dict:
    """One whole request through the pair (both legs); the pair serves."""
    prompt, rid, tid = random_prompts(1, [24], seed=seed)[0], uuid.uuid4().hex, uuid.uuid4().hex
    with ThreadPoolExecutor(1) as pool:
        leg = pool.submit(prefill_leg, prefill, prompt, rid, tid)
        out = generate(decode, prefill.address, prompt, rid, tid)
        assert not leg.result(TIMEOUT_S + scaled(30)).result.HasField("error")
    return out


def test_a_prefill_worker_stopped_mid_transfer_loses_its_lease(pair):
    prefill, decode = pair
    wait_until(lambda: is_idle(prefill) and is_idle(decode), 5, "both workers back to their free counts")
    prompt, rid, tid = random_prompts(1, [40], seed=80)[0], uuid.uuid4().hex, uuid.uuid4().hex
    with ThreadPoolExecutor(1) as pool:
        sent_before = time.monotonic()  # a lower bound of when the plan went out
        # No prefill leg: the plan waits at the prefill worker, which could start writing any moment.
        stream = pool.submit(generate, decode, prefill.address, prompt, rid, tid)
        wait_until(lambda: load_of(prefill).transfers_in_flight == 1, 10, "the plan at the prefill worker")
        with stopped(prefill) as stop:
            out = stream.result(TIMEOUT_S + scaled(30))
            failed_after = out["ended_at"] - stop.at
            # Quarantined while the prefill worker is still stopped: it could still write.
            reserved, metric = pages_held(load_of(decode)), quarantined(decode)
            freed_at = seen_at(lambda: not any(pages_held(load_of(decode)).values()),
                               TIMEOUT_S + MC_TIMEOUT_S + SLACK_S, "the decode worker's quarantined pages freed")
            assert all(v == 0 for v in quarantined(decode).values())
    failure = failure_from_rpc_error(out["error"])
    assert failure.code is ErrorCode.UNAVAILABLE, failure  # the lease lapsed, long before the deadline
    assert failed_after < LEASE_S + SLACK_S, f"the stopped prefill worker was noticed after {failed_after:.1f}s"
    assert reserved["req_slots"] == 1 and reserved["full"] > 0
    assert metric == {pool: float(n) for pool, n in reserved.items()}
    # The plan's deadline is the request's less a margin of at most 1 s; no write starts after it.
    assert freed_at >= sent_before + TIMEOUT_S - 1.0 + MC_TIMEOUT_S, "freed while the prefill worker could write"
    print(f"\nprefill SIGSTOP mid-transfer: the decode call failed after {failed_after:.2f}s (lease {LEASE_S:.0f}s); "
          f"its pages freed {freed_at - stop.at:.2f}s after the stop (deadline {TIMEOUT_S:.0f}s + grace "
          f"{MC_TIMEOUT_S}s from the send)")
    # SIGCONT: the prefill worker finds its plan's call cancelled and lets go of the transfer.
    wait_until(lambda: is_idle(prefill), 5, "the prefill worker idle after SIGCONT")
    assert len(serve_one(prefill, decode, seed=81)["tokens"]) == PARAMS.max_tokens
    wait_until(lambda: is_idle(prefill) and is_idle(decode), 5, "both workers back to their free counts")


def test_a_decode_worker_stopped_mid_transfer_loses_its_lease(workers):
    """Two plans wait at a prefill worker when their decode worker stops: one gets its prefill leg (its pages are
    held and written to the stopped process), the other never does (the prefill worker holds only the plan). The
    prefill worker is new, so its transfer engine has never met the decode worker's: the first write waits in the
    engine's handshake, which has no timeout, until the decode worker resumes."""
    _, decode, prefill = workers
    try:
        prompts = random_prompts(2, [40], seed=82)
        ids = [(uuid.uuid4().hex, uuid.uuid4().hex) for _ in prompts]
        seen: dict = {"held": False, "one_left_at": None}

        def prefill_holds_nothing() -> bool:
            report = load_of(prefill)
            pages = pages_held(report)
            seen["held"] |= pages["full"] > 0
            if report.transfers_in_flight <= 1 and seen["one_left_at"] is None:
                seen["one_left_at"] = time.monotonic()
            return not any(pages.values()) and report.transfers_in_flight == 0

        with ThreadPoolExecutor(3) as pool:
            sent_before = time.monotonic()
            streams = [pool.submit(generate, decode, prefill.address, p, *i) for p, i in zip(prompts, ids)]
            wait_until(lambda: load_of(prefill).transfers_in_flight == 2, 10, "both plans at the prefill worker")
            with stopped(decode) as stop:
                # The first leg comes now: its prompt is computed (pages held) and written to a stopped process.
                leg = pool.submit(prefill_leg, prefill, prompts[0], *ids[0])
                freed_at = seen_at(prefill_holds_nothing, TIMEOUT_S + MC_TIMEOUT_S + SLACK_S,
                                    "the prefill worker's held pages freed")
                answer = leg.result(scaled(10))
                # The second transfer ended when the lease cancelled its plan's call: its leg now fails at once.
                late = prefill_leg(prefill, prompts[1], *ids[1])
            outs = [stream.result(TIMEOUT_S + scaled(30)) for stream in streams]
            # The decode worker learns only now that its calls failed, as the write held up by it lands: its pages
            # stay quarantined for the grace from now, not from the plans' deadline, which passed while it stood.
            decode_freed_at = seen_at(lambda: not any(pages_held(load_of(decode)).values()), MC_TIMEOUT_S + SLACK_S + 2,
                                       "the decode worker's pages freed")
        assert seen["held"], "the prefill worker never held the prompt's pages: the scenario did not happen"
        lease_s = seen["one_left_at"] - stop.at
        assert lease_s < LEASE_S + SLACK_S, f"the plan's call outlived its stopped caller by {lease_s:.1f}s"
        dropped = convert.failure_from_pb(late.result.error)
        assert dropped.code is ErrorCode.ABORTED and "went away" in dropped.message, dropped
        # The blocked write was given up on once the deadline and the grace passed, and its pages released.
        assert "given up on" in answer.result.error.message, answer.result.error
        assert freed_at >= sent_before + TIMEOUT_S - 1.0 + MC_TIMEOUT_S
        assert all(failure_from_rpc_error(o["error"]).code in (ErrorCode.UNAVAILABLE, ErrorCode.DEADLINE)
                   for o in outs)
        assert decode_freed_at >= stop.resumed_at + MC_TIMEOUT_S, "freed while the held-up write could land"
        print(f"\ndecode SIGSTOP mid-transfer: the prefill worker dropped the plan-only transfer {lease_s:.2f}s after "
              f"the stop (lease {LEASE_S:.0f}s), and the pages of the one blocked in the transfer engine "
              f"{freed_at - stop.at:.2f}s after it (deadline {TIMEOUT_S:.0f}s + grace {MC_TIMEOUT_S}s from the send); "
              f"the decode worker freed its pages {decode_freed_at - stop.resumed_at:.2f}s after SIGCONT")
        assert len(serve_one(prefill, decode, seed=83)["tokens"]) == PARAMS.max_tokens
        wait_until(lambda: is_idle(prefill) and is_idle(decode), 5, "both workers back to their free counts")
    finally:
        assert prefill.stop() == 0


class StreamingClient:
    """One streamed completion through the router's HTTP API, read on a thread: tokens as they come."""

    def __init__(self, router, max_tokens: int):
        body = json.dumps({"prompt": "def fibonacci(n):", "max_tokens": max_tokens, "temperature": 0,
                           "ignore_eos": True, "stream": True}).encode()
        self.request = urllib.request.Request(router.info["http"] + "/v1/completions", body,
                                              {"Content-Type": "application/json"})
        self.chunks: list[float] = []  # when each chunk came
        self.pool = ThreadPoolExecutor(1)
        self.done = self.pool.submit(self._read)

    def _read(self) -> None:
        # The router vanishes mid-stream: the read ends with a reset, a broken chunk or a timeout.
        with contextlib.suppress(OSError, http.client.HTTPException), \
                urllib.request.urlopen(self.request, timeout=scaled(60)) as resp:
            for line in resp:
                if line.startswith(b"data: {"):
                    self.chunks.append(time.monotonic())

    def rate(self) -> float:
        """Chunks per second so far."""
        return (len(self.chunks) - 1) / (self.chunks[-1] - self.chunks[0])


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["SIGKILL", "SIGSTOP"])
def test_a_vanished_router_s_requests_are_aborted_on_the_workers(pair, draft_ckpt, sig):
    prefill, decode = pair
    wait_until(lambda: is_idle(prefill) and is_idle(decode), 5, "both workers back to their free counts")
    # Requests far longer than what they stream before the router vanishes (the workers take 4,096 positions), as
    # many as the decode worker runs, so that their tokens outlast the lease: one alone ended ok within it (4,000
    # tokens in 1.8 s, the stream absorbed by the buffers between the decode worker and the stopped router).
    max_tokens, streams = 4000, 4
    ended_before = ended(decode)
    router = start_router(str(draft_ckpt), [prefill], [decode])
    clients: list[StreamingClient] = []
    try:
        clients = [StreamingClient(router, max_tokens) for _ in range(streams)]
        wait_until(lambda: all(len(c.chunks) >= 20 for c in clients) and load_of(decode).running == streams, 30,
                 "the requests streaming")
        os.kill(router.pid, sig)
        stopped_at = time.monotonic()
        # The engine runs on (the stream's window fills only later): only the end of the Generate call stops it.
        freed_at = seen_at(lambda: is_idle(decode), LEASE_S + SLACK_S, "the requests aborted on the decode worker")
        streamed, rate = len(clients[0].chunks), clients[0].rate()
    finally:
        # The router is done with: SIGTERM would have the resumed router drain the streams it still holds, and it
        # did not exit within `stop()`'s 15 s (then SIGKILL) -- the workers' side is what this test checks.
        router.proc.kill()
        router.proc.wait(scaled(10))
        for c in clients:
            c.done.result(scaled(30))
            c.pool.shutdown()
    # Aborted, not simply finished: the decode worker ended the Generate streams as cancelled (their caller went
    # away), not ok (counted when a stream's handler returns, so it may follow the pages' release a little).
    def since_before() -> dict[str, int] | None:  # once every stream has ended
        counts = {k: n - ended_before.get(k, 0) for k, n in ended(decode).items() if n > ended_before.get(k, 0)}
        return counts if sum(counts.values()) >= streams else None

    # Within a lease of the router's death: its calls' connection breaks at once (a dead process's sockets close), at
    # the latest when the pings go unanswered (LEASE_S), and every call on it is cancelled then. What this rules out
    # is a Generate handler that outlives its caller; the decode worker's log says which calls its stream cancelled.
    endings = wait_until(since_before, LEASE_S + SLACK_S, "the Generate streams ended", describe=lambda: (
        f"(ended before: {ended_before}, now: {ended(decode)}; the decode worker's load: {load_of(decode)}; its "
        f"last lines:\n{decode.tail(20)})"))
    print(f"\nrouter {signal.Signals(sig).name}: its running requests aborted and their pages freed "
          f"{freed_at - stopped_at:.2f}s later (one streamed {streamed} chunks at {rate:.0f}/s; ended {endings})")
    assert endings == {"cancelled": streams}, "the requests were not aborted (the model is too fast?)"
    wait_until(lambda: is_idle(prefill), 5, "the prefill worker idle")
    if sig == signal.SIGKILL:  # a restarted router finds the workers from its flags and serves
        router = start_router(str(draft_ckpt), [prefill], [decode])
        try:
            body = json.dumps({"prompt": "x = 1", "max_tokens": 3, "temperature": 0, "ignore_eos": True}).encode()
            request = urllib.request.Request(router.info["http"] + "/v1/completions", body,
                                             {"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=scaled(30)) as resp:
                assert json.load(resp)["usage"]["completion_tokens"] == 3
        finally:
            assert router.stop() == 0
