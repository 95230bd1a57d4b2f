"""`Client`: the synchronous SDK. `generate()` returns a result; `stream()` yields chunks and can be cancelled
(which aborts the request on the server). Every call has a deadline (`timeout`, per call or the client's)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field

import grpc

from pdspark.errors import ErrorCode
from pdspark.rpc import convert
from pdspark.rpc.status import failure_from_rpc_error
from pdspark.types import FinishReason, SamplingParams, TokenLogprobs
from pdspark.v1 import router_pb2, router_pb2_grpc


class ClientError(Exception):
    """A failed call. `code` is the gRPC status name (e.g. INVALID_ARGUMENT, DEADLINE_EXCEEDED, CANCELLED);
    `error_code` is pdspark's typed code: the one the router (or a worker behind it) reported, or, when the call
    failed in the transport (its deadline passed, the router is unreachable), what that status means.
    `error_code.retryable` says whether the same request may succeed if sent again."""

    def __init__(self, code: str, message: str, error_code: ErrorCode):
        super().__init__(f"{code}: {message}")
        self.code, self.message, self.error_code = code, message, error_code

    @classmethod
    def from_rpc_error(cls, e: grpc.RpcError) -> ClientError:
        return cls(e.code().name, e.details() or "", failure_from_rpc_error(e).code)  # type: ignore[attr-defined]


@dataclass(frozen=True)
class TLSOptions:
    """PEM bytes: the CA to trust, and for mutual TLS this client's key and certificate chain."""

    root_certificates: bytes | None = None
    private_key: bytes | None = None
    certificate_chain: bytes | None = None

    def credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(self.root_certificates, self.private_key, self.certificate_chain)


@dataclass(frozen=True)
class StreamChunk:
    request_id: str
    token_ids: list[int]
    text: str
    finished: bool
    finish_reason: FinishReason | None  # set on the last chunk
    logprobs: list[TokenLogprobs] = field(default_factory=list)


@dataclass(frozen=True)
class GenerateResult:
    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: FinishReason | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    logprobs: list[TokenLogprobs] = field(default_factory=list)


def build_request(prompt: str | None, token_ids: list[int] | None, request_id: str | None, timeout: float | None,
                  sampling: dict) -> router_pb2.RouterGenerateRequest:
    if (prompt is None) == (token_ids is None):
        raise ValueError("pass exactly one of `prompt` (text) or `token_ids`")
    msg = router_pb2.RouterGenerateRequest(request_id=request_id or uuid.uuid4().hex, timeout_s=timeout or 0,
                                           sampling=convert.sampling_to_pb(SamplingParams(**sampling)))
    if prompt is not None:
        msg.text = prompt
    else:
        msg.token_ids.ids.extend(token_ids or [])
    return msg


def to_chunk(msg: router_pb2.RouterGenerateChunk) -> StreamChunk:
    return StreamChunk(msg.request_id, list(msg.token_ids), msg.text, msg.finished,
                       convert.finish_reason_from_pb(msg.finish_reason),
                       [convert.logprob_from_pb(x) for x in msg.logprobs])


def collect(chunks: list[router_pb2.RouterGenerateChunk], request_id: str) -> GenerateResult:
    last = chunks[-1] if chunks else router_pb2.RouterGenerateChunk()
    return GenerateResult(
        request_id=request_id,
        text="".join(c.text for c in chunks),
        token_ids=[t for c in chunks for t in c.token_ids],
        finish_reason=convert.finish_reason_from_pb(last.finish_reason),
        prompt_tokens=last.prompt_tokens,
        completion_tokens=last.completion_tokens,
        cached_tokens=last.cached_tokens,
        logprobs=[convert.logprob_from_pb(x) for c in chunks for x in c.logprobs],
    )


def make_channel(target: str, tls: TLSOptions | None, aio: bool = False):
    module = grpc.aio if aio else grpc
    if tls is None:
        return module.insecure_channel(target)
    return module.secure_channel(target, tls.credentials())


class Stream:
    """An in-progress generation: iterate for chunks; `cancel()` stops it and aborts it on the server."""

    def __init__(self, client: Client, call, request_id: str):
        self._client, self._call, self.request_id = client, call, request_id

    def __iter__(self) -> Iterator[StreamChunk]:
        try:
            for msg in self._call:
                yield to_chunk(msg)
        except grpc.RpcError as e:
            raise ClientError.from_rpc_error(e) from e

    def cancel(self) -> None:
        self._call.cancel()
        self._client.abort(self.request_id)


class Client:
    def __init__(self, target: str, timeout: float | None = 300.0, tls: TLSOptions | None = None):
        self.timeout = timeout
        self._channel = make_channel(target, tls)
        self._stub = router_pb2_grpc.RouterStub(self._channel)

    def generate(self, prompt: str | None = None, *, token_ids: list[int] | None = None,
                 request_id: str | None = None, timeout: float | None = None, **sampling) -> GenerateResult:
        """Generate to completion. `sampling` takes `SamplingParams` fields (max_tokens, temperature, ...)."""
        msg = build_request(prompt, token_ids, request_id, timeout or self.timeout, sampling)
        try:
            chunks = list(self._stub.Generate(msg, timeout=timeout or self.timeout))
        except grpc.RpcError as e:
            raise ClientError.from_rpc_error(e) from e
        return collect(chunks, msg.request_id)

    def stream(self, prompt: str | None = None, *, token_ids: list[int] | None = None,
               request_id: str | None = None, timeout: float | None = None, **sampling) -> Stream:
        msg = build_request(prompt, token_ids, request_id, timeout or self.timeout, sampling)
        return Stream(self, self._stub.Generate(msg, timeout=timeout or self.timeout), msg.request_id)

    def abort(self, request_id: str) -> bool:
        try:
            return self._stub.Abort(router_pb2.RouterAbortRequest(request_id=request_id), timeout=5).found
        except grpc.RpcError:
            return False

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
