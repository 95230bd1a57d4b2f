"""Prefill failover on real processes: 2 prefill workers, 1 decode worker (DSpark) and the router, over real gRPC
and Mooncake. A prefill worker is SIGKILLed, or SIGSTOPped, while 16 concurrent requests are in flight on the
pair (greedy and seeded, streamed and not, through the official `openai` client and the gRPC SDK), at a moment
when its GetLoad shows transfers in flight (waiting for their plan, prefilling or writing):

- every request completes, and equals the offline engine's output (same model, same parameters and seed);
- a stopped (hung) worker's requests are retried on the other prefill worker once the router's health checks mark
  it down: its attempts end within the detection bound (2 s) of the stop, sooner than keepalive or the transfer
  timeout could end them;
- afterwards every surviving worker holds nothing (no request, no transfer, no page beyond its prefix cache): the
  decode worker's reservations for the failed attempts were released, once (a second free would be logged as a
  failed engine-loop clean-up), and it keeps serving;
- a killed worker's plans in flight leave their decode slots quarantined for a while, which the router lists (and
  counts as load) until they are freed; the plans sent to its address after its death never left, and hold nothing,
  so no request waits out a transfer timeout behind them.

The victim is a third prefill worker added to the router for one test and removed after it; the router routes
prefills round-robin, so that half of the requests start on the victim whatever the prefix cache holds.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import grpc
import openai
import pytest

from pdspark import SamplingParams
from pdspark.client import AsyncClient
from pdspark.launch.service_process import ServiceProcess
from pdspark.rpc.keepalive import KEEPALIVE_TIMEOUT_MS, LEASE_S
from pdspark.testing.services import ready, spawn_worker, start_router
from pdspark.testing.time_scale import scaled
from pdspark.testing.waiting import seconds_until
from pdspark.testing.worker_load import is_idle
from pdspark.v1 import worker_pb2, worker_pb2_grpc

MODEL = "dsv4-tiny"
ENGINE = ["--max-model-len", "256", "--max-num-seqs", "16", "--speculative", "dspark"]
N = 16
MAX_TOKENS = 8
TIMEOUT_S = 30.0  # each request's deadline (the router's default is 600 s)
# A decode worker keeps the pages of a transfer its prefill worker never answered quarantined until no write of it
# can land: the plan's deadline (the router's transfer timeout) + the transfer engine's timeout. Both short here.
TRANSFER_TIMEOUT_S = 5
WORKER_ENV = {"MC_TRANSFER_TIMEOUT": "3"}
ADMIN_KEY = "admin-key-for-failover-tests"  # adding and removing workers needs one
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
DETECT_S = 2.0  # the bound for noticing a dead or hung worker (docs/operations.md)
# Prompts of ~150 tokens, all different (no prefix-cache hits between them), so that prefills take a while.
PROMPTS = [f"# helpers_{i}.py\n" + "".join(
    f"def {verb}_{i}_{j}(items, key=None):\n    out = []\n    for item in items:\n"
    f"        if key is None or key(item):\n            out.append(item)\n    return out\n\n"
    for j, verb in enumerate(("keep", "pick"))) + f"def main_{i}():\n" for i in range(N)]


def params(i: int) -> SamplingParams:
    """Request `i`'s sampling: every other pair greedy, the rest seeded sampling."""
    if (i // 4) % 2:
        return SamplingParams(temperature=0.9, seed=1000 + i, max_tokens=MAX_TOKENS, ignore_eos=True)
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def offline(offline_reference) -> list[tuple[list[int], str]]:
    """Each request's token ids and text from the offline engine, with DSpark as the decode worker runs it."""
    refs = offline_reference.outputs(MODEL, PROMPTS, [params(i) for i in range(N)], speculative="dspark")
    return [(r.token_ids, r.text) for r in refs]


VICTIMS = 2  # one per test


@pytest.fixture(scope="module")
def started() -> Iterator[list[ServiceProcess]]:
    """Every worker of the module, loading at once: the prefill and decode workers that survive every test, then
    the victims, one per test (`victim` takes them from the end)."""
    services = ready(spawn_worker("prefill", MODEL, *ENGINE, env=WORKER_ENV),
                     spawn_worker("decode", MODEL, *ENGINE, "--no-prefix-cache", env=WORKER_ENV),
                     # Prefill chunks of 64 tokens: each prompt stays in its engine for a few steps, a window for
                     # the signal.
                     *(spawn_worker("prefill", MODEL, *ENGINE, "--max-num-batched-tokens", "64", env=WORKER_ENV)
                       for _ in range(VICTIMS)))
    try:
        yield list(services)
    finally:
        for service in services:
            if service.alive:
                os.kill(service.pid, signal.SIGCONT)  # a stopped process cannot exit
            service.stop()


@pytest.fixture(scope="module")
def cluster(started):
    """(prefill, decode, router): the workers that survive every test."""
    prefill, decode = started[:2]
    router = start_router(MODEL, [prefill], [decode], "--prefill-policy", "round_robin", "--transfer-timeout",
                          str(TRANSFER_TIMEOUT_S), env={"PDSPARK_ADMIN_API_KEY": ADMIN_KEY})
    try:
        # The victim is ready at once (it loaded with these two): requests must not race the router's first
        # health checks of the survivors.
        seconds_until(lambda: all(workers(router).values()), 10, "the router sees both workers healthy")
        yield prefill, decode, router
    finally:
        router.stop()

def listing(router: ServiceProcess) -> dict[str, dict]:
    """The router's `/workers`, by address."""
    req = urllib.request.Request(router.info["http"] + "/workers", headers=ADMIN)
    with urllib.request.urlopen(req, timeout=scaled(10)) as r:
        return {w["address"]: w for w in json.loads(r.read())}


def workers(router: ServiceProcess, field: str = "healthy") -> dict[str, Any]:
    """Address -> `field` of each worker in the router's /workers (`in_flight`: its unanswered legs)."""
    return {address: w[field] for address, w in listing(router).items()}


class QuarantineWatch(threading.Thread):
    """Reads the router's `/workers` every 0.1 s (the router polls each worker's load every second; a quarantine
    lasts the transfer timeout + the transfer engine's) for the most quarantined request slots it lists for one
    worker."""

    def __init__(self, router: ServiceProcess, address: str):
        super().__init__(daemon=True)
        self.router, self.address = router, address
        self.stop = threading.Event()
        self.most = 0

    def run(self) -> None:
        while not self.stop.wait(0.1):
            self.most = max(self.most, listing(self.router)[self.address]["quarantined_slots"])


def retries(router: ServiceProcess) -> float:
    with urllib.request.urlopen(router.info["http"] + "/metrics", timeout=scaled(10)) as r:
        line = next(x for x in r.read().decode().splitlines() if x.startswith("pdspark_router_retries_total "))
    return float(line.split()[1])


def set_worker(router: ServiceProcess, method: str, address: str) -> None:
    if method == "POST":
        req = urllib.request.Request(router.info["http"] + "/workers", method="POST", headers={
            "Content-Type": "application/json", **ADMIN},
            data=json.dumps({"role": "prefill", "address": address}).encode())
    else:
        req = urllib.request.Request(router.info["http"] + f"/workers?address={address}", method="DELETE",
                                     headers=ADMIN)
    with urllib.request.urlopen(req, timeout=scaled(10)) as r:
        assert r.status in (200, 201)


async def one(i: int, http: openai.AsyncOpenAI, sdk: AsyncClient) -> list[int] | str:
    """Request `i` through the HTTP API (text) or the SDK (token ids), streamed or not."""
    p, stream = params(i), i % 2 == 1
    sampling: dict[str, Any] = dict(max_tokens=p.max_tokens, temperature=p.temperature)
    if p.seed is not None:
        sampling["seed"] = p.seed
    if (i // 2) % 2 == 0:
        kw = dict(model=MODEL, prompt=PROMPTS[i], extra_body={"ignore_eos": True}, **sampling)
        if stream:
            return "".join([c.choices[0].text async for c in await http.completions.create(stream=True, **kw)
                            if c.choices])
        return (await http.completions.create(**kw)).choices[0].text
    if stream:
        return [t async for c in sdk.stream(PROMPTS[i], ignore_eos=True, **sampling) for t in c.token_ids]
    return (await sdk.generate(PROMPTS[i], ignore_eos=True, **sampling)).token_ids


class FaultAtBusy(threading.Thread):
    """Watches the victim's GetLoad every 2 ms (a thread of its own: no event-loop hop between seeing and acting)
    and sends `sig` the moment it has two transfers in flight, one of them prefilling; then watches the router's
    books until the victim holds no leg of a request (its attempts ended: answered, failed or ended by the router)."""

    def __init__(self, router: ServiceProcess, victim: ServiceProcess, sig: signal.Signals):
        super().__init__(daemon=True)
        self.router, self.victim, self.sig = router, victim, sig
        self.stop = threading.Event()
        self.seen: worker_pb2.LoadReport | None = None
        self.at = 0.0  # time.monotonic() of the signal
        self.legs_ended_at: float | None = None  # time.monotonic() at which the victim was seen holding no leg

    def run(self) -> None:
        with grpc.insecure_channel(self.victim.address) as channel:
            stub = worker_pb2_grpc.PrefillWorkerStub(channel)
            while not self.stop.wait(0.002):
                report = stub.GetLoad(worker_pb2.LoadRequest(), timeout=scaled(5))
                if report.transfers_in_flight >= 2 and report.running >= 1:
                    os.kill(self.victim.pid, self.sig)
                    self.seen, self.at = report, time.monotonic()
                    break
        while not self.stop.wait(0.02):  # the polling interval
            if workers(self.router, "in_flight")[self.victim.address] == 0:
                self.legs_ended_at = time.monotonic()
                return


def run_with_fault(router: ServiceProcess, victim: ServiceProcess, sig: signal.Signals) -> tuple[list, float, Any]:
    """Send the 16 requests, `sig` to the victim once it is busy with them (`FaultAtBusy`). Returns the answers
    (request order), the seconds from the signal to the last answer, and the fault watcher (the victim's load report
    then, and when its legs ended)."""
    async def scenario() -> list:
        async with openai.AsyncOpenAI(base_url=router.info["http"] + "/v1", api_key="none", max_retries=0,
                                      timeout=TIMEOUT_S, default_headers={"X-Request-Timeout": str(TIMEOUT_S)}
                                      ) as http, AsyncClient(router.info["grpc"], timeout=TIMEOUT_S) as sdk:
            return await asyncio.gather(*(one(i, http, sdk) for i in range(N)))

    fault = FaultAtBusy(router, victim, sig)
    fault.start()
    try:
        answers = asyncio.run(scenario())
        done = time.monotonic()
    finally:
        fault.stop.set()
        fault.join(scaled(10))
    assert fault.seen is not None, "the victim was never busy with two transfers while the requests ran"
    return answers, done - fault.at, fault


@pytest.fixture
def victim(cluster, started):
    """A third prefill worker (one no test used yet), admitted by the router for one test; killed (and SIGCONTed
    first) afterwards."""
    _, _, router = cluster
    assert len(started) > 2, "more tests than VICTIMS"
    worker = started.pop()
    try:
        set_worker(router, "POST", worker.address)
        seconds_until(lambda: workers(router)[worker.address], 5, "the new prefill worker healthy in /workers")
        yield worker
    finally:
        if worker.alive:
            os.kill(worker.pid, signal.SIGCONT)  # a stopped process cannot exit
        worker.stop()
        set_worker(router, "DELETE", worker.address)


def check_answers(answers: list, offline: list) -> None:
    for i, (got, (ids, text)) in enumerate(zip(answers, offline)):
        assert got == (text if isinstance(got, str) else ids), f"request {i} ({params(i)}): {got!r}"


def check_survivors_idle(prefill: ServiceProcess, decode: ServiceProcess) -> float:
    took = seconds_until(lambda: is_idle(prefill) and is_idle(decode), TRANSFER_TIMEOUT_S + 3 + 5,
                      "the surviving workers hold nothing (quarantined pages freed too)")
    for w in (prefill, decode):
        assert w.alive, f"{w.name} died:\n{w.tail()}"
        assert "Traceback" not in w.stderr_tail(400), f"{w.name} logged an error:\n{w.stderr_tail(40)}"
    return took


def test_killed_prefill_worker_its_requests_complete_on_the_other(cluster, offline, victim):
    prefill, decode, router = cluster
    retried = retries(router)
    watch = QuarantineWatch(router, decode.address)
    watch.start()
    try:
        answers, seconds, fault = run_with_fault(router, victim, signal.SIGKILL)
        seen = fault.seen
        check_answers(answers, offline)
        assert retries(router) > retried  # requests did start on the victim
        assert victim.proc.wait(scaled(5)) == -signal.SIGKILL
        down_s = seconds_until(lambda: not workers(router)[victim.address], DETECT_S, "the killed worker marked down")
        idle_s = check_survivors_idle(prefill, decode)
    finally:
        watch.stop.set()
        watch.join(scaled(10))
    # The plans the victim held when it died: quarantined (it may have been writing), and listed meanwhile.
    assert watch.most > 0, "the router never listed the decode worker's quarantined slots"
    seconds_until(lambda: listing(router)[decode.address]["quarantined_slots"] == 0, 3,
                  "the freed slots gone from the router's listing (its next load report)")
    # No request waited out a transfer timeout: plans sent to the dead worker's address never left, so they held
    # no slot quarantined, and each attempt on it failed at once.
    assert seconds < scaled(TRANSFER_TIMEOUT_S), f"the requests took {seconds:.1f}s after the kill"
    print(f"\nSIGKILL with {seen.transfers_in_flight} transfers in flight ({seen.running} prefilling) on the "
          f"victim: {N} requests done {seconds:.2f}s after the kill; marked down within {down_s:.2f}s more; "
          f"survivors idle {idle_s:.2f}s later; at most {watch.most} decode slots quarantined meanwhile")


def test_stopped_prefill_worker_its_requests_are_retried_once_it_is_marked_down(cluster, offline, victim):
    prefill, decode, router = cluster
    retried = retries(router)
    try:
        answers, seconds, fault = run_with_fault(router, victim, signal.SIGSTOP)
        seen = fault.seen
        check_answers(answers, offline)
        assert retries(router) > retried
        # The stopped worker's attempts were ended by the router's health checks (within DETECT_S of the stop), not
        # by keepalive, which breaks a stopped peer's calls no sooner than its ping's ack timeout after the stop
        # (KEEPALIVE_TIMEOUT_MS, 2 s; at most LEASE_S, 4 s), nor by the transfer timeout (TRANSFER_TIMEOUT_S after
        # they started).
        assert fault.legs_ended_at is not None, "the stopped worker's legs never ended"
        ended_s = fault.legs_ended_at - fault.at
        assert ended_s < scaled(min(DETECT_S, KEEPALIVE_TIMEOUT_MS / 1000)), (
            f"the stopped worker's attempts ended {ended_s:.2f}s after the stop: by keepalive (2-{LEASE_S:.0f} s) "
            "or a timeout, not by the router marking it down")
        # ... and retried: every request done within 3 s more.
        assert seconds < scaled(DETECT_S + 3), f"the requests on the stopped worker took {seconds:.1f}s"
        assert not workers(router)[victim.address]
        idle_s = check_survivors_idle(prefill, decode)  # while the victim is still stopped
    finally:
        os.kill(victim.pid, signal.SIGCONT)
    back_s = seconds_until(lambda: workers(router)[victim.address], 5, "the resumed worker re-admitted")
    # The resumed worker drops what it held: the router's and the decode worker's calls to it were cancelled.
    victim_idle_s = seconds_until(lambda: is_idle(victim), 10, "the resumed worker holds nothing")
    print(f"\nSIGSTOP with {seen.transfers_in_flight} transfers in flight ({seen.running} prefilling) on the "
          f"victim: its attempts ended {ended_s:.2f}s and {N} requests done {seconds:.2f}s after the stop; "
          f"survivors idle {idle_s:.2f}s later; after "
          f"SIGCONT re-admitted in {back_s:.2f}s, idle in {victim_idle_s:.2f}s")
    # Serving on all three again, with the same outputs.
    answers, seconds, _ = run_with_fault(router, victim, signal.SIGCONT)  # SIGCONT: harmless to a running one
    check_answers(answers, offline)
    check_survivors_idle(prefill, decode)
    print(f"without a fault, the {N} requests were done {seconds:.2f}s after the same moment")
