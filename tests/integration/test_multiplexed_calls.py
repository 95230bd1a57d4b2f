"""Calls multiplexed on one `Calls` stream (`MultiplexedClient` -> `MultiplexedServer`, over the stub workers'
servicers) behave as the gRPC calls they stand for: replies reach their own call, failures keep their status,
details and typed trailer, timeouts and cancels reach the worker, and a stream that breaks ends its calls as a
broken connection does, the next call opening a new one. The router's own cases over this transport are in
test_router_migration.py, test_wire_errors.py and test_router_deadlines.py (`worker_calls`)."""

from __future__ import annotations

import asyncio
import contextlib
import time

import grpc
import pytest

from helpers import sample_value
from pdspark.errors import ErrorCode, RequestFailed
from pdspark.rpc.keepalive import CHANNEL_OPTIONS
from pdspark.rpc.malformed_requests import MalformedRequestInterceptor
from pdspark.rpc.multiplexed_client import MultiplexedClient, batches
from pdspark.rpc.status import failure_from_rpc_error, reported_failure
from pdspark.serving.grpc_services import DecodeServicer, PrefillServicer
from pdspark.serving.metrics import WorkerMetrics
from pdspark.testing.time_scale import scaled
from pdspark.testing.waiting import run_within, until
from pdspark.testing.worker_stubs import HANG, HOLD, StubDecode, StubPrefill, serve_stub
from pdspark.v1 import worker_pb2, worker_pb2_grpc

GENERATE = "/pdspark.v1.DecodeWorker/Calls"
PREFILL = "/pdspark.v1.PrefillWorker/Calls"


class CountingDecode(StubDecode):
    """Counts the messages its `Calls` streams brought."""

    def __init__(self, tokens: int):
        super().__init__(tokens)
        self.messages = 0

    async def Calls(self, request_iterator, context):
        async def counted():
            async for message in request_iterator:
                self.messages += 1
                yield message

        async with contextlib.aclosing(self.calls_server.serve(counted(), context)) as replies:
            async for message in replies:
                yield message


class BuggyPrefill(StubPrefill):
    async def Prefill(self, request, context):
        raise ValueError("a bug")


@contextlib.asynccontextmanager
async def served(stub, method: str):
    server, _, address = await serve_stub(stub)
    channel = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
    try:
        yield MultiplexedClient(channel, method), server, channel
    finally:
        await channel.close()
        await server.stop(None)


def generate(request_id: str) -> worker_pb2.GenerateRequest:
    return worker_pb2.GenerateRequest(request_id=request_id, prompt_token_ids=[1, 2])


async def texts(call) -> list[str]:
    return [chunk.text async for chunk in call]


def test_concurrent_calls_leave_in_one_message_and_each_gets_its_own_replies():
    async def scenario():
        stub = CountingDecode(tokens=3)
        async with served(stub, GENERATE) as (client, _, _):
            calls = [client.call("generate", generate(f"r{i}"), timeout=scaled(10)) for i in range(20)]
            results = await asyncio.gather(*(texts(c) for c in calls))
            assert results == [[f"r{i};"] * 3 for i in range(20)]
            assert stub.messages == 1  # queued before the writer woke: one message for all 20
            assert all(c.done() for c in calls)

    run_within(scenario(), 30)


@pytest.mark.parametrize("code", [ErrorCode.OVERLOADED, ErrorCode.TRANSFER, ErrorCode.INVALID_REQUEST])
def test_a_failure_keeps_its_status_details_and_typed_trailer(code):
    async def scenario():
        stub = StubPrefill()
        stub.mode = RequestFailed(code, "told so")
        async with served(stub, PREFILL) as (client, _, _):
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await client.call("prefill", worker_pb2.PrefillRequest(request_id="r"), timeout=scaled(10)).response()
            assert e.value.code().name == code.grpc_status and e.value.details() == "told so"
            reported = reported_failure(e.value)
            assert reported is not None and reported.code is code and reported.message == "told so"

    run_within(scenario(), 30)


