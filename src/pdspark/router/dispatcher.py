"""`Dispatcher`: one request = one (prefill, decode) pair, dispatched concurrently, tied by a transfer id.

Rules:
- The decode worker's stream is the response. The prefill leg runs beside it; when either leg fails, the other is
  cancelled (the decode stream is closed; the prefill worker gets `Abort`), so no half of a pair is left waiting.
- A failed pair is retried (new transfer id, another pair when there is one), up to `max_attempts` times before a
  token reached the caller. A worker that is full (`OVERLOADED`) is not tried again for the request: when every
  worker of a role has answered so, the request fails `OVERLOADED` (HTTP 429).
- A decode leg that fails after tokens reached the caller (its stream broke, its worker died or stopped answering
  health checks) is migrated, at most `max_migrations` times: a new pair gets prompt + the tokens generated so far;
  its prefill computes that context and samples the next token at the next position, its decode continues from
  there. Every draw is a function of (seed, position), so the continuation is the one the first decode worker
  would have produced (greedy and seeded alike, DSpark on or off), and the caller's stream goes on with no token
  lost, repeated or changed. Each migration is logged with the request id and counted.
- A worker the registry marks down (dead or hung: `WorkerRegistry.on_down`) ends the attempts that still need it
  at once, as a failure of that worker: a decode worker's (retried, or migrated once it streamed), and a prefill
  worker's until its leg answered. A hung worker costs a request the health checks' detection time, not its
  deadline; the Abort the hung prefill worker is sent is not waited for.
- Every call to a worker carries a relative gRPC timeout: what is left of the request's one `Deadline`, shared by
  all attempts (the transfer rendezvous keeps its own, shorter, `transfer_timeout_s`). A client that goes away (or
  `abort`) cancels both legs.
- Each attempt reaches the workers under its own id (the router's request id, suffixed on retries), so a retry on
  the same worker never meets the previous attempt's request there.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import logging
import secrets
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, field, replace

import grpc

from pdspark.deadline import Deadline
from pdspark.errors import ErrorCode, RequestFailed
from pdspark.router.random_id import uuid4_hex
from pdspark.router.workers.policies import Policy
from pdspark.router.workers.worker_registry import ROLES, WorkerInfo, WorkerRegistry
from pdspark.rpc import convert, tracing
from pdspark.rpc.multiplexed_client import MultiplexedCall
from pdspark.rpc.status import failure_from_rpc_error, reported_failure
from pdspark.types import FinishReason, SamplingParams, TokenLogprobs
from pdspark.v1 import common_pb2, worker_pb2

logger = logging.getLogger(__name__)

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

    def without_workers(self) -> DispatchChunk:
        """This chunk with no worker addresses (for a caller who may not see them). Positional: `replace` costs
        three times as much, on every chunk."""
        return DispatchChunk(self.token_ids, self.text, self.logprobs, self.finished, self.finish_reason,
                             self.completion_tokens, self.cached_tokens, "", "")


@dataclass
class _Active:
    prefill: WorkerInfo
    decode: WorkerInfo
    stream: grpc.aio.UnaryStreamCall | MultiplexedCall | None = None
    prefill_call: asyncio.Future | None = None
    failure: _PairFailed | None = None  # why the router itself ended the attempt (its decode stream cancelled)
    streaming: bool = False  # the decode stream sent its first chunk


class _PairFailed(Exception):
    """A pair's attempt failed: the failure to report, and the worker to avoid if the request is retried."""

    def __init__(self, failure: RequestFailed, avoid: str):
        super().__init__(str(failure))
        self.failure = failure
        self.avoid = avoid


@dataclass
class _Progress:
    """What of a request reached the caller: a migrated stream continues after it."""

    generated: list[int] = field(default_factory=list)
    cached_tokens: int | None = None  # the first pair's: later pairs' prefix caches hit the generated tokens too
    finished: bool = False
    migrations: int = 0

    def record(self, chunk: DispatchChunk) -> DispatchChunk:
        self.generated += chunk.token_ids
        self.finished = chunk.finished
        if self.cached_tokens is None:
            self.cached_tokens = chunk.cached_tokens
        if chunk.cached_tokens == self.cached_tokens:
            return chunk  # the first pair's chunks (most requests' all): no copy (`replace` costs ~5 µs)
        return replace(chunk, cached_tokens=self.cached_tokens)


