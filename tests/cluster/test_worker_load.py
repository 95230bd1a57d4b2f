"""Workers under load and failure, as real processes over real gRPC and Mooncake. The test plays the router (it
sends both legs of every request itself), so what is measured is the workers alone.

- A decode worker holds far more concurrent `Generate` streams than the 32 threads it once had, and completes
  them, while gRPC Health and `GetLoad` each answer within half the router's health-check timeout (a busy worker
  is never taken for a dead one).
- Beyond its queue bound it refuses at once with RESOURCE_EXHAUSTED (+ the OVERLOADED trailer), and serves
  normally once the queue drains.
- A prefill worker that stops answering without closing its socket (SIGSTOP) fails every affected request with
  a typed error within the request's deadline; the decode worker's pools return to their initial counts once no
  write of the stopped worker can land (the plans' deadline + the write grace); after SIGCONT the pair serves again.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator

import grpc
import pytest

from conftest import random_prompts
from helpers import GREEDY
from pdspark import SamplingParams
from pdspark.config import HealthConfig
from pdspark.errors import ErrorCode
from pdspark.launch.service_process import ServiceProcess
from pdspark.rpc import convert
from pdspark.rpc.status import failure_from_rpc_error
from pdspark.testing.services import ready, spawn_worker
from pdspark.testing.time_scale import scaled
from pdspark.testing.waiting import wait_until
from pdspark.testing.worker_load import is_idle, load_of
from pdspark.v1 import worker_pb2, worker_pb2_grpc

ARGS = ["--page-size", "16", "--max-model-len", "128", "--max-num-seqs", "16", "--transfer-backend", "mooncake"]
DECODE = [*ARGS, "--no-prefix-cache", "--max-waiting-streams", "256"]
PARAMS = SamplingParams(max_tokens=4, **GREEDY)
# What a health or load call may take under any load: half the router's health-check timeout (0.5 s), so that a
# busy worker's checks never count as missed (two misses mark it down) and a load report is never stale for long.
CONTROL_BUDGET_S = scaled(HealthConfig().health_timeout_s / 2)
# The transfer engine's batch timeout (its least): the decode side's write grace, after which it frees the pages
# of a transfer the prefill worker did not answer.
MC_TIMEOUT_S = 5
ENV = {"MC_TRANSFER_TIMEOUT": str(MC_TIMEOUT_S)}


@pytest.fixture(scope="module")
def workers(draft_ckpt) -> Iterator[dict[str, ServiceProcess]]:
    """Every worker of the module, loading at once: the pair, and the small decode worker and the victim prefill
    worker one test each uses (and stops)."""
    names = ("prefill", "decode", "small", "victim")
    services = ready(
        spawn_worker("prefill", str(draft_ckpt), *ARGS, env=ENV),
        spawn_worker("decode", str(draft_ckpt), *DECODE, env=ENV),
        # 2 request slots + 3 waiting places
        spawn_worker("decode", str(draft_ckpt), *ARGS, "--no-prefix-cache", "--max-num-seqs", "2",
                     "--max-waiting-streams", "3"),
        spawn_worker("prefill", str(draft_ckpt), *ARGS, env=ENV))
    yield dict(zip(names, services))
    for service in services[2:]:
        service.stop()  # stopped by their tests already, unless those failed
    assert services[1].stop() == 0 and services[0].stop() == 0


@pytest.fixture(scope="module")
def pair(workers):
    return workers["prefill"], workers["decode"]


class Dispatcher:
    """Both legs of requests over grpc.aio channels (what the router does), on one asyncio loop."""

    def __init__(self, prefill_address: str, decode_address: str):
        self.p_channel = grpc.aio.insecure_channel(prefill_address)
        self.d_channel = grpc.aio.insecure_channel(decode_address)
        self.prefill = worker_pb2_grpc.PrefillWorkerStub(self.p_channel)
        self.decode = worker_pb2_grpc.DecodeWorkerStub(self.d_channel)
        self.prefill_address = prefill_address

    async def generate(self, prompt, timeout_ms: int | None = None, send_prefill: bool = True) -> dict:
        """One request: its tokens, or the decode stream's failure; and how long it took to end. `timeout_ms`: the
        request's deadline (by default a bound of 60 s, scaled)."""
        if timeout_ms is None:
            timeout_ms = round(scaled(60) * 1000)
        tid, rid = uuid.uuid4().hex, uuid.uuid4().hex
        sampling = convert.sampling_to_pb(PARAMS)
        t0 = time.monotonic()
        prefill = None
        if send_prefill:
            prefill = asyncio.ensure_future(self.prefill.Prefill(worker_pb2.PrefillRequest(
                request_id=rid, transfer_id=tid, prompt_token_ids=prompt, sampling=sampling, timeout_ms=timeout_ms),
                timeout=timeout_ms / 1000 + scaled(5)))
        out: dict = {"tokens": []}
        try:
            async for chunk in self.decode.Generate(worker_pb2.GenerateRequest(
                    request_id=rid, transfer_id=tid, prompt_token_ids=prompt, sampling=sampling,
                    prefill_address=self.prefill_address, timeout_ms=timeout_ms),
                    timeout=timeout_ms / 1000 + scaled(30)):
                out["tokens"] += chunk.token_ids
        except grpc.aio.AioRpcError as e:
            out["error"] = e
            if prefill is not None:
                prefill.cancel()  # as the router does: a failed pair leaves no leg waiting
        out["seconds"] = time.monotonic() - t0
        if prefill is not None:
            with contextlib.suppress(grpc.aio.AioRpcError, asyncio.CancelledError):
                await prefill
        return out

    async def close(self) -> None:
        await self.p_channel.close()
        await self.d_channel.close()


