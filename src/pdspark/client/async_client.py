"""`AsyncClient`: the asyncio SDK (grpc.aio), the same surface as `Client` with awaitables."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc

from pdspark.client.client import (
    ClientError,
    GenerateResult,
    StreamChunk,
    TLSOptions,
    build_request,
    collect,
    make_channel,
    to_chunk,
)
from pdspark.v1 import router_pb2, router_pb2_grpc


class AsyncStream:
    def __init__(self, client: AsyncClient, call, request_id: str):
        self._client, self._call, self.request_id = client, call, request_id

    async def __aiter__(self) -> AsyncIterator[StreamChunk]:
        try:
            async for msg in self._call:
                yield to_chunk(msg)
        except grpc.aio.AioRpcError as e:
            raise ClientError.from_rpc_error(e) from e

    async def cancel(self) -> None:
        self._call.cancel()
        await self._client.abort(self.request_id)


class AsyncClient:
    def __init__(self, target: str, timeout: float | None = 300.0, tls: TLSOptions | None = None):
        self.timeout = timeout
        self._channel = make_channel(target, tls, aio=True)
        self._stub = router_pb2_grpc.RouterStub(self._channel)

    async def generate(self, prompt: str | None = None, *, token_ids: list[int] | None = None,
                       request_id: str | None = None, timeout: float | None = None, **sampling) -> GenerateResult:
        msg = build_request(prompt, token_ids, request_id, timeout or self.timeout, sampling)
        try:
            chunks = [c async for c in self._stub.Generate(msg, timeout=timeout or self.timeout)]
        except grpc.aio.AioRpcError as e:
            raise ClientError.from_rpc_error(e) from e
        return collect(chunks, msg.request_id)

    def stream(self, prompt: str | None = None, *, token_ids: list[int] | None = None,
               request_id: str | None = None, timeout: float | None = None, **sampling) -> AsyncStream:
        msg = build_request(prompt, token_ids, request_id, timeout or self.timeout, sampling)
        return AsyncStream(self, self._stub.Generate(msg, timeout=timeout or self.timeout), msg.request_id)

    async def abort(self, request_id: str) -> bool:
        try:
            reply = await self._stub.Abort(router_pb2.RouterAbortRequest(request_id=request_id), timeout=5)
            return reply.found
        except grpc.aio.AioRpcError:
            return False

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