class Dispatcher:
    def __init__(self, registry: WorkerRegistry, prefill_policy: Policy, decode_policy: Policy,
                 transfer_timeout_s: float = 30.0, max_attempts: int = 3, max_migrations: int = 3, metrics=None):
        self.registry = registry
        self.prefill_policy = prefill_policy
        self.decode_policy = decode_policy
        self.transfer_timeout_s = transfer_timeout_s
        self.max_attempts = max_attempts
        self.max_migrations = max_migrations
        self.metrics = metrics
        self.active: dict[str, _Active] = {}
        self._background: set[asyncio.Future] = set()  # Aborts sent to workers marked down, not awaited
        registry.on_down.append(self._worker_down)

    async def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams, deadline: Deadline,
                       aborted: asyncio.Event | None = None,
                       trace: tracing.Span = tracing.NO_SPAN) -> AsyncIterator[DispatchChunk]:
        """Stream the request's tokens, migrating the stream to another pair when its decode leg fails.

        Args:
            request_id: the router's id of the request (unique; `abort` takes it).
            deadline: when the whole request must be over, every attempt included.
            aborted: set when the caller aborted the request: no further attempt starts.
            trace: the request's span: each attempt's is its child; retries and migrations are its events.

        Raises:
            RequestFailed: no pair could serve it (the last attempt's failure), the deadline passed, aborted, or
                the stream failed more than `max_migrations` times.
        """
        # One seed for both legs and every attempt: the prefill worker draws token 1, the decode worker the rest.
        # Set on the wire message, made once for every attempt (a `replace` of `params` would check them again).
        sampling = convert.sampling_to_pb(params)
        if params.seed is None:
            sampling.seed = secrets.randbits(63)
        progress = _Progress()
        excluded: set[str] = set()
        last: RequestFailed | None = None
        attempts = 0  # since the last token reached the caller
        retries = 0
        trace.set_attribute("pdspark.migrations", 0)
        trace.set_attribute("pdspark.retries", 0)
        for n in itertools.count():
            if aborted is not None and aborted.is_set():
                raise RequestFailed(ErrorCode.ABORTED, "aborted by its caller")
            if deadline.expired:
                raise RequestFailed(ErrorCode.DEADLINE, f"the request's timeout ({deadline.timeout_s:.3g} s) passed "
                                    f"after {n} attempt(s)" + (f"; the last one: {last.message}" if last else ""))
            if attempts >= self.max_attempts:
                assert last is not None
                raise last
            context = [*prompt_ids, *progress.generated]
            prefill, decode = self._pick(context, excluded)
            worker_request_id = request_id if n == 0 else f"{request_id}-{n}"
            produced = False
            try:
                # `aclosing`: leaving the loop at the last chunk ends the attempt here and now (its legs settled or
                # cancelled), not whenever the garbage collector finalizes the generator.
                async with contextlib.aclosing(self._run_pair(request_id, worker_request_id, prompt_ids,
                                                              progress.generated, sampling, prefill, decode,
                                                              deadline, trace, n)) as chunks:
                    async for chunk in chunks:
                        produced = True
                        yield progress.record(chunk)
                        if progress.finished:
                            return  # whatever the stream does after its last chunk changes nothing for the caller
                return
            except _PairFailed as e:
                last = e.failure
                if not e.failure.code.retryable:
                    raise e.failure from e.__cause__
                if deadline.expired:
                    continue  # neither a retry nor a migration: the loop's head ends the request with DEADLINE
                if produced:
                    self._migrating(request_id, progress, decode, e.failure)
                    trace.add_event("migration", {"pdspark.from_decode_worker": decode.name,
                                                  "pdspark.generated_tokens": len(progress.generated),
                                                  "pdspark.reason": e.failure.code.value})
                    trace.set_attribute("pdspark.migrations", progress.migrations)
                    attempts = 0
                    excluded = {decode.address}
                    continue
                attempts += 1
                excluded.add(e.avoid)
                if e.failure.code is ErrorCode.OVERLOADED and not self._untried_pair(excluded):
                    raise e.failure from e.__cause__  # every worker of a role is full: 429 now, not a retry on one
                logger.warning("request %s attempt %d on (%s, %s) failed before its first token: %s", request_id,
                               n + 1, prefill.address, decode.address, e.failure)
                if self.metrics is not None:
                    self.metrics.retries.inc()
                retries += 1
                trace.add_event("retry", {"pdspark.avoid": self._name(e.avoid),
                                          "pdspark.reason": e.failure.code.value})
                trace.set_attribute("pdspark.retries", retries)
        raise AssertionError("unreachable")

    def _migrating(self, request_id: str, progress: _Progress, decode: WorkerInfo, failure: RequestFailed) -> None:
        """Count a migration of the stream off `decode`, or end the request when it has had its share."""
        if progress.migrations >= self.max_migrations:
            raise RequestFailed(failure.code, f"{failure.message} (the stream was already migrated "
                                              f"{progress.migrations} times, the most allowed: max_migrations)")
        progress.migrations += 1
        logger.warning("request %s: decode worker %s failed after %d tokens (%s); migrating the stream to another "
                       "pair (migration %d of at most %d)", request_id, decode.address, len(progress.generated),
                       failure, progress.migrations, self.max_migrations)
        if self.metrics is not None:
            self.metrics.migrations.inc()

    def _name(self, address: str) -> str:
        """A worker's name (what spans and metrics call it, never its address)."""
        w = self.registry.workers.get(address)
        return w.name if w is not None else ""

    def _untried_pair(self, excluded: set[str]) -> bool:
        return all(any(w.address not in excluded for w in self.registry.healthy(role)) for role in ROLES)

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
            self.metrics.count_selected("prefill", prefill.name)
            self.metrics.count_selected("decode", decode.name)
        return prefill, decode

    async def _run_pair(self, key: str, request_id: str, prompt_ids: list[int], generated: list[int],
                        sampling: common_pb2.SamplingParams, prefill: WorkerInfo, decode: WorkerInfo,
                        request_deadline: Deadline,
                        trace: tracing.Span = tracing.NO_SPAN, number: int = 0) -> AsyncGenerator[DispatchChunk, None]:
        """One attempt. `generated`: the tokens the caller already has (a migrated stream): the prefill computes
        prompt + generated, the decode continues after them; the chunks carry only what follows."""
        transfer_id = uuid4_hex()
        span = tracing.start("attempt", trace, {
            "pdspark.attempt": number, "pdspark.worker_request_id": request_id, "pdspark.transfer_id": transfer_id,
            "pdspark.prefill_worker": prefill.name, "pdspark.decode_worker": decode.name,
            "pdspark.generated_tokens": len(generated)} if tracing.enabled() else None)
        metadata = tracing.metadata_of(span)  # the workers' spans are children of the attempt
        error: str | None = "cancelled"
        timeout_ms = convert.timeout_to_ms(self.transfer_timeout_s)  # relative: each worker times it from receipt
        active = _Active(prefill, decode)
        self.active[key] = active
        prefill.in_flight += 1
        decode.in_flight += 1
        try:
            active.prefill_call = asyncio.ensure_future(self.registry.prefill_call(
                prefill, worker_pb2.PrefillRequest(request_id=request_id, transfer_id=transfer_id,
                                                   prompt_token_ids=[*prompt_ids, *generated], sampling=sampling,
                                                   timeout_ms=timeout_ms),
                min(self.transfer_timeout_s + 5, request_deadline.remaining()), metadata))
            active.prefill_call.add_done_callback(functools.partial(self._prefill_done, active))
            active.stream = self.registry.generate_call(
                decode, worker_pb2.GenerateRequest(request_id=request_id, transfer_id=transfer_id,
                                                   prompt_token_ids=prompt_ids, sampling=sampling,
                                                   prefill_address=prefill.address, timeout_ms=timeout_ms,
                                                   generated_token_ids=generated),
                request_deadline.remaining(), metadata)
            completion = len(generated)
            try:
                async for msg in active.stream:
                    active.streaming = True
                    completion += len(msg.token_ids)
                    if msg.finished:
                        error = None  # the caller may stop reading at the last chunk
                    yield DispatchChunk(list(msg.token_ids), msg.text, [convert.logprob_from_pb(x) for x in
                                        msg.logprobs], msg.finished, convert.finish_reason_from_pb(msg.finish_reason),
                                        completion, msg.num_cached_tokens, prefill.address, decode.address)
            except grpc.aio.AioRpcError as e:
                failure = failure_from_rpc_error(e)
                # A failure the decode worker reported is about the transfer, so the prefill worker is the one to
                # avoid; a call that failed without one never reached a working decode worker.
                # A full decode worker (OVERLOADED) is itself the one to avoid.
                # Once tokens flow, the transfer is over: the decode worker is the one that failed.
                reported = reported_failure(e)
                transfer_side = (not active.streaming and reported is not None
                                 and reported.code is not ErrorCode.OVERLOADED)
                avoid = prefill.address if transfer_side else decode.address
                raise _PairFailed(RequestFailed(failure.code, f"decode worker {decode.address}: {failure.message}"),
                                  avoid) from e
            except asyncio.CancelledError:
                # The router cancelled the decode stream itself (the prefill leg failed, or `abort`): that failure
                # ends the attempt. A cancel of this task (the client went away) stays a cancel.
                if active.failure is None or _cancelling():
                    raise
                raise active.failure from None
            error = None
        except _PairFailed as e:
            error = str(e.failure)
            raise
        finally:
            try:
                if error is None and not _cancelling():
                    # Also when the caller stopped reading at the last chunk (GeneratorExit at the `yield`).
                    await self._prefill_outcome(active)
            finally:
                tracing.finish(span, error)
                prefill.in_flight -= 1
                decode.in_flight -= 1
                if self.active.get(key) is active:
                    del self.active[key]
                await self._cancel_legs(request_id, active)

    def _prefill_done(self, active: _Active, call: asyncio.Future) -> None:
        """A prefill leg that fails ends the pair at once: the decode worker would otherwise wait for a transfer
        that never comes (e.g. a full prefill worker refused the request) until the rendezvous times out."""
        if call.cancelled():
            return
        e = call.exception()
        if isinstance(e, grpc.aio.AioRpcError):
            failure = failure_from_rpc_error(e)
        elif e is None and call.result().result.HasField("error"):
            failure = convert.failure_from_pb(call.result().result.error)
        else:
            return
        failure = RequestFailed(failure.code, f"prefill worker {active.prefill.address}: {failure.message}")
        self._end_attempt(active, _PairFailed(failure, active.prefill.address))

    def _end_attempt(self, active: _Active, failure: _PairFailed) -> None:
        if active.failure is None and active.stream is not None and not active.stream.done():
            active.failure = failure
            active.stream.cancel()  # the attempt's reader sees the cancel and raises `failure`

    async def _prefill_outcome(self, active: _Active) -> None:
        """Wait (briefly) for the prefill leg's answer once the decode stream ended, so that a leg about to settle
        is not sent an Abort. (Its transfer statistics are the prefill worker's metrics.)"""
        if active.prefill_call is None or active.prefill_call.done():
            return  # nothing to wait for (most often: the prefill worker answered before the last token)
        # `asyncio.wait`, not `wait_for`: neither the call's failure nor a timeout is raised here, and a cancel of
        # this task is not swallowed (the call itself is cancelled, and aborted, by `_cancel_legs`).
        await asyncio.wait({active.prefill_call}, timeout=PREFILL_OUTCOME_WAIT_S)

    async def _cancel_legs(self, request_id: str, active: _Active) -> None:
        if active.stream is not None and not active.stream.done():
            active.stream.cancel()  # the decode worker aborts the request when its stream goes away
        if active.prefill_call is not None and not _prefill_settled(active.prefill_call):
            # Also when the call already ended without the worker's answer (its deadline passed, the transport
            # broke): the prefill worker may still hold the request or wait for its plan; Abort drops it.
            active.prefill_call.cancel()
            abort = asyncio.ensure_future(self.registry.prefill_stub(active.prefill).Abort(
                worker_pb2.AbortRequest(request_id=request_id), timeout=2))
            if not active.prefill.healthy:  # maybe hung: the retry does not wait for its answer
                self._background.add(abort)
                abort.add_done_callback(self._background.discard)
                abort.add_done_callback(_consume)
                return
            with contextlib.suppress(grpc.aio.AioRpcError):
                await abort

    def _worker_down(self, worker: WorkerInfo) -> None:
        """The registry marked `worker` down: end the attempts that still need it (its calls would hang until
        keepalive or their deadlines). A prefill worker is no longer needed once its leg answered."""
        failure = RequestFailed(ErrorCode.UNAVAILABLE, f"{worker.role} worker {worker.address} stopped answering "
                                                       "health checks")
        for active in list(self.active.values()):
            prefill_answered = active.streaming or (active.prefill_call is not None and active.prefill_call.done())
            needed = active.decode.address == worker.address or (active.prefill.address == worker.address
                                                                 and not prefill_answered)
            if needed:
                self._end_attempt(active, _PairFailed(failure, worker.address))

    def abort(self, request_id: str) -> bool:
        """End the running attempt of the request `request_id` (the router's id) with `ABORTED`; the attempt
        cancels both legs on its way out. False when no attempt is running."""
        active = self.active.get(request_id)
        if active is None:
            return False
        self._end_attempt(active, _PairFailed(RequestFailed(ErrorCode.ABORTED, "aborted by its caller"), ""))
        return True


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
    """Whether this task has been asked to cancel (Python 3.11+; before it, a cancel cannot be told apart)."""
    task = asyncio.current_task()
    cancelling = getattr(task, "cancelling", None)
    return bool(cancelling()) if cancelling is not None else False