# The probe runs in a process of its own, so that what it measures is the worker, not this process's busy
# asyncio loop: it times Health `Check` then `GetLoad`, every 20 ms, until its stdin closes, then prints them.
_PROBE = r"""
import json, select, sys, time
import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from pdspark.testing.time_scale import scaled
from pdspark.v1 import worker_pb2, worker_pb2_grpc

channel = grpc.insecure_channel(sys.argv[1])
health, decode = health_pb2_grpc.HealthStub(channel), worker_pb2_grpc.DecodeWorkerStub(channel)
out = {"health": [], "load": [], "serving": True, "max_queued": 0, "max_running": 0}
print("ready", flush=True)
while not select.select([sys.stdin], [], [], 0.02)[0]:
    t0 = time.perf_counter()
    status = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=scaled(5)).status
    out["health"].append(time.perf_counter() - t0)
    out["serving"] &= status == health_pb2.HealthCheckResponse.SERVING
    t0 = time.perf_counter()
    report = decode.GetLoad(worker_pb2.LoadRequest(), timeout=scaled(5))
    out["load"].append(time.perf_counter() - t0)
    out["max_queued"] = max(out["max_queued"], report.queued)
    out["max_running"] = max(out["max_running"], report.running)
print(json.dumps(out), flush=True)
"""


