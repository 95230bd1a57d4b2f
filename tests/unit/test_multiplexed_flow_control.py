"""A `Calls` stream whose caller stops reading holds up its streaming calls, as a gRPC call of their own is held at
its `yield` by flow control: a hung router does not grow the worker's memory, and its requests stay where the
lease finds them (tests/cluster/test_leases.py)."""

from __future__ import annotations

import asyncio

from pdspark.rpc.multiplexed_server import MAX_PENDING, CallHandler, MultiplexedServer
from pdspark.v1 import worker_pb2


class _Context:
    """What `serve` reads of a grpc.aio servicer context."""

    def add_done_callback(self, callback) -> None:
        pass


def test_a_caller_that_stops_reading_holds_up_a_streaming_call():
    async def scenario() -> tuple[int, int]:
        produced = 0

        async def endless(request, context):
            nonlocal produced
            while True:
                produced += 1
                await asyncio.sleep(0)  # a token at a time, as the engine delivers them
                yield worker_pb2.GenerateChunk(token_ids=[produced])

        frames_in = asyncio.Queue()

        async def frames():
            while (message := await frames_in.get()) is not None:
                yield message

        server = MultiplexedServer({"generate": CallHandler(endless, "chunk", streaming=True)})
        replies = server.serve(frames(), _Context())
        await frames_in.put(worker_pb2.CallFrames(frames=[
            worker_pb2.CallFrame(call_id=1, generate=worker_pb2.GenerateRequest(request_id="r"))]))
        first = await replies.__anext__()  # the caller reads one message, then stops reading
        for _ in range(3 * MAX_PENDING):  # turns for the call to run on well past the bound, were nothing holding it
            await asyncio.sleep(0)
        held_at = produced
        await replies.aclose()
        return len(first.frames), held_at

    first, held_at = asyncio.run(scenario())
    assert first >= 1 and held_at <= first + MAX_PENDING + 1