def test_an_exception_in_the_handler_ends_the_call_unknown_without_a_trailer():
    async def scenario():
        async with served(BuggyPrefill(), PREFILL) as (client, _, _):
            for request_id in ("r", "s"):  # the stream serves on after a failed call
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await client.call("prefill", worker_pb2.PrefillRequest(request_id=request_id),
                                      timeout=scaled(10)).response()
                assert e.value.code() is grpc.StatusCode.UNKNOWN and "a bug" in e.value.details()
                assert reported_failure(e.value) is None

    run_within(scenario(), 30)


def test_the_timeout_and_metadata_reach_the_worker_and_an_expired_call_is_cancelled_there():
    async def scenario():
        stub = StubDecode(tokens=2)
        stub.mode = HANG
        async with served(stub, GENERATE) as (client, _, _):
            expires_s = 0.3  # the call's own timeout, the behaviour under test (not a bound)
            call = client.call("generate", generate("r"), timeout=expires_s,
                               metadata=(("traceparent", "00-ab-cd-01"),))
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await texts(call)
            assert e.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
            assert failure_from_rpc_error(e.value).code is ErrorCode.DEADLINE
            await until(lambda: stub.cancelled == ["r"], 5, "the expired call cancelled on the worker")
            (seen,) = stub.calls
            assert seen.traceparent == "00-ab-cd-01" and seen.timeout_s is not None and 0 < seen.timeout_s <= expires_s

    run_within(scenario(), 30)


def test_a_cancel_reaches_the_worker():
    async def scenario():
        stub = StubDecode(tokens=2)
        stub.mode = HOLD
        async with served(stub, GENERATE) as (client, _, _):
            call = client.call("generate", generate("r"), timeout=scaled(10))
            await until(lambda: len(stub.calls) == 1, 5, "the call at the worker")
            assert call.cancel() and call.done() and not call.cancel()
            with pytest.raises(asyncio.CancelledError):
                await texts(call)
            await until(lambda: stub.cancelled == ["r"], 5, "the cancelled call cancelled on the worker")

    run_within(scenario(), 30)


def test_cancelling_a_unary_calls_future_before_it_was_awaited_cancels_the_call():
    async def scenario():
        stub = StubPrefill()
        stub.mode = HOLD
        async with served(stub, PREFILL) as (client, _, _):
            response = client.call("prefill", worker_pb2.PrefillRequest(request_id="r"), timeout=scaled(10)).response()
            await until(lambda: len(stub.calls) == 1, 5, "the call at the worker")
            response.cancel()
            await until(lambda: stub.cancelled == ["r"], 5, "the call cancelled on the worker")

    run_within(scenario(), 30)


def test_a_broken_stream_ends_every_call_on_it_and_a_later_call_opens_a_new_one():
    async def scenario():
        stub = StubDecode(tokens=2)
        stub.mode = HOLD
        server, _, address = await serve_stub(stub)
        channel = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
        client = MultiplexedClient(channel, GENERATE)
        try:
            calls = [client.call("generate", generate(f"r{i}"), timeout=scaled(10)) for i in range(3)]
            await until(lambda: len(stub.calls) == 3, 5, "the calls at the worker")
            await server.stop(None)  # the worker dies
            for call in calls:
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await texts(call)
                assert failure_from_rpc_error(e.value).code is ErrorCode.UNAVAILABLE
                assert reported_failure(e.value) is None  # the transport's failure, not the worker's
            await until(lambda: sorted(stub.cancelled) == ["r0", "r1", "r2"], 5, "the calls ended on the worker")
            # The worker comes back at its address: a later call reaches it on a new stream.
            fresh = StubDecode(tokens=2)
            server, _, _ = await serve_stub(fresh, port=int(address.rsplit(":", 1)[1]))
            answered: list[list[str]] = []

            async def attempt() -> None:
                with contextlib.suppress(grpc.aio.AioRpcError):  # until the channel reconnected
                    answered.append(await texts(client.call("generate", generate("again"), timeout=scaled(1))))

            while not answered:
                await asyncio.wait_for(attempt(), scaled(5))
            assert answered == [["again;", "again;"]]
        finally:
            await channel.close()
            await server.stop(None)

    run_within(scenario(), 30)


