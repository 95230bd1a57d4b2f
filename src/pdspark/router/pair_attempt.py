"""`PairAttempt`: one attempt of a request on one (prefill, decode) pair, dispatched concurrently, tied by a transfer
id. Which pair, and whether a failed attempt is retried or migrated, is the `Dispatcher`'s call; this is the
mechanics of one try.

Rules:
- The decode worker's stream is the response. The prefill leg runs beside it; when either leg fails, the other is
  cancelled (the decode stream is closed; the prefill worker gets `Abort`), so no half of a pair is left waiting.
- A failure is blamed on the worker to avoid on a retry: a failure the decode worker reported before its first
  token is about the transfer (the prefill worker is avoided) unless it is `OVERLOADED`, the decode worker's own
  shortage (its line was full, or no room for the cache came before the deadline); any other failure of the
  stream is the decode worker's; a failed prefill leg is the prefill worker's.
- Every call carries a relative gRPC timeout: what is left of the request's `Deadline` (the transfer rendezvous
  keeps its own, shorter, `transfer_timeout_s`).
- From outside (`end`, `worker_down`, `worker_closing`) an attempt is ended by cancelling its decode stream with the
  failure to report; its reader raises that failure, a cancel of the reader's own task stays a cancel.
- A worker the router no longer has (`WorkerInfo.closed`: removed, or retired and drained) is never called again:
  the attempts that needed it were ended before its channel closed (`worker_closing`), and no Abort is sent there.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass

import grpc

from pdspark.deadline import Deadline
from pdspark.errors import ErrorCode, RequestFailed
from pdspark.router.random_id import uuid4_hex
from pdspark.router.workers.worker_registry import WorkerInfo, WorkerRegistry
from pdspark.rpc import convert, tracing
from pdspark.rpc.multiplexed_client import MultiplexedCall
from pdspark.rpc.status import failure_from_aio_error, reported_failure
from pdspark.types import FinishReason, TokenLogprobs
from pdspark.v1 import common_pb2, worker_pb2

# How long an attempt whose stream ended waits for its prefill leg's answer before aborting the leg. The leg answers
# once the transfer is done, which comes before the decode worker's first token: the wait covers only the reply's
# way back (and a test stub whose decode needs no transfer), never a transfer.
PREFILL_OUTCOME_WAIT_S = 5.0


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
    # With `prompt_logprobs`, on the first chunk: the prompt's tokens' logprobs from its second token on.
    prompt_logprobs: tuple[TokenLogprobs, ...] = ()

    def without_workers(self) -> DispatchChunk:
        """This chunk with no worker addresses (for a caller who may not see them). Positional: `replace` costs
        three times as much, on every chunk."""
        return DispatchChunk(self.token_ids, self.text, self.logprobs, self.finished, self.finish_reason,
                             self.completion_tokens, self.cached_tokens, "", "", self.prompt_logprobs)


class PairFailed(Exception):
    """A pair's attempt failed: the failure to report, the worker to avoid if the request is retried, and whether
    that worker looked gone (`gone`: its call failed without a failure it reported, e.g. a connection refused or
    reset, or it was marked down or removed) rather than alive and refusing (a failure it reported)."""

    def __init__(self, failure: RequestFailed, avoid: str, gone: bool = False):
        super().__init__(str(failure))
        self.failure = failure
        self.avoid = avoid
        self.gone = gone


@dataclass(frozen=True)
class AttemptRequest:
    """What one attempt asks its pair for."""

    number: int  # 0 for a request's first attempt (its span's `pdspark.attempt`)
    worker_request_id: str  # the id the workers know the attempt by: a retry never meets an earlier attempt there
    prompt_ids: list[int]
    generated: list[int]  # the tokens the caller already has (a migrated stream), read as the attempt starts
    sampling: common_pb2.SamplingParams  # the same seed on both legs and every attempt
    deadline: Deadline  # the whole request's, shared by all its attempts


@dataclass(frozen=True)
class LegCalls:
    """How attempts reach their workers: one per dispatcher, shared by all its attempts."""

    registry: WorkerRegistry
    transfer_timeout_s: float  # the transfer rendezvous' own timeout, relative: each worker times it from receipt
    background: set[asyncio.Future]  # Aborts sent to the prefill workers, held until they end


class PairAttempt:
    """One attempt: its two legs (the prefill call, the decode stream) and the chunks the stream brings.

    `chunks()` runs the attempt; it may be iterated once. `end`, `worker_down` and `worker_closing` end it from
    outside.
    `on_over` is called once the stream is over and before unsettled legs are cancelled: from then on there is
    nothing left to end (the dispatcher drops the attempt from its map of running ones).
    """

    def __init__(self, request: AttemptRequest, prefill: WorkerInfo, decode: WorkerInfo, calls: LegCalls,
                 trace: tracing.Span = tracing.NO_SPAN, on_over: Callable[[PairAttempt], None] | None = None):
        self.request = request
        self.prefill = prefill
        self.decode = decode
        self.calls = calls
        self.trace = trace  # the request's span: the attempt's own is its child
        self.on_over = on_over
        self.stream: grpc.aio.UnaryStreamCall | MultiplexedCall | None = None
        self.prefill_call: asyncio.Future | None = None
        self.failure: PairFailed | None = None  # why the attempt was ended from outside (its decode stream cancelled)
        self.streaming = False  # the decode stream sent its first chunk
        self._prefill_counted = False  # the leg counts in the prefill worker's `in_flight`

    async def chunks(self) -> AsyncGenerator[DispatchChunk, None]:
        """Send both legs and stream the decode worker's chunks: with `generated`, the prefill computes prompt +
        generated, the decode continues after them, and the chunks carry only what follows.

        Raises:
            PairFailed: a leg failed, or the attempt was ended from outside (`end`, `worker_down`,
                `worker_closing`).
        """
        request, prefill, decode = self.request, self.prefill, self.decode
        registry, transfer_timeout_s = self.calls.registry, self.calls.transfer_timeout_s
        generated = request.generated
        transfer_id = uuid4_hex()
        span = tracing.start("attempt", self.trace, {
            "pdspark.attempt": request.number, "pdspark.worker_request_id": request.worker_request_id,
            "pdspark.transfer_id": transfer_id, "pdspark.prefill_worker": prefill.name,
            "pdspark.decode_worker": decode.name,
            "pdspark.generated_tokens": len(generated)} if tracing.enabled() else None)
        metadata = tracing.metadata_of(span)  # the workers' spans are children of the attempt
        error: str | None = "cancelled"
        timeout_ms = convert.timeout_to_ms(transfer_timeout_s)  # relative: each worker times it from receipt
        prefill.in_flight += 1
        self._prefill_counted = True
        decode.in_flight += 1
        try:
            self.prefill_call = asyncio.ensure_future(registry.prefill_call(
                prefill, worker_pb2.PrefillRequest(request_id=request.worker_request_id, transfer_id=transfer_id,
                                                   prompt_token_ids=[*request.prompt_ids, *generated],
                                                   num_generated=len(generated), sampling=request.sampling,
                                                   timeout_ms=timeout_ms),
                min(transfer_timeout_s + 5, request.deadline.remaining()), metadata))
            self.prefill_call.add_done_callback(self._prefill_done)
            self.prefill_call.add_done_callback(self._prefill_answered)
            stream = self.stream = registry.generate_call(
                decode, worker_pb2.GenerateRequest(request_id=request.worker_request_id, transfer_id=transfer_id,
                                                   prompt_token_ids=request.prompt_ids, sampling=request.sampling,
                                                   prefill_address=prefill.address, timeout_ms=timeout_ms,
                                                   generated_token_ids=generated),
                request.deadline.remaining(), metadata)
            completion = len(generated)
            try:
                async for msg in stream:
                    self.streaming = True
                    completion += len(msg.token_ids)
                    if msg.finished:
                        error = None  # the caller may stop reading at the last chunk
                    yield DispatchChunk(list(msg.token_ids), msg.text, [convert.logprob_from_pb(x) for x in
                                        msg.logprobs], msg.finished, convert.finish_reason_from_pb(msg.finish_reason),
                                        completion, msg.num_cached_tokens, prefill.address, decode.address,
                                        tuple(convert.logprob_from_pb(x) for x in msg.prompt_logprobs))
            except grpc.aio.AioRpcError as e:
                failure = failure_from_aio_error(e)  # CANCELLED here is not ours (ours raises CancelledError)
                # A failure the decode worker reported is about the transfer, so the prefill worker is the one to
                # avoid; a call that failed without one never reached a working decode worker.
                # A full decode worker (OVERLOADED: refused at admission, or no room for the cache came before the
                # deadline) is itself the one to avoid.
                # Once tokens flow, the transfer is over: the decode worker is the one that failed.
                reported = reported_failure(e)
                transfer_side = (not self.streaming and reported is not None
                                 and reported.code is not ErrorCode.OVERLOADED)
                avoid = prefill.address if transfer_side else decode.address
                raise PairFailed(RequestFailed(failure.code, f"decode worker {decode.address}: {failure.message}"),
                                 avoid, gone=reported is None) from e
            except asyncio.CancelledError:
                # The attempt was ended from outside (the prefill leg failed, `abort`, a worker marked down or
                # removed): that failure ends it. A cancel of this task (the client went away) stays a cancel.
                if self.failure is None or _cancelling():
                    raise
                raise self.failure from None
            error = None
        except PairFailed as e:
            error = str(e.failure)
            raise
        finally:
            try:
                if error is None and not _cancelling():
                    # Also when the caller stopped reading at the last chunk (GeneratorExit at the `yield`).
                    await self._prefill_outcome()
            finally:
                tracing.finish(span, error)
                self._prefill_answered(None)  # (when the call was never made)
                decode.in_flight -= 1
                if self.on_over is not None:
                    self.on_over(self)
                await self._cancel_legs()

    def end(self, failure: PairFailed) -> None:
        """End the attempt with `failure`, unless its stream is over (or not open yet) or it was already ended."""
        if self.failure is None and self.stream is not None and not self.stream.done():
            self.failure = failure
            self.stream.cancel()  # the attempt's reader sees the cancel and raises `failure`

    def worker_down(self, worker: WorkerInfo, failure: RequestFailed) -> None:
        """`worker` was marked down: end the attempt if it still needs it (its calls would hang until keepalive or
        their deadlines). A prefill worker is no longer needed once its leg answered."""
        if self._needs(lambda w: w.address == worker.address):
            self.end(PairFailed(failure, worker.address, gone=True))

    def worker_closing(self, worker: WorkerInfo, failure: RequestFailed) -> None:
        """The router is about to close its channel to `worker` (this very entry: removed, or retired and drained):
        end the attempt if it still needs it, as `worker_down` does, before the close cancels its calls (a cancel
        the reader would otherwise take for its client's)."""
        if self._needs(lambda w: w is worker):
            self.end(PairFailed(failure, worker.address, gone=True))

    def _needs(self, match: Callable[[WorkerInfo], bool]) -> bool:
        """Whether the attempt still needs a worker `match` picks: its decode worker always, its prefill worker until
        the leg answered."""
        prefill_answered = self.streaming or (self.prefill_call is not None and self.prefill_call.done())
        return match(self.decode) or (match(self.prefill) and not prefill_answered)

    def _prefill_answered(self, _call: asyncio.Future | None) -> None:
        """The prefill worker holds the attempt's leg no more (`WorkerInfo.in_flight`), once."""
        if not self._prefill_counted:
            return
        self._prefill_counted = False
        self.prefill.in_flight -= 1

    def _prefill_done(self, call: asyncio.Future) -> None:
        """A prefill leg that fails ends the pair at once: the decode worker would otherwise wait for a transfer
        that never comes (e.g. a full prefill worker refused the request) until the rendezvous times out."""
        if call.cancelled():
            return
        e = call.exception()
        gone = False
        if isinstance(e, grpc.aio.AioRpcError):
            failure = failure_from_aio_error(e)
            gone = reported_failure(e) is None
        elif e is None and call.result().result.HasField("error"):
            failure = convert.failure_from_pb(call.result().result.error)
        else:
            return
        failure = RequestFailed(failure.code, f"prefill worker {self.prefill.address}: {failure.message}")
        self.end(PairFailed(failure, self.prefill.address, gone))

    async def _prefill_outcome(self) -> None:
        """Wait (briefly) for the prefill leg's answer once the decode stream ended, so that a leg about to settle
        is not sent an Abort. (Its transfer statistics are the prefill worker's metrics.)"""
        if self.prefill_call is None or self.prefill_call.done():
            return  # nothing to wait for (most often: the prefill worker answered before the last token)
        # `asyncio.wait`, not `wait_for`: neither the call's failure nor a timeout is raised here, and a cancel of
        # this task is not swallowed (the call itself is cancelled, and aborted, by `_cancel_legs`).
        await asyncio.wait({self.prefill_call}, timeout=PREFILL_OUTCOME_WAIT_S)

    async def _cancel_legs(self) -> None:
        if self.stream is not None and not self.stream.done():
            self.stream.cancel()  # the decode worker aborts the request when its stream goes away
        if self.prefill_call is not None and not _prefill_settled(self.prefill_call):
            # Also when the call already ended without the worker's answer (its deadline passed, the transport
            # broke): the prefill worker may still hold the request or wait for its plan; Abort drops it.
            self.prefill_call.cancel()
            if self.prefill.closed:
                # Removed: its channel is closed (calling it raises), and the close ended the leg's call, so the
                # worker drops what it held for it (as for any caller gone).
                return
            abort = asyncio.ensure_future(self.calls.registry.prefill_stub(self.prefill).Abort(
                worker_pb2.AbortRequest(request_id=self.request.worker_request_id), timeout=2))
            background = self.calls.background
            background.add(abort)
            abort.add_done_callback(background.discard)
            abort.add_done_callback(_consume)
            if not self.prefill.healthy:  # maybe hung: the retry does not wait for its answer
                return
            # Waited for (its own timeout bounds it), but neither its failure nor its cancel is raised here: the
            # worker may be removed meanwhile, its channel's close cancelling the Abort. A cancel of this task is.
            await asyncio.wait({abort})


def _prefill_settled(call: asyncio.Future) -> bool:
    """Whether the prefill worker is done with the attempt: it answered, with a result or a failure of its own."""
    if not call.done() or call.cancelled():
        return False
    e = call.exception()
    return e is None or (isinstance(e, grpc.aio.AioRpcError) and reported_failure(e) is not None)


def _consume(fut: asyncio.Future) -> None:
    """Read a background call's outcome (a failure is expected and of no use: the worker is down)."""
    if not fut.cancelled():
        fut.exception()


def _cancelling() -> bool:
    """Whether this task has been asked to cancel."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0
