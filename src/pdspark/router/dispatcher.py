"""`Dispatcher`: one request = one (prefill, decode) pair, dispatched concurrently, tied by a transfer id.

Rules:
- The decode worker's stream is the response. The prefill leg runs beside it; when either leg fails, the other is
  cancelled (the decode stream is closed; the prefill worker gets `Abort`), so no half of a pair is left waiting.
- A failed pair is retried (new transfer id, another pair when there is one) only before the first token reached
  the caller; after that the failure ends the request.
- Every call carries a deadline; a client that goes away (or `abort`) cancels both legs.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace

import grpc

from pdspark.errors import ErrorCode, RequestFailed
from pdspark.router.policies import Policy
from pdspark.router.worker_registry import WorkerInfo, WorkerRegistry
from pdspark.rpc import convert
from pdspark.rpc.status import failure_from_rpc_error, reported_failure
from pdspark.types import FinishReason, SamplingParams, TokenLogprobs
from pdspark.v1 import worker_pb2

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DispatchChunk:
    """New tokens of a request (deltas), as the decode worker streamed them."""

    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprobs]
    finished: bool
    finish_reason: FinishReason | None  # set on the last chunk
    completion_tokens: int  # generated so far
    cached_tokens: int
    prefill_worker: str
    decode_worker: str


@dataclass
class _Active:
    prefill: WorkerInfo
    decode: WorkerInfo
    stream: grpc.aio.UnaryStreamCall | None = None
    prefill_call: asyncio.Future | None = None


class _PairFailed(Exception):
    """A pair's attempt failed: the failure to report, and the worker to avoid if the request is retried."""

    def __init__(self, failure: RequestFailed, avoid: str):
        super().__init__(str(failure))
        self.failure = failure
        self.avoid = avoid


