"""`Client`: the synchronous SDK. `generate()` returns a result; `stream()` yields chunks and can be cancelled
(which aborts the request on the server).

Deadlines: every call has one (`timeout`, per call or the client's), and the router bounds the whole request by it
(its queueing, every retry on another worker pair and the token stream), at most the router's own longest timeout.

Identity: the router names every request itself; that id (`StreamChunk.request_id`, `GenerateResult.request_id`,
`Stream.request_id()`) is unique and unguessable. The `request_id` you pass is only a label: the router logs it and
echoes it back as `client_request_id`, and two requests with the same label are still two requests with their
own tokens. Only the router's id reaches a request: `Client.abort(id)` takes it, so a request can be aborted only
by its caller, or by whoever the caller handed the id to; knowing its label is not enough. `Stream.cancel()` ends
your own stream at any time, before the router's id is known too.

Load: a router with no room even in its queue refuses at once: `ClientError` with `code` RESOURCE_EXHAUSTED,
`error_code` OVERLOADED (retryable) and `retry_after_s`, the seconds it suggests waiting.

Keys: a router with API keys wants one on every call: `Client(target, api_key=...)`, or the `PDSPARK_API_KEY`
variable when `api_key` is not given (as the openai client reads `OPENAI_API_KEY`; holding the router's
comma-separated list, its first key is used); `api_key=""` sends none. A missing or wrong key fails every call with
`code` UNAUTHENTICATED (`error_code` UNAUTHENTICATED, not retryable).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass, field

import grpc

from pdspark.errors import ErrorCode
from pdspark.rpc import convert
from pdspark.rpc.status import failure_from_rpc_error
from pdspark.types import FinishReason, SamplingParams, TokenLogprobs
from pdspark.v1 import router_pb2, router_pb2_grpc

# The router's metadata keys (pdspark.router.grpc_api, which the SDK does not import): its id of the request, sent
# at once in the initial metadata, and the seconds to wait before retrying a refused request.
REQUEST_ID_KEY = "pdspark-request-id"
RETRY_AFTER_KEY = "retry-after"
API_KEY_ENV = "PDSPARK_API_KEY"
# Ping a quiet connection every 30 s, so a long stream through a NAT or a vanished router fails instead of hanging:
# within 40 s of the router's last sign of life. gRPC core waits `ping_timeout_ms` (default 60 s) for a ping's ack,
# not `keepalive_timeout_ms` alone (pdspark.rpc.keepalive).
KEEPALIVE_OPTIONS = (("grpc.keepalive_time_ms", 30_000), ("grpc.keepalive_timeout_ms", 10_000),
                     ("grpc.http2.ping_timeout_ms", 10_000))


class ClientError(Exception):
    """A failed call. `code` is the gRPC status name (e.g. INVALID_ARGUMENT, DEADLINE_EXCEEDED, CANCELLED);
    `error_code` is pdspark's typed code: the one the router (or a worker behind it) reported, or, when the call
    failed in the transport (its deadline passed, the router is unreachable), what that status means.
    `error_code.retryable` says whether the same request may succeed if sent again; `retry_after_s`, set when the
    router was full (OVERLOADED), how many seconds it suggests waiting first."""

    def __init__(self, code: str, message: str, error_code: ErrorCode, retry_after_s: float | None = None):
        super().__init__(f"{code}: {message}")
        self.code, self.message, self.error_code = code, message, error_code
        self.retry_after_s = retry_after_s

    @classmethod
    def from_rpc_error(cls, e: grpc.RpcError) -> ClientError:
        retry_after = _metadata_value(e.trailing_metadata(), RETRY_AFTER_KEY)
        return cls(e.code().name, e.details() or "", failure_from_rpc_error(e).code,
                   float(retry_after) if retry_after else None)


def _metadata_value(metadata, key: str) -> str | None:
    for k, v in metadata or ():
        if k == key:
            return v.decode() if isinstance(v, bytes) else v
    return None


@dataclass(frozen=True)
class TLSOptions:
    """PEM bytes: the CA to trust (None: the system's roots), and for mutual TLS this client's key and certificate
    chain. The router's TLS gRPC port (`--ssl-certfile`) wants no client certificate: the API key authenticates."""

    root_certificates: bytes | None = None
    private_key: bytes | None = None
    certificate_chain: bytes | None = None

    @classmethod
    def from_files(cls, ca: str | None = None, cert: str | None = None, key: str | None = None) -> TLSOptions:
        """From PEM files: `ca` to trust (e.g. the one `pdspark up --tls` prints), `cert`/`key` for mutual TLS."""

        def read(path: str | None) -> bytes | None:
            if path is None:
                return None
            with open(path, "rb") as f:
                return f.read()

        return cls(read(ca), read(key), read(cert))

    def credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(self.root_certificates, self.private_key, self.certificate_chain)


@dataclass(frozen=True)
class StreamChunk:
    request_id: str  # the router's id of the request (what `abort` takes)
    token_ids: list[int]
    text: str
    finished: bool
    finish_reason: FinishReason | None  # set on the last chunk
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    client_request_id: str = ""  # the label passed as `request_id`, echoed
    # With `prompt_logprobs`, on the first chunk: one entry per prompt token, None for the first.
    prompt_logprobs: list[TokenLogprobs | None] | None = None


@dataclass(frozen=True)
class GenerateResult:
    request_id: str  # the router's id of the request
    text: str
    token_ids: list[int]
    finish_reason: FinishReason | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    client_request_id: str = ""  # the label passed as `request_id`, echoed
    # With `prompt_logprobs`: one entry per prompt token, None for the first (nothing predicts it).
    prompt_logprobs: list[TokenLogprobs | None] | None = None


def _prompt_logprobs(chunks: list[router_pb2.RouterGenerateChunk]) -> list[TokenLogprobs | None] | None:
    for c in chunks:
        if c.prompt_logprobs:
            return [None, *(convert.logprob_from_pb(x) for x in c.prompt_logprobs)]
    return None


def build_request(prompt: str | None, token_ids: list[int] | None, request_id: str | None, timeout: float | None,
                  sampling: dict) -> router_pb2.RouterGenerateRequest:
    if (prompt is None) == (token_ids is None):
        raise ValueError("pass exactly one of `prompt` (text) or `token_ids`")
    msg = router_pb2.RouterGenerateRequest(request_id=request_id or "", timeout_s=timeout or 0,
                                           sampling=convert.sampling_to_pb(SamplingParams(**sampling)))
    if prompt is not None:
        msg.text = prompt
    else:
        msg.token_ids.ids.extend(token_ids or [])
    return msg


def to_chunk(msg: router_pb2.RouterGenerateChunk) -> StreamChunk:
    return StreamChunk(msg.request_id, list(msg.token_ids), msg.text, msg.finished,
                       convert.finish_reason_from_pb(msg.finish_reason),
                       [convert.logprob_from_pb(x) for x in msg.logprobs], msg.client_request_id,
                       _prompt_logprobs([msg]))


def collect(chunks: list[router_pb2.RouterGenerateChunk]) -> GenerateResult:
    last = chunks[-1] if chunks else router_pb2.RouterGenerateChunk()
    return GenerateResult(
        request_id=last.request_id,
        text="".join(c.text for c in chunks),
        token_ids=[t for c in chunks for t in c.token_ids],
        finish_reason=convert.finish_reason_from_pb(last.finish_reason),
        prompt_tokens=last.prompt_tokens,
        completion_tokens=last.completion_tokens,
        cached_tokens=last.cached_tokens,
        logprobs=[convert.logprob_from_pb(x) for c in chunks for x in c.logprobs],
        client_request_id=last.client_request_id,
        prompt_logprobs=_prompt_logprobs(chunks),
    )


def make_channel(target: str, tls: TLSOptions | None, aio: bool = False):
    module = grpc.aio if aio else grpc
    if tls is None:
        return module.insecure_channel(target, options=KEEPALIVE_OPTIONS)
    return module.secure_channel(target, tls.credentials(), options=KEEPALIVE_OPTIONS)


def auth_metadata(api_key: str | None) -> tuple[tuple[str, str], ...]:
    """The metadata every call carries: `authorization: Bearer <key>` when there is a key (`api_key`, else the
    `PDSPARK_API_KEY` variable's first key), else nothing."""
    if api_key is None:
        api_key = next((k.strip() for k in os.environ.get(API_KEY_ENV, "").split(",") if k.strip()), "")
    return (("authorization", f"Bearer {api_key}"),) if api_key else ()


def request_id_of(initial_metadata) -> str | None:
    return _metadata_value(initial_metadata, REQUEST_ID_KEY) or None


class Stream:
    """An in-progress generation: iterate for chunks; `cancel()` stops it and aborts it on the server.
    `label` is the `request_id` it was started with; `request_id()` is the router's id of it."""

    def __init__(self, client: Client, call, label: str):
        self._client, self._call, self.label = client, call, label
        self._request_id: str | None = None

    def request_id(self) -> str | None:
        """The router's id of this request (what `Client.abort` takes), as soon as the router accepted the call
        (this waits for that); None if it never did."""
        if self._request_id is None:
            self._request_id = request_id_of(self._call.initial_metadata())
        return self._request_id

    def __iter__(self) -> Iterator[StreamChunk]:
        try:
            for msg in self._call:
                self._request_id = msg.request_id
                yield to_chunk(msg)
        except grpc.RpcError as e:
            raise ClientError.from_rpc_error(e) from e

    def cancel(self) -> None:
        """End the request: the router stops it on both workers when the call goes away (and `Abort` says so
        again when its id is already known)."""
        self._call.cancel()
        if self._request_id is not None:
            self._client.abort(self._request_id)


class Client:
    def __init__(self, target: str, timeout: float | None = 300.0, tls: TLSOptions | None = None,
                 api_key: str | None = None):
        """`api_key`: sent on every call (None: the `PDSPARK_API_KEY` variable's, if set; "": none)."""
        self.timeout = timeout
        self._channel = make_channel(target, tls)
        self._stub = router_pb2_grpc.RouterStub(self._channel)
        self._metadata = auth_metadata(api_key)

    def generate(self, prompt: str | None = None, *, token_ids: list[int] | None = None,
                 request_id: str | None = None, timeout: float | None = None, **sampling) -> GenerateResult:
        """Generate to completion. `sampling` takes `SamplingParams` fields (max_tokens, temperature, ...);
        `request_id` is your label for the request (the router names it: `GenerateResult.request_id`)."""
        msg = build_request(prompt, token_ids, request_id, timeout or self.timeout, sampling)
        try:
            chunks = list(self._stub.Generate(msg, timeout=timeout or self.timeout, metadata=self._metadata))
        except grpc.RpcError as e:
            raise ClientError.from_rpc_error(e) from e
        return collect(chunks)

    def stream(self, prompt: str | None = None, *, token_ids: list[int] | None = None,
               request_id: str | None = None, timeout: float | None = None, **sampling) -> Stream:
        """Stream a generation; as `generate`, and `Stream.cancel()` ends it."""
        msg = build_request(prompt, token_ids, request_id, timeout or self.timeout, sampling)
        call = self._stub.Generate(msg, timeout=timeout or self.timeout, metadata=self._metadata)
        return Stream(self, call, msg.request_id)

    def abort(self, request_id: str) -> bool:
        """Abort a request by the router's id of it (`Stream.request_id()`, a chunk's or result's `request_id`);
        False when the router serves no request of that id (a label is never one)."""
        try:
            request = router_pb2.RouterAbortRequest(request_id=request_id)
            return self._stub.Abort(request, timeout=5, metadata=self._metadata).found
        except grpc.RpcError:
            return False

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