def test_a_client_that_goes_away_ends_its_calls_on_the_worker():
    async def scenario():
        stub = StubDecode(tokens=2)
        stub.mode = HOLD
        async with served(stub, GENERATE) as (client, _, _):
            calls = [client.call("generate", generate(f"r{i}"), timeout=scaled(10)) for i in range(2)]
            await until(lambda: len(stub.calls) == 2, 5, "the calls at the worker")
            await client.close()
            assert all(c.done() for c in calls)
            for call in calls:
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await texts(call)
                assert e.value.code() is grpc.StatusCode.CANCELLED
            await until(lambda: sorted(stub.cancelled) == ["r0", "r1"], 5, "the calls cancelled on the worker")

    run_within(scenario(), 30)


def test_batches_hold_at_most_their_bytes_and_a_larger_frame_alone():
    frames = [worker_pb2.CallFrame(call_id=i, prefill=worker_pb2.PrefillRequest(prompt_token_ids=[1] * n))
              for i, n in enumerate([10, 10, 500, 10, 10])]
    runs = batches(frames, max_bytes=100)
    assert [[f.call_id for f in run] for run in runs] == [[0, 1], [2], [3, 4]]
    assert all(sum(f.ByteSize() for f in run) <= 100 for run in runs if len(run) > 1)


def test_calls_on_a_closed_channel_fail_as_a_dead_workers_so_the_router_retries_them():
    async def scenario():
        stub = StubDecode(tokens=2)
        stub.mode = HOLD
        async with served(stub, GENERATE) as (client, _, channel):
            call = client.call("generate", generate("r"), timeout=scaled(10))
            await until(lambda: len(stub.calls) == 1, 5, "the call at the worker")
            await channel.close()  # what the registry does to a removed or retired worker's channel
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await texts(call)
            assert failure_from_rpc_error(e.value).code is ErrorCode.UNAVAILABLE

    run_within(scenario(), 30)


def test_a_stopping_worker_refuses_new_calls_and_finishes_the_running_ones():
    async def scenario():
        stub = StubDecode(tokens=2)
        stub.mode = HOLD
        async with served(stub, GENERATE) as (client, _, _):
            running = client.call("generate", generate("r"), timeout=scaled(10))
            await until(lambda: len(stub.calls) == 1, 5, "the call at the worker")
            stub.calls_server.stop_taking_calls()
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await texts(client.call("generate", generate("late"), timeout=scaled(10)))
            assert failure_from_rpc_error(e.value).code is ErrorCode.UNAVAILABLE  # retried on another worker
            assert [c.request_id for c in stub.calls] == ["r"]
            stub.release.set()
            assert await texts(running) == ["r;", "r;"]

    run_within(scenario(), 30)


def test_a_stopping_worker_ends_an_open_stream_with_its_last_call_so_its_grace_is_its_calls():
    """A router keeps its `Calls` stream open between calls; a stopping worker must not spend its whole grace
    waiting for it to close (a rolling restart paid the grace on every worker)."""
    grace_s = scaled(30)

    async def scenario():
        stub = StubDecode(tokens=2)
        stub.mode = HOLD
        async with served(stub, GENERATE) as (client, server, _):
            running = client.call("generate", generate("r"), timeout=scaled(10))
            await until(lambda: len(stub.calls) == 1, 5, "the call at the worker")
            stub.calls_server.stop_taking_calls()
            stopped = asyncio.ensure_future(server.stop(grace_s))
            stub.release.set()
            assert await texts(running) == ["r;", "r;"]  # the running call ends as it would have
            t0 = time.monotonic()
            await stopped
            # Waiting out the grace would take all of it: half rules that out on any machine.
            assert time.monotonic() - t0 < grace_s / 2

    run_within(scenario(), 60)