class Dispatcher:
    def __init__(self, registry: WorkerRegistry, prefill_policy: Policy, decode_policy: Policy,
                 transfer_timeout_s: float = 30.0, max_attempts: int = 3, metrics=None):
        self.registry = registry
        self.prefill_policy = prefill_policy
        self.decode_policy = decode_policy
        self.transfer_timeout_s = transfer_timeout_s
        self.max_attempts = max_attempts
        self.metrics = metrics
        self.active: dict[str, _Active] = {}

    async def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                       timeout_s: float | None = None) -> AsyncIterator[DispatchChunk]:
        """Stream the request's tokens; raises `RequestFailed` if no pair could serve it."""
        # One seed for both legs and every attempt: the prefill worker draws token 1, the decode worker the rest.
        params = params if params.seed is not None else replace(params, seed=secrets.randbits(63))
        excluded: set[str] = set()
        last: RequestFailed | None = None
        for attempt in range(self.max_attempts):
            prefill, decode = self._pick(prompt_ids, excluded)
            started = False
            try:
                async for chunk in self._run_pair(request_id, prompt_ids, params, prefill, decode, timeout_s):
                    started = True
                    yield chunk
                return
            except _PairFailed as e:
                last = e.failure
                if started or not e.failure.code.retryable:
                    raise e.failure from e.__cause__
                logger.warning("request %s attempt %d on (%s, %s) failed before its first token: %s", request_id,
                               attempt + 1, prefill.address, decode.address, e.failure)
                if self.metrics is not None:
                    self.metrics.retries.inc()
                excluded.add(e.avoid)
        assert last is not None
        raise last

    def _pick(self, prompt_ids: list[int], excluded: set[str]) -> tuple[WorkerInfo, WorkerInfo]:
        prefills = [w for w in self.registry.healthy("prefill") if w.address not in excluded]
        decodes = [w for w in self.registry.healthy("decode") if w.address not in excluded]
        prefills = prefills or self.registry.healthy("prefill")  # after exclusions, fall back to any healthy one
        decodes = decodes or self.registry.healthy("decode")
        if not prefills or not decodes:
            raise RequestFailed(ErrorCode.UNAVAILABLE, "no healthy prefill and decode worker pair is registered")
        prefill = self.prefill_policy.select(prefills, prompt_ids)
        decode = self.decode_policy.select(decodes, prompt_ids)
        if self.metrics is not None:
            self.metrics.selected.labels(role="prefill", worker=prefill.address).inc()
            self.metrics.selected.labels(role="decode", worker=decode.address).inc()
        return prefill, decode

    async def _run_pair(self, request_id, prompt_ids, params, prefill: WorkerInfo, decode: WorkerInfo,
                        timeout_s: float | None) -> AsyncIterator[DispatchChunk]:
        transfer_id = uuid.uuid4().hex
        timeout_ms = convert.timeout_to_ms(self.transfer_timeout_s)  # relative: each worker times it from receipt
        sampling = convert.sampling_to_pb(params)
        active = _Active(prefill, decode)
        self.active[request_id] = active
        prefill.in_flight += 1
        decode.in_flight += 1
        try:
            active.prefill_call = asyncio.ensure_future(self.registry.prefill_stub(prefill).Prefill(
                worker_pb2.PrefillRequest(request_id=request_id, transfer_id=transfer_id,
                                          prompt_token_ids=prompt_ids, sampling=sampling, timeout_ms=timeout_ms),
                timeout=self.transfer_timeout_s + 5))
            active.stream = self.registry.decode_stub(decode).Generate(
                worker_pb2.GenerateRequest(request_id=request_id, transfer_id=transfer_id,
                                           prompt_token_ids=prompt_ids, sampling=sampling,
                                           prefill_address=prefill.address, timeout_ms=timeout_ms),
                timeout=timeout_s)
            completion = 0
            try:
                async for msg in active.stream:
                    completion += len(msg.token_ids)
                    yield DispatchChunk(list(msg.token_ids), msg.text, [convert.logprob_from_pb(x) for x in
                                        msg.logprobs], msg.finished, convert.finish_reason_from_pb(msg.finish_reason),
                                        completion, msg.num_cached_tokens, prefill.address, decode.address)
            except grpc.aio.AioRpcError as e:
                failure = failure_from_rpc_error(e)
                # A failure the decode worker reported is about the transfer, so the prefill worker is the one to
                # avoid; a call that failed without one never reached a working decode worker.
                avoid = prefill.address if reported_failure(e) is not None else decode.address
                raise _PairFailed(RequestFailed(failure.code, f"decode worker {decode.address}: {failure.message}"),
                                  avoid) from e
            await self._prefill_outcome(active)
        finally:
            prefill.in_flight -= 1
            decode.in_flight -= 1
            self.active.pop(request_id, None)
            await self._cancel_legs(request_id, active)

    async def _prefill_outcome(self, active: _Active) -> None:
        """Collect the prefill leg's answer (metrics only: the decode stream already succeeded)."""
        try:
            response = await asyncio.wait_for(active.prefill_call, timeout=5)
            if self.metrics is not None and not response.result.HasField("error"):
                self.metrics.transfer_bytes.observe(response.result.stats.bytes)
        except (grpc.aio.AioRpcError, asyncio.TimeoutError, asyncio.CancelledError):
            pass

    async def _cancel_legs(self, request_id: str, active: _Active) -> None:
        if active.stream is not None and not active.stream.done():
            active.stream.cancel()  # the decode worker aborts the request when its stream goes away
        if active.prefill_call is not None and not active.prefill_call.done():
            active.prefill_call.cancel()
            with contextlib.suppress(grpc.aio.AioRpcError):
                await self.registry.prefill_stub(active.prefill).Abort(
                    worker_pb2.AbortRequest(request_id=request_id), timeout=2)

    async def abort(self, request_id: str) -> bool:
        active = self.active.get(request_id)
        if active is None:
            return False
        await self._cancel_legs(request_id, active)
        return True
