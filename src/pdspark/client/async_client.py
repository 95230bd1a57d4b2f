"""`AsyncClient`: the asyncio SDK (grpc.aio), the same surface as `Client` with awaitables."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc

from pdspark.client.client import (
    ClientError,
    GenerateResult,
    StreamChunk,
    TLSOptions,
    auth_metadata,
    build_request,
    collect,
    make_channel,
    request_id_of,
    to_chunk,
)
from pdspark.v1 import router_pb2, router_pb2_grpc


class AsyncStream:
    """As `Stream`: `label` is the `request_id` it was started with; `await request_id()` the router's id."""

    def __init__(self, client: AsyncClient, call, label: str):
        self._client, self._call, self.label = client, call, label
        self._request_id: str | None = None

    async def request_id(self) -> str | None:
        """The router's id of this request, as soon as the router accepted the call; None if it never did."""
        if self._request_id is None:
            self._request_id = request_id_of(await self._call.initial_metadata())
        return self._request_id

    async def __aiter__(self) -> AsyncIterator[StreamChunk]:
        try:
            async for msg in self._call:
                self._request_id = msg.request_id
                yield to_chunk(msg)
        except grpc.aio.AioRpcError as e:
            raise ClientError.from_rpc_error(e) from e

    async def cancel(self) -> None:
        self._call.cancel()
        if self._request_id is not None:
            await self._client.abort(self._request_id)


class AsyncClient:
    def __init__(self, target: str, timeout: float | None = 300.0, tls: TLSOptions | None = None,
                 api_key: str | None = None):
        """`api_key`: sent on every call (None: the `PDSPARK_API_KEY` variable's, if set; "": none)."""
        self.timeout = timeout
        self._channel = make_channel(target, tls, aio=True)
        self._stub = router_pb2_grpc.RouterStub(self._channel)
        self._metadata = auth_metadata(api_key)

    async def generate(self, prompt: str | None = None, *, token_ids: list[int] | None = None,
                       request_id: str | None = None, timeout: float | None = None, **sampling) -> GenerateResult:
        msg = build_request(prompt, token_ids, request_id, timeout or self.timeout, sampling)
        try:
            call = self._stub.Generate(msg, timeout=timeout or self.timeout, metadata=self._metadata)
            chunks = [c async for c in call]
        except grpc.aio.AioRpcError as e:
            raise ClientError.from_rpc_error(e) from e
        return collect(chunks)

    def stream(self, prompt: str | None = None, *, token_ids: list[int] | None = None,
               request_id: str | None = None, timeout: float | None = None, **sampling) -> AsyncStream:
        msg = build_request(prompt, token_ids, request_id, timeout or self.timeout, sampling)
        call = self._stub.Generate(msg, timeout=timeout or self.timeout, metadata=self._metadata)
        return AsyncStream(self, call, msg.request_id)

    async def abort(self, request_id: str) -> bool:
        try:
            reply = await self._stub.Abort(router_pb2.RouterAbortRequest(request_id=request_id), timeout=5,
                                           metadata=self._metadata)
            return reply.found
        except grpc.aio.AioRpcError:
            return False

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