def test_bad_input_on_a_calls_stream_is_invalid_argument():
    async def scenario():
        stub = StubDecode(tokens=2)
        server = grpc.aio.server(interceptors=[MalformedRequestInterceptor()])  # as a worker serves
        worker_pb2_grpc.add_DecodeWorkerServicer_to_server(stub, server)
        address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
        await server.start()
        try:
            async with grpc.aio.insecure_channel(address) as channel:
                # A call of a kind this worker does not take.
                client = MultiplexedClient(channel, GENERATE)
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await client.call("prefill", worker_pb2.PrefillRequest(), timeout=scaled(10)).response()
                assert e.value.code() is grpc.StatusCode.INVALID_ARGUMENT
                assert reported_failure(e.value).code is ErrorCode.INVALID_REQUEST
                # A second call under a running call's id: refused (under that id), never reaching the servicer.
                stub.mode = HOLD
                running = client.call("generate", generate("r"), timeout=scaled(10))
                await until(lambda: len(stub.calls) == 1, 5, "the call at the worker")
                assert client._stream is not None
                client._stream.send(worker_pb2.CallFrame(call_id=running.call_id, generate=generate("again")))
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await texts(running)
                assert e.value.code() is grpc.StatusCode.INVALID_ARGUMENT and "running already" in e.value.details()
                assert [c.request_id for c in stub.calls] == ["r"]
                # Bytes that are no CallFrames: the stream ends INVALID_ARGUMENT, with the typed trailer.
                raw = channel.stream_stream(GENERATE)(iter([b"\xff\xff\xff"]))
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    async for _ in raw:
                        pass
                assert e.value.code() is grpc.StatusCode.INVALID_ARGUMENT
                assert reported_failure(e.value).code is ErrorCode.INVALID_REQUEST
        finally:
            await server.stop(None)

    run_within(scenario(), 30)


@pytest.mark.parametrize("role", ["decode", "prefill"])
def test_a_call_cancelled_in_the_message_that_brought_it_is_dropped_and_counted_cancelled(role):
    """The router's caller goes away at once: the call's frame and its cancel leave in one message, so the worker
    cancels the call's task before its first step and the servicer's handler never runs. The stream must drop the
    call all the same (not hold it, and its prompt, for as long as the stream lives) and the worker count it
    `cancelled`, as it counts a call cancelled while running."""

    async def scenario():
        metrics = WorkerMetrics(role)
        # The worker's own servicer, with no worker behind it: the call never reaches its handler.
        servicer = (DecodeServicer if role == "decode" else PrefillServicer)(None, metrics)
        server = grpc.aio.server()
        if role == "decode":
            worker_pb2_grpc.add_DecodeWorkerServicer_to_server(servicer, server)
        else:
            worker_pb2_grpc.add_PrefillWorkerServicer_to_server(servicer, server)
        address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
        await server.start()
        try:
            async with grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS) as channel:
                client = MultiplexedClient(channel, GENERATE if role == "decode" else PREFILL)
                kind, request = ("generate", generate("r")) if role == "decode" else \
                    ("prefill", worker_pb2.PrefillRequest(request_id="r", prompt_token_ids=[1, 2]))
                call = client.call(kind, request, timeout=scaled(10))
                assert call.cancel()  # before the writer's turn: the call and its cancel are one message
                await until(lambda: servicer.calls.streams, 5, "the calls stream at the worker")
                (stream,) = servicer.calls.streams

                def cancelled() -> float | None:
                    return sample_value(metrics.registry, "pdspark_worker_requests_total", outcome="cancelled")

                await until(lambda: not stream.tasks, 5, "the call dropped from the stream's running calls")
                assert not stream.started  # its task never took a step: the cancel came in the same message
                await until(lambda: cancelled() == 1, 5, "the call counted cancelled")
                assert sum(sample_value(metrics.registry, "pdspark_worker_requests_total", outcome=o) or 0
                           for o in ("ok", "error")) == 0
                await client.close()
        finally:
            await server.stop(None)

    run_within(scenario(), 30)