class ControlProbe:
    """Times gRPC Health and GetLoad calls on a worker from a separate process while the `with` block runs."""

    def __init__(self, address: str):
        self.proc = subprocess.Popen([sys.executable, "-c", _PROBE, address], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        self.result: dict = {}

    def __enter__(self) -> ControlProbe:
        assert self.proc.stdout.readline().strip() == "ready"
        return self

    def __exit__(self, *exc) -> None:
        out, _ = self.proc.communicate(timeout=scaled(30))  # closes its stdin: the probe stops and reports
        self.result = json.loads(out.strip().splitlines()[-1])


def test_a_flood_of_streams_completes_while_control_calls_answer_at_once(pair):
    prefill, decode = pair
    n = 200  # streams at once: 16 run, the rest wait for pages
    prompts = random_prompts(n, [12, 20, 28], seed=60)

    async def flood() -> list[dict]:
        dispatcher = Dispatcher(prefill.address, decode.address)
        try:
            return await asyncio.gather(*(dispatcher.generate(p) for p in prompts))
        finally:
            await dispatcher.close()

    with ControlProbe(decode.address) as probe:
        t0 = time.monotonic()
        outs = asyncio.run(flood())
        flood_s = time.monotonic() - t0
    errors = [o["error"] for o in outs if "error" in o]
    assert not errors, f"{len(errors)} of {n} streams failed, e.g. {errors[0].code()}: {errors[0].details()}"
    assert all(len(o["tokens"]) == PARAMS.max_tokens for o in outs)
    seen = probe.result
    assert seen["serving"], "the worker reported itself unhealthy while busy"
    assert seen["max_queued"] > 32, "the flood never had more streams waiting than a thread pool would have held"
    assert len(seen["health"]) >= 5, f"only {len(seen['health'])} probes during a {flood_s:.1f}s flood"
    worst_health, worst_load = max(seen["health"]), max(seen["load"])
    print(f"\n{n} streams in {flood_s:.1f}s; {len(seen['health'])} probes; max queued {seen['max_queued']}, max "
          f"running {seen['max_running']}; Health max {worst_health * 1e3:.1f} ms, GetLoad max "
          f"{worst_load * 1e3:.1f} ms")
    assert worst_health < CONTROL_BUDGET_S, f"Health took {worst_health * 1e3:.0f} ms under load"
    assert worst_load < CONTROL_BUDGET_S, f"GetLoad took {worst_load * 1e3:.0f} ms under load"
    wait_until(lambda: is_idle(decode) and is_idle(prefill), 5, "both workers back to their initial free counts")


def test_a_full_queue_refuses_at_once_and_serves_again_once_it_drains(workers):
    prefill, small = workers["prefill"], workers["small"]
    # 2 request slots + 3 waiting places; the held streams wait for prefill legs that are only sent at the end.
    try:
        async def scenario() -> tuple[list[dict], dict]:
            dispatcher = Dispatcher(prefill.address, small.address)
            try:
                prompts = random_prompts(25, [12], seed=61)
                # In two waves: a request counts as waiting until its reservation is granted.
                held = [asyncio.ensure_future(dispatcher.generate(p, send_prefill=False)) for p in prompts[:2]]
                await asyncio.to_thread(wait_until, lambda: _holds(small, 2, 0), 10, "2 requests holding the slots")
                held += [asyncio.ensure_future(dispatcher.generate(p, send_prefill=False)) for p in prompts[2:5]]
                await asyncio.to_thread(wait_until, lambda: _holds(small, 2, 3), 10, "2 running + 3 waiting")
                refused = await asyncio.gather(*(dispatcher.generate(p) for p in prompts[5:]))
                for task in held:
                    task.cancel()  # the callers go away: the decode worker lets go of them
                await asyncio.gather(*held, return_exceptions=True)
                await asyncio.to_thread(wait_until, lambda: _holds(small, 0, 0) and is_idle(small), 5,
                                        "the small decode worker drained", lambda: load_of(small))
                return refused, await dispatcher.generate(prompts[0])
            finally:
                await dispatcher.close()

        refused, after = asyncio.run(scenario())
        for out in refused:
            assert out["error"].code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert failure_from_rpc_error(out["error"]).code is ErrorCode.OVERLOADED  # the typed trailer
        worst = max(o["seconds"] for o in refused)
        print(f"\n{len(refused)} refusals, slowest {worst * 1e3:.0f} ms")
        assert worst < scaled(0.5), f"a refusal took {worst:.2f}s: refusals must be immediate, not timeouts"
        assert "error" not in after and len(after["tokens"]) == PARAMS.max_tokens
    finally:
        assert small.stop() == 0


def _holds(worker, in_transfer: int, queued: int) -> bool:
    report = load_of(worker)
    return report.transfers_in_flight == in_transfer and report.queued == queued


def test_a_stopped_prefill_worker_fails_requests_within_their_deadline(workers):
    decode, victim = workers["decode"], workers["victim"]
    k, timeout_ms = 4, 3000
    try:
        assert is_idle(decode)
        before = load_of(decode).pages_used

        async def scenario() -> list[dict]:
            dispatcher = Dispatcher(victim.address, decode.address)
            try:
                prompts = random_prompts(k, [20], seed=62)
                # Mid-request: the plans reached the prefill worker, which waits for the prefill legs.
                streams = [asyncio.ensure_future(dispatcher.generate(p, timeout_ms, send_prefill=False))
                           for p in prompts]
                await asyncio.to_thread(wait_until, lambda: load_of(victim).transfers_in_flight == k, 10,
                                        "every plan at the prefill worker")
                os.kill(victim.proc.pid, signal.SIGSTOP)
                return await asyncio.gather(*streams)
            finally:
                await dispatcher.close()

        try:
            outs = asyncio.run(scenario())
            # The decode worker's pools are back while the prefill worker is still stopped: its pages quarantined
            # until no write can land (the plans' deadline, which passed, + the write grace), then freed.
            wait_until(lambda: load_of(decode).pages_used == before, MC_TIMEOUT_S + 2,
                     "the decode worker's pools back to initial")
        finally:
            os.kill(victim.proc.pid, signal.SIGCONT)
        for out in outs:
            failure = failure_from_rpc_error(out["error"])
            assert failure.code is ErrorCode.DEADLINE, failure  # typed, from the decode worker's trailer
            assert out["error"].code() == grpc.StatusCode.DEADLINE_EXCEEDED
        slowest = max(o["seconds"] for o in outs)
        print(f"\n{k} requests to a stopped prefill worker failed after {min(o['seconds'] for o in outs):.2f}-"
              f"{slowest:.2f}s (deadline {timeout_ms / 1000:.1f}s)")
        assert slowest < timeout_ms / 1000 + scaled(0.5), f"a request ended {slowest:.2f}s after it was sent"

        async def again() -> dict:
            dispatcher = Dispatcher(victim.address, decode.address)
            try:
                return await dispatcher.generate(random_prompts(1, [20], seed=63)[0])
            finally:
                await dispatcher.close()

        out = asyncio.run(again())
        assert "error" not in out and len(out["tokens"]) == PARAMS.max_tokens
        wait_until(lambda: is_idle(victim) and is_idle(decode), 5, "both workers idle after the fault")
    finally:
        assert victim.stop() == 0
