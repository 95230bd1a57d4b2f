"""Stuck transfers on a prefill worker: a write still running past its bound (its deadline plus the transfer
backend's grace) is given up on, but its transfer thread stays blocked until the peer answers (the transfer engine's
first contact with a peer waits without a timeout). Such writes are counted (`pdspark_prefill_stuck_transfers`) from
the bound until their thread is free; while they hold every transfer thread the worker answers NOT_SERVING on the
gRPC health service and refuses prefills at once with a retryable UNAVAILABLE, and it serves again once one is free.

The peer that does not answer is a fake transfer backend whose writes block until the test releases them; the writes
carry an empty plan (nothing to copy: what is under test is how long a thread is held, not what it writes)."""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from helpers import sample_value
from pdspark.cache.req_pages import ReqPages
from pdspark.config import WorkerConfig
from pdspark.errors import ErrorCode, RequestFailed, Unanswered
from pdspark.options import build
from pdspark.rpc import convert
from pdspark.serving.transfer_writer import TransferWriter
from pdspark.serving.worker_server import WorkerServer
from pdspark.testing.time_scale import scaled
from pdspark.testing.waiting import async_seen_at, run_within, until
from pdspark.transfer.base import Write, check_deadline
from pdspark.transfer.compat import SCHEMA_VERSION, CompatDescriptor
from pdspark.transfer.plan import TransferPlan
from pdspark.types import SamplingParams
from pdspark.v1 import worker_pb2, worker_pb2_grpc

# The writes' own deadline and the backend's grace: the behaviour under test (their sum is the bound past which a
# write still running is stuck), not bounds of the test.
EXPIRES_S = 1.0
GRACE_S = 0.5
SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
WORKER = dict(model="dsv4-tiny", transfer_backend="inprocess", metrics_port=None, page_size=16, max_model_len=256,
              max_num_seqs=2)
COMPAT = CompatDescriptor(SCHEMA_VERSION, "fp", ("sliding_attention",), 4, 16, 8, 4, "float32", "float32", 16, 1,
                          8, 16, 32, "", prefix_cache=False)
# No buffers: no payload to copy, so the writes are the backend's `write` call alone.
PLAN = TransferPlan(transfer_id="t", request_id="r", session="silent-peer", compat=COMPAT, buffers=(), prompt_len=1,
                    full_pages=(), swa_pages=(), swa_first_page=0, c128_pages=(), req_slot=0, timeout_s=EXPIRES_S)


