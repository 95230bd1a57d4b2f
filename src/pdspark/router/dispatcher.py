"""`Dispatcher`: one request = one (prefill, decode) pair at a time; which pair, and what follows a failed one.

Rules:
- Each attempt is a `PairAttempt` (`pair_attempt.py`): both legs dispatched concurrently, tied by a transfer id;
  the decode worker's stream is the response, and when either leg fails the other is cancelled.
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
- A worker removed (`DELETE /workers`), or retired (DNS discovery) and closed with calls still on it at the end of
  its drain, ends the attempts that still need it the same way (`WorkerRegistry.on_closing`), before its channel
  closes: they are retried or migrated, never taken for a client's cancel, and nothing is sent to the closed channel.
- A worker that failed a request by being gone (`PairFailed.gone`: crashed, unreachable, marked down or removed;
  not a failure it reported), when its role has no other healthy worker left: before the retry or migration, the
  request waits for a worker of that role to answer a health check after the failure (a restart on the same
  address, or another worker re-admitted), for up to `max_role_outage_wait_s` and never past its deadline. The wait
  is not an attempt; the failure before it is. With one decode worker, its crash costs the streams the restart's
  time, not their requests.
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
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field, replace

from pdspark.deadline import Deadline
from pdspark.errors import ErrorCode, RequestFailed
from pdspark.router.pair_attempt import AttemptRequest, DispatchChunk, LegCalls, PairAttempt, PairFailed
from pdspark.router.workers.policies import Policy
from pdspark.router.workers.worker_registry import ROLES, WorkerInfo, WorkerRegistry
from pdspark.rpc import convert, tracing
from pdspark.types import SamplingParams

logger = logging.getLogger(__name__)


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
                 transfer_timeout_s: float = 30.0, max_attempts: int = 3, max_migrations: int = 3,
                 max_role_outage_wait_s: float = 60.0, metrics=None):
        self.registry = registry
        self.prefill_policy = prefill_policy
        self.decode_policy = decode_policy
        self.calls = LegCalls(registry, transfer_timeout_s, set())
        self.max_attempts = max_attempts
        self.max_migrations = max_migrations
        self.max_role_outage_wait_s = max_role_outage_wait_s
        self.metrics = metrics
        self.active: dict[str, PairAttempt] = {}  # the running attempt of each request (by the router's id)
        registry.on_down.append(self._worker_down)
        registry.on_closing.append(self._worker_closing)

    async def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams, deadline: Deadline,
                       aborted: asyncio.Event | None = None,
                       trace: tracing.Span = tracing.NO_SPAN) -> AsyncGenerator[DispatchChunk, None]:
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
            attempt = PairAttempt(AttemptRequest(n, worker_request_id, prompt_ids, progress.generated, sampling,
                                                 deadline), prefill, decode, self.calls, trace,
                                  on_over=functools.partial(self._forget, request_id))
            # Until its stream is over, `abort` and a worker's failure reach the attempt through this map.
            self.active[request_id] = attempt
            try:
                # `aclosing`: leaving the loop at the last chunk ends the attempt here and now (its legs settled or
                # cancelled), not whenever the garbage collector finalizes the generator.
                async with contextlib.aclosing(attempt.chunks()) as chunks:
                    async for chunk in chunks:
                        produced = True
                        yield progress.record(chunk)
                        if progress.finished:
                            return  # whatever the stream does after its last chunk changes nothing for the caller
                return
            except PairFailed as e:
                failed_at = time.monotonic()
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
                    await self._wait_out_outage(request_id, "decode", excluded, failed_at, e, deadline)
                    continue
                attempts += 1
                excluded.add(e.avoid)
                await self._wait_out_outage(request_id, "prefill" if e.avoid == prefill.address else "decode",
                                            excluded, failed_at, e, deadline)
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

    async def _wait_out_outage(self, request_id: str, role: str, excluded: set[str], failed_at: float,
                               failed: PairFailed, deadline: Deadline) -> None:
        """After `failed` (at `failed_at`) on a worker of `role`: when that worker was gone and no other worker of
        the role is healthy, wait (bounded) for one to answer again and let the next pick have it (`excluded` no
        longer holds it). Without one in time the next pick goes on as before (the same worker, or none)."""
        if not failed.gone or self.max_role_outage_wait_s <= 0:
            return
        if any(w.address not in excluded for w in self.registry.healthy(role)):
            return  # another worker of the role is there: retry or migrate to it now
        within_s = min(self.max_role_outage_wait_s, deadline.remaining())
        logger.warning("request %s: no %s worker left to take it (%s); waiting up to %.1f s for one to answer",
                       request_id, role, failed.failure, within_s)
        if self.metrics is not None:
            self.metrics.role_outage_waits.inc()
        back = await self.registry.wait_answering(role, failed_at, within_s)
        if back is not None:
            excluded.discard(back.address)

    def _name(self, address: str) -> str:
        """A worker's name (what spans and metrics call it, never its address)."""
        w = self.registry.workers.get(address)
        return w.name if w is not None else ""

    def _untried_pair(self, excluded: set[str]) -> bool:
        return all(any(w.address not in excluded for w in self.registry.healthy(role)) for role in ROLES)

    def _pick(self, prompt_ids: list[int], excluded: set[str]) -> tuple[WorkerInfo, WorkerInfo]:
        """A pair by the policies, among the prefill workers that can transfer into some decode worker and then the
        decode workers that one can transfer into (their reported compatibility: during a rollout across schema
        versions, old pairs with old and new with new; a worker that reported none pairs with any)."""
        prefills = [w for w in self.registry.healthy("prefill") if w.address not in excluded]
        decodes = [w for w in self.registry.healthy("decode") if w.address not in excluded]
        prefills = prefills or self.registry.healthy("prefill")  # after exclusions, fall back to any healthy one
        decodes = decodes or self.registry.healthy("decode")
        if not prefills or not decodes:
            raise RequestFailed(ErrorCode.UNAVAILABLE, "no healthy prefill and decode worker pair is registered")
        pairable = [p for p in prefills if any(pairs(p, d) for d in decodes)]
        if not pairable:
            p, d = prefills[0], decodes[0]
            assert p.compat is not None and d.compat is not None  # (unknown compatibility always pairs)
            raise RequestFailed(ErrorCode.INCOMPATIBLE, "no healthy prefill worker can transfer into a healthy decode "
                                f"worker (e.g. {p.name} -> {d.name}: {', '.join(p.compat.mismatches(d.compat))} "
                                "differ)")
        prefill = self.prefill_policy.select(pairable, prompt_ids)
        decode = self.decode_policy.select([d for d in decodes if pairs(prefill, d)], prompt_ids)
        if self.metrics is not None:
            self.metrics.count_selected("prefill", prefill.name)
            self.metrics.count_selected("decode", decode.name)
        return prefill, decode

    def _forget(self, request_id: str, attempt: PairAttempt) -> None:
        """The attempt's stream is over: nothing is left for `abort` or a worker's failure to end."""
        if self.active.get(request_id) is attempt:
            del self.active[request_id]

    def _worker_down(self, worker: WorkerInfo) -> None:
        """The registry marked `worker` down: end the attempts that still need it."""
        failure = RequestFailed(ErrorCode.UNAVAILABLE, f"{worker.role} worker {worker.address} stopped answering "
                                                       "health checks")
        for attempt in list(self.active.values()):
            attempt.worker_down(worker, failure)

    def _worker_closing(self, worker: WorkerInfo) -> None:
        """The registry is about to close its channel to `worker` (removed, or retired and drained): end the attempts
        that still need it, as for a worker marked down."""
        failure = RequestFailed(ErrorCode.UNAVAILABLE, f"{worker.role} worker {worker.address} was removed from the "
                                                       "router")
        for attempt in list(self.active.values()):
            attempt.worker_closing(worker, failure)

    def abort(self, request_id: str) -> bool:
        """End the running attempt of the request `request_id` (the router's id) with `ABORTED`; the attempt
        cancels both legs on its way out. False when no attempt is running."""
        attempt = self.active.get(request_id)
        if attempt is None:
            return False
        attempt.end(PairFailed(RequestFailed(ErrorCode.ABORTED, "aborted by its caller"), ""))
        return True


def pairs(prefill: WorkerInfo, decode: WorkerInfo) -> bool:
    """Whether `prefill` can transfer into `decode`, by what they reported (unknown: yes, the plan's check decides)."""
    return prefill.compat is None or decode.compat is None or not prefill.compat.mismatches(decode.compat)