class SilentPeer:
    """A transfer backend whose writes block until `release` is set, as Mooncake's handshake with a stopped peer
    does; it starts no write after the deadline, as every backend."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.blocked = 0  # writes inside `write` now
        self._lock = threading.Lock()

    @property
    def session_id(self) -> str:
        return "silent-peer-local"

    def register(self, addr: int, nbytes: int) -> None:
        pass

    def write(self, session: str, writes: list[Write], deadline: float | None = None) -> None:
        check_deadline(deadline, 0, len(writes))
        with self._lock:
            self.blocked += 1
        try:
            assert self.release.wait(scaled(60)), "never released"
        finally:
            with self._lock:
                self.blocked -= 1

    def write_grace_s(self, nbytes: int) -> float:
        return GRACE_S

    def close(self) -> None:
        pass


def start_writes(writer: TransferWriter, n: int) -> tuple[list[asyncio.Future], float]:
    """`n` writes due `EXPIRES_S` from now; returns them and the bound past which they are stuck."""
    deadline_at = time.monotonic() + EXPIRES_S
    writes = [asyncio.ensure_future(writer.write(f"t{i}", PLAN, ReqPages(slot=0), deadline_at)) for i in range(n)]
    return writes, deadline_at + GRACE_S


def test_a_write_is_stuck_from_its_bound_until_its_thread_is_free_and_one_still_queued_is_not():
    peer = SilentPeer()
    writer = TransferWriter(peer, [], ThreadPoolExecutor(1), threads=1)  # type: ignore[arg-type]
    changes: list[int] = []
    writer.on_stuck.append(lambda: changes.append(writer.stuck))

    async def scenario():
        # Two writes for one thread: the first blocks in the backend, the second waits for the thread.
        (blocked, queued), bound = start_writes(writer, 2)
        seen = await async_seen_at(lambda: writer.stuck, 10, "the blocked write counted as stuck")
        assert seen >= bound, f"counted {bound - seen:.3f} s before its bound"
        for write in (blocked, queued):
            with pytest.raises(Unanswered, match="given up on"):
                await write
        # Only the write a thread took holds one: the queued one holds none, and will write nothing.
        assert writer.stuck == 1 and writer.all_stuck and changes == [1]
        peer.release.set()
        await until(lambda: writer.stuck == 0, 10, "the stuck write's thread free again")
        assert changes == [1, 0] and not writer.all_stuck

    try:
        run_within(scenario())
    finally:
        peer.release.set()
        writer.close()


def test_a_prefill_worker_whose_transfer_threads_are_all_stuck_is_not_serving_and_refuses_prefills():
    server = WorkerServer(build(WorkerConfig, WORKER, fixed={"role": "prefill"}))
    worker = server.worker
    peer = SilentPeer()
    worker.writer.backend = peer  # the transfer engine, and a peer of it that does not answer

    def stuck_gauge() -> float | None:
        return sample_value(server.metrics.registry, "pdspark_prefill_stuck_transfers")

    async def scenario():
        address = (await server.start())["address"]
        try:
            async with grpc.aio.insecure_channel(address) as channel:
                health = health_pb2_grpc.HealthStub(channel)
                stub = worker_pb2_grpc.PrefillWorkerStub(channel)

                async def status_is(want: int) -> bool:
                    reply = await health.Check(health_pb2.HealthCheckRequest(service=""), timeout=scaled(5))
                    return reply.status == want

                async def prefill(request_id: str, timeout_ms: int) -> RequestFailed:
                    reply = await stub.Prefill(worker_pb2.PrefillRequest(
                        request_id=request_id, transfer_id=f"t-{request_id}", prompt_token_ids=[5, 6, 7],
                        sampling=convert.sampling_to_pb(SamplingParams(max_tokens=1)), timeout_ms=timeout_ms),
                        timeout=scaled(10))
                    with pytest.raises(RequestFailed) as failed:
                        convert.result_from_pb(reply.result)
                    return failed.value

                assert await status_is(SERVING) and stuck_gauge() == 0
                threads = worker.writer.threads
                writes, bound = start_writes(worker.writer, threads)
                await until(lambda: peer.blocked == threads, 10, "every transfer thread blocked in a write")
                seen = await async_seen_at(stuck_gauge, 10, "a write counted as stuck")
                assert seen >= bound, f"counted {bound - seen:.3f} s before the bound"
                await until(lambda: stuck_gauge() == threads, 10, "every write counted as stuck")
                for write in writes:
                    with pytest.raises(Unanswered):
                        await write
                await until(lambda: status_is(NOT_SERVING), 5, "NOT_SERVING with every transfer thread stuck")
                # Refused at once, retryably, instead of queued behind the stuck writes until its deadline.
                t0 = time.monotonic()
                refused = await prefill("r1", 30_000)
                assert refused.code is ErrorCode.UNAVAILABLE and refused.code.retryable
                assert "transfer threads of this prefill worker are stuck" in refused.message
                assert time.monotonic() - t0 < scaled(5)
                peer.release.set()
                await until(lambda: status_is(SERVING), 5, "SERVING again once the threads are free")
                await until(lambda: stuck_gauge() == 0, 5, "no write stuck once every thread is free")
                # Taken again: this one waits for its plan (none comes) until its own deadline.
                expires_ms = 300  # the call's own timeout, not a bound
                assert (await prefill("r2", expires_ms)).code is ErrorCode.DEADLINE
        finally:
            peer.release.set()
            await server.stop(0.5)

    run_within(scenario())
    assert sample_value(server.metrics.registry, "pdspark_worker_requests_total", outcome="unavailable") == 1

