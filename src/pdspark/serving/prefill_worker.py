"""`PrefillWorker`: computes prompts and pushes their DSV4 cache into decode workers' memory.

A transfer is a rendezvous keyed by `transfer_id` between two calls that may arrive in either order:
`prefill(request)` (from the router) and `submit_plan(plan)` (from the decode worker). Once both are there, and
the plan passed the checks (compatibility descriptors, then `validate_plan`), the prompt is prefilled (its pages
held after the first token is sampled), a transfer thread writes every payload, and both calls return the result.
The rendezvous has one deadline, the earlier of its legs'; when it passes before the writes start, both calls fail
with DEADLINE. Whatever ends a rendezvous (success, deadline, abort, a caller gone, a refused plan), its held pages
are released exactly once, when it ends. A caller that vanished without closing its socket (a stopped process, a
lost network path) is gone once its lease lapses: gRPC keepalive breaks the connection and cancels its call
(`rpc/keepalive.py`).

NOTE: a prompt is prefilled once its plan is here, i.e. once the decode worker has reserved room for its cache,
with one exception (below). Prefilling every prompt on arrival would overlap the two, but a prefilled prompt holds
its pages and request slot until its plan comes; under a flood, the slots fill with prompts whose decode workers
are busy, while the requests those decode workers did reserve for wait here for a slot: both sides wait until
the deadlines (seen with 200 concurrent requests on 16 slots). Waiting for the plan makes the prefill side follow
the decode side's order. The exception: while the engine has nothing queued, at most `early_prefills` prompts (1
by default) start on arrival, before their plans: the plan (the decode worker's reservation, then a call here,
~2-3 ms on loopback) then arrives while the prompt is computed instead of before it. Such a prompt holds at most
that many slots and their pages until its plan comes or its deadline passes; every other request follows its
plan as before, so a flood cannot deadlock on them. A plan refused on arrival (an incompatible pair) then ends a
prompt that may already have been computed.

A rendezvous moves through one `Phase` at a time (`_Rendezvous.enter` checks each move): WAITING for its legs,
QUEUED in the engine, PREFILLED (first token sampled, pages held), TRANSFERRING (asking for the pages), WRITING
(the writes run; a failure arriving now is reported when they stop), ENDED.

Threads: the rendezvous state lives on the asyncio loop (one thread, no locks); calls await its future; the engine
thread reports the first token through `call_soon_threadsafe`; the writes and the source checksum run on the
`TransferWriter`'s threads, never on the engine or asyncio thread.

NOTE: writes into the decode worker's memory never start after the deadline (the backend checks before each
batch), and a failure that arrives while they run (an abort, the decode side gone) is reported once they stop:
only then are the pages they read released, and only then does the decode side hear that nothing more will land.
The decode side gives up at its own deadline regardless, so it asks in its plan for the last write to start a
margin before that (`TransferPlan.timeout_s`). Writes still running once the transfer backend's grace after the
deadline passed are stuck (the transfer engine's first contact with a peer waits without a timeout for one that
stopped): the rendezvous ends without them and releases its pages, and says `Unanswered` (they may still land).
Their transfer threads stay blocked until the peer answers (`TransferWriter.stuck`); while that holds every thread,
the worker is not `serving`: a new prefill, and a transfer about to write, fail at once with UNAVAILABLE (the router
retries them on another prefill worker) instead of queueing behind the stuck writes until their deadlines, and the
worker server answers NOT_SERVING on the health service, so that the router stops sending it requests.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass, field, replace

from pdspark.deadline import Deadline
from pdspark.errors import ErrorCode, RequestFailed, Unanswered
from pdspark.rpc import tracing
from pdspark.serving.engine_client import EngineClient
from pdspark.serving.engine_loop import EngineLoop
from pdspark.serving.prefill_metrics import PrefillMetrics
from pdspark.serving.transfer_writer import TRANSFER_THREADS, TransferWriter, Written
from pdspark.transfer.base import TransferBackend
from pdspark.transfer.compat import CompatDescriptor
from pdspark.transfer.plan import TransferPlan, TransferResult, TransferStats
from pdspark.transfer.plan_validation import validate_plan
from pdspark.transfer.transfer_plan import cache_buffers
from pdspark.types import FinishReason, RequestOutput, SamplingParams

logger = logging.getLogger(__name__)
# How long after the deadline a call still waits for writes that started before it (they end within the transfer
# engine's own timeout); the rendezvous itself ends, and its pages are released, whenever they do.
WRITE_GRACE_S = 30.0
# A failed transfer id is remembered this long past its deadline, so that a leg arriving late (stuck in a queue,
# or sent to a process that was stopped) fails at once instead of prefilling a prompt nobody will collect.
_REMEMBER_S = 60.0
_MAX_REMEMBERED = 16384
EARLY_PREFILLS = 1  # prompts that may start before their plans (see the NOTE)


class Phase(enum.Enum):
    WAITING = "waiting"  # for a leg, or for the engine to take the prompt (not queued in the engine)
    QUEUED = "queued"  # in the engine (early: before its plan): released when the rendezvous ends
    PREFILLED = "prefilled"  # the first token sampled, the pages held; early: waiting for the plan
    TRANSFERRING = "transferring"  # the transfer task runs (no batch of writes starts after the deadline)
    WRITING = "writing"  # the writes run on the writer's threads: a failure waits until they stop
    ENDED = "ended"  # both legs answered, the pages released

    @property
    def in_engine(self) -> bool:
        """The engine holds the request (queued, or its pages): it is released when the rendezvous ends."""
        return self in (Phase.QUEUED, Phase.PREFILLED, Phase.TRANSFERRING, Phase.WRITING)


# The moves a rendezvous makes (any phase but ENDED may end). QUEUED -> WAITING: the engine refused the prompt
# (ALREADY_EXISTS: it holds another request under this id, not ours to release). WRITING -> TRANSFERRING: the
# writes stopped.
_MOVES = {
    Phase.WAITING: {Phase.QUEUED, Phase.ENDED},
    Phase.QUEUED: {Phase.WAITING, Phase.PREFILLED, Phase.ENDED},
    Phase.PREFILLED: {Phase.TRANSFERRING, Phase.ENDED},
    Phase.TRANSFERRING: {Phase.WRITING, Phase.ENDED},
    Phase.WRITING: {Phase.TRANSFERRING},
    Phase.ENDED: set(),
}


@dataclass(eq=False)
class _Rendezvous:
    transfer_id: str
    deadline: Deadline
    done: asyncio.Future  # -> TransferResult, or RequestFailed; both legs await it
    created: float = field(default_factory=time.monotonic)
    request_id: str | None = None
    prompt_ids: list[int] = field(default_factory=list)
    params: SamplingParams | None = None  # the prefill's: one token
    phase: Phase = Phase.WAITING
    plan: TransferPlan | None = None
    plan_at: float | None = None
    early: bool = False  # queued in the engine before its plan arrived (counted in `PrefillWorker._early`)
    first: RequestOutput | None = None
    prefill_s: float = 0.0
    pending_failure: RequestFailed | None = None  # a failure that arrived while writing
    timer: asyncio.TimerHandle | None = None
    trace: tracing.Span = tracing.NO_SPAN  # the prefill call's span: the transfer's is its child

    def enter(self, phase: Phase) -> None:
        """The one transition function: a move `_MOVES` does not list is a bug here, not a request's fault."""
        assert phase in _MOVES[self.phase], f"transfer {self.transfer_id!r}: {self.phase.value} -> {phase.value}"
        self.phase = phase


class PrefillWorker:
    def __init__(self, loop: EngineLoop, backend: TransferBackend, compat: CompatDescriptor,
                 metrics: PrefillMetrics | None = None, max_pending: int = 1024, executor: Executor | None = None,
                 early_prefills: int = EARLY_PREFILLS, transfer_threads: int = TRANSFER_THREADS):
        """`early_prefills`: how many prompts may start before their plans while the engine has nothing queued
        (see the NOTE; 0: every prompt waits for its plan). `executor`: the transfer threads, `transfer_threads` of
        them (made by the writer when None)."""
        self.engine = EngineClient(loop)
        self.early_prefills = early_prefills
        self._early = 0  # rendezvous queued in the engine whose plans have not arrived
        self.backend = backend
        self.compat = compat
        self.metrics = metrics
        self.max_pending = max_pending
        self.buffers = cache_buffers(loop.engine.kv.pools)  # fixed at start: the pools never move
        self.writer = TransferWriter(backend, self.buffers, executor, transfer_threads)
        self.writer.on_stuck.append(self._stuck_changed)
        self._serving = True
        self.on_serving: list[Callable[[], None]] = []  # told (asyncio thread) when `serving` changes
        self._pending: dict[str, _Rendezvous] = {}  # by transfer id
        self._by_request: dict[str, _Rendezvous] = {}
        self._failed: dict[str, tuple[RequestFailed, float]] = {}  # transfer id -> (failure, remembered until)
        self._tasks: set[asyncio.Task] = set()

    # ---- the two legs ------------------------------------------------------------------------------------------------
    async def prefill(self, request_id: str, transfer_id: str, prompt_ids: list[int], params: SamplingParams,
                      deadline: Deadline, trace: tracing.Span = tracing.NO_SPAN, num_generated: int = 0
                      ) -> TransferResult:
        """Prefill the prompt once its plan is here and wait (until `deadline`) for the transfer; raises
        `RequestFailed`: OVERLOADED at once when `max_pending` transfers are in flight, UNAVAILABLE at once while
        the worker is not `serving`, ALREADY_EXISTS for a request id or transfer id in flight here. `trace`: the
        call's span, the parent of the transfer's. `num_generated`: the prompt's last tokens that a migrated
        stream generated before (its sampling controls count them as output)."""
        if request_id in self._by_request:
            raise RequestFailed(ErrorCode.ALREADY_EXISTS, f"request id {request_id!r} is already being prefilled")
        rv = self._join(transfer_id, deadline)
        if rv.request_id is not None:
            raise RequestFailed(ErrorCode.ALREADY_EXISTS, f"transfer_id {transfer_id!r} is already being prefilled")
        if not self._serving:  # ended at once: its plan, here or to come, fails with it
            failure = self._stuck_failure(transfer_id)
            self._fail(rv, failure)
            raise failure
        rv.request_id, rv.prompt_ids, rv.trace = request_id, prompt_ids, trace
        # One token, never stopped by text; `min_tokens` still holds back EOS and the stop ids for it.
        rv.params = replace(params, max_tokens=1, stop=(), min_tokens=min(params.min_tokens, 1),
                            stop_token_ids=params.stop_token_ids if params.min_tokens else (),
                            prompt_output_tokens=num_generated)
        self._by_request[request_id] = rv
        self._maybe_submit(rv)
        return await self._wait(rv)

    async def submit_plan(self, plan: TransferPlan, deadline: Deadline) -> TransferResult:
        """Accept a decode worker's plan; returns once the cache is in its memory; raises `RequestFailed`
        (INCOMPATIBLE / INVALID_REQUEST for a plan we must not write, naming the field)."""
        rv = self._join(plan.transfer_id, deadline)
        if rv.plan is not None:
            raise RequestFailed(ErrorCode.ALREADY_EXISTS, f"a plan for transfer {plan.transfer_id!r} already arrived")
        try:
            mismatched = self.compat.mismatches(plan.compat)
            if mismatched:
                raise RequestFailed(ErrorCode.INCOMPATIBLE, f"prefill and decode workers differ in "
                                                            f"{', '.join(mismatched)}; refusing to transfer")
            validate_plan(plan, self.buffers)
            if rv.phase.in_engine:  # started early: the prompt it checks against is here
                _check_prompt_len(plan, rv.prompt_ids)
        except RequestFailed as e:
            self._fail(rv, e)
        else:
            rv.plan, rv.plan_at = plan, time.monotonic()
            self._planned(rv)
            if rv.phase is Phase.PREFILLED:  # prefilled early, waiting for this plan
                self._start_transfer(rv)
            else:
                self._maybe_submit(rv)
        return await self._wait(rv)

    def refuse_plan(self, transfer_id: str, failure: RequestFailed, deadline: Deadline) -> None:
        """A plan that could not even be read (a payload kind we do not know): fail its transfer now, so that the
        prefill leg does not wait for a plan until its deadline."""
        rv = self._pending.get(transfer_id)
        if rv is None:
            self._remember(transfer_id, failure, deadline)
        elif rv.plan is None:  # else a second plan for a transfer that has one: only its sender hears of it
            self._fail(rv, failure)

    def abort(self, request_id: str) -> bool:
        """Fail the request's transfer (ABORTED) now; False when it is not in flight here. The router aborts its
        prefill leg; a decode worker that gives up on a request aborts its plan (the prefill leg may not be here
        yet), and waits for its `SubmitPlan` call to answer, i.e. for the writes to stop."""
        rv = self._by_request.get(request_id) or next(
            (rv for rv in self._pending.values() if rv.plan is not None and rv.plan.request_id == request_id), None)
        if rv is None:
            return False
        self._fail(rv, RequestFailed(ErrorCode.ABORTED, f"request {request_id!r} aborted"))
        return True

    @property
    def in_flight(self) -> int:
        return len(self._pending)

    @property
    def stuck_transfers(self) -> int:
        """Writes given up on whose transfer thread is still blocked (see the NOTE)."""
        return self.writer.stuck

    @property
    def serving(self) -> bool:
        """False while stuck writes hold every transfer thread: prefills are refused (see the NOTE)."""
        return self._serving

    def close(self) -> None:
        self.writer.close()

    # ---- the rendezvous ----------------------------------------------------------------------------------------------
    def _join(self, transfer_id: str, deadline: Deadline) -> _Rendezvous:
        """The rendezvous of `transfer_id`, made by the first leg; raises the failure of one that already ended,
        or OVERLOADED when a new one would exceed `max_pending`."""
        failed = self._failed.get(transfer_id)
        if failed is not None and failed[1] > time.monotonic():
            raise failed[0]
        rv = self._pending.get(transfer_id)
        if rv is None:
            if len(self._pending) >= self.max_pending:
                failure = RequestFailed(ErrorCode.OVERLOADED, f"{len(self._pending)} transfers in flight, the most "
                                                              "this prefill worker takes (max_pending_prefills)")
                self._remember(transfer_id, failure, deadline)  # the other leg is refused at once too
                if self.metrics is not None:
                    self.metrics.refused.inc()
                raise failure
            rv = _Rendezvous(transfer_id, deadline, asyncio.get_running_loop().create_future())
            rv.done.add_done_callback(_consume)
            self._pending[transfer_id] = rv
            self._arm(rv)
        elif deadline.at < rv.deadline.at:
            rv.deadline = deadline
            self._arm(rv)
        return rv

    def _arm(self, rv: _Rendezvous) -> None:
        """(Re)start the rendezvous's deadline timer (asyncio's clock is `time.monotonic()`)."""
        if rv.timer is not None:
            rv.timer.cancel()
        rv.timer = asyncio.get_running_loop().call_at(rv.deadline.at, self._expire, rv)

    def _expire(self, rv: _Rendezvous) -> None:
        # Once the transfer started, it fails on its own: no batch of writes starts after the deadline.
        if rv.phase in (Phase.WAITING, Phase.QUEUED, Phase.PREFILLED):
            self._fail(rv, RequestFailed(ErrorCode.DEADLINE, _deadline_message(rv)))

    def _maybe_submit(self, rv: _Rendezvous) -> None:
        """Queue the prompt in the engine once both legs are here, or on the prefill leg's arrival when it may
        start early (see the NOTE above)."""
        if rv.phase is not Phase.WAITING or rv.request_id is None:
            return
        if rv.plan is None:
            if self._early >= self.early_prefills or self.engine.load().waiting:
                return
            rv.early = True
            self._early += 1
        else:
            try:
                _check_prompt_len(rv.plan, rv.prompt_ids)
            except RequestFailed as e:
                self._fail(rv, e)
                return
        rv.enter(Phase.QUEUED)
        self._spawn(self._submit(rv))

    def _planned(self, rv: _Rendezvous) -> None:
        """An early rendezvous got its plan or ended: it no longer counts against `early_prefills`."""
        if rv.early:
            rv.early = False
            self._early -= 1

    async def _submit(self, rv: _Rendezvous) -> None:
        assert rv.request_id is not None and rv.params is not None
        if rv.phase is Phase.ENDED:
            return  # ended before this task ran; its release was queued first and finds nothing
        loop = asyncio.get_running_loop()
        t0 = time.monotonic()

        def listener(out: RequestOutput) -> None:  # engine thread
            if out.finished:
                loop.call_soon_threadsafe(self._prefilled, rv, out, time.monotonic() - t0)

        try:
            await self.engine.submit(rv.request_id, rv.prompt_ids, rv.params, listener, hold_pages=True)
        except RequestFailed as e:
            # ALREADY_EXISTS: the engine holds another request under this id, not ours to release (`prefill`
            # refuses ids in flight here, and FIFO order runs an ended one's release first: kept for safety).
            if e.code is ErrorCode.ALREADY_EXISTS and rv.phase is Phase.QUEUED:
                rv.enter(Phase.WAITING)
            self._fail(rv, e)

    def _prefilled(self, rv: _Rendezvous, out: RequestOutput, seconds: float) -> None:
        """The prompt is computed and the first token sampled (pages held), as the engine thread reported."""
        if rv.phase is Phase.ENDED:
            return  # ended meanwhile: the release queued when it ended frees the pages
        if out.finish_reason == FinishReason.ABORT:
            reason = f": {out.stop_reason}" if out.stop_reason else ""
            self._fail(rv, RequestFailed(ErrorCode.ABORTED, f"prefill aborted{reason}"))
            return
        rv.first, rv.prefill_s = out, seconds
        rv.enter(Phase.PREFILLED)
        if self.metrics is not None:
            self.metrics.observe_prefill(len(rv.prompt_ids), out.num_cached_tokens, seconds)
        if rv.plan is not None:  # else it started early: the plan's arrival starts the transfer
            self._start_transfer(rv)

    def _start_transfer(self, rv: _Rendezvous) -> None:
        rv.enter(Phase.TRANSFERRING)
        self._spawn(self._transfer(rv))

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)  # a reference, so that the task is not collected while it runs
        task.add_done_callback(self._tasks.discard)

    async def _transfer(self, rv: _Rendezvous) -> None:
        """Read the held pages and write them into the decode worker's memory (on the transfer executor); end the
        rendezvous when the writes stop, with whatever failure arrived meanwhile."""
        assert rv.plan is not None and rv.first is not None and rv.request_id is not None
        failure: RequestFailed | None = None
        span = tracing.start("transfer", rv.trace, {"pdspark.transfer_id": rv.transfer_id,
                                                    "pdspark.transfer.destination_rank": rv.plan.destination_rank})
        try:
            if rv.deadline.expired:
                raise RequestFailed(ErrorCode.DEADLINE, f"transfer {rv.transfer_id!r}: the deadline passed before "
                                                        "the first write")
            if not self._serving:  # its writes would wait for a thread until their deadline: nothing written yet
                raise self._stuck_failure(rv.transfer_id)
            pages = await self.engine.held_pages(rv.request_id)
            if rv.phase is Phase.ENDED:
                tracing.finish(span, "aborted")
                return  # failed while we asked (an abort): nothing was written, the failure released the pages
            rv.enter(Phase.WRITING)
            t0 = time.monotonic()
            written: Written = await self.writer.write(rv.transfer_id, rv.plan, pages, rv.deadline.at)
            seconds = time.monotonic() - t0
        except RequestFailed as e:
            failure = e
        except Exception as e:  # TransferError, or anything unexpected while reading or writing
            logger.warning("transfer %s (rank 0 -> the decode group's rank %d) failed: %s", rv.transfer_id,
                           rv.plan.destination_rank, e)
            failure = RequestFailed(ErrorCode.TRANSFER, f"transfer {rv.transfer_id!r}: {e}")
        finally:
            if rv.phase is Phase.WRITING:
                rv.enter(Phase.TRANSFERRING)
        failure = failure or rv.pending_failure
        if failure is not None:
            tracing.finish(span, failure.code.value)
            self._end(rv, failure)
            return
        writes = written.writes
        stats = TransferStats(
            bytes=writes.nbytes, num_writes=len(writes.writes), transfer_s=seconds, prefill_s=rv.prefill_s,
            plan_wait_s=max(0.0, (rv.plan_at or rv.created) - rv.created), bytes_by_pool=writes.bytes_by_pool,
            write_s=written.write_s, destination_rank=rv.plan.destination_rank,
        )
        first = rv.first
        if self.metrics is not None:
            self.metrics.observe_transfer(stats, writes.writes_by_pool)
        tracing.finish(span, None, {"pdspark.transfer.bytes": stats.bytes, "pdspark.transfer.writes": stats.num_writes,
                                    "pdspark.transfer.seconds": seconds})
        self._end(rv, TransferResult(
            transfer_id=rv.transfer_id, first_token=first.token_ids[0], num_cached_tokens=first.num_cached_tokens,
            checksum=written.checksum, stats=stats, first_logprob=first.logprobs[0] if first.logprobs else None,
            prompt_logprobs=tuple(lp for lp in first.prompt_logprobs or () if lp is not None),
        ))

    def _fail(self, rv: _Rendezvous, error: RequestFailed) -> None:
        if rv.phase is Phase.ENDED:
            return
        if rv.phase is Phase.WRITING:
            rv.pending_failure = rv.pending_failure or error  # reported once the writes stop
            return
        self._end(rv, error)

    def _end(self, rv: _Rendezvous, outcome: TransferResult | RequestFailed) -> None:
        """The one place a rendezvous ends: both legs answered, its pages released (once), its id forgotten."""
        in_engine = rv.phase.in_engine
        rv.enter(Phase.ENDED)
        if rv.timer is not None:
            rv.timer.cancel()
        self._planned(rv)
        self._pending.pop(rv.transfer_id, None)
        if rv.request_id is not None and self._by_request.get(rv.request_id) is rv:
            del self._by_request[rv.request_id]
        if isinstance(outcome, RequestFailed):
            self._remember(rv.transfer_id, outcome, rv.deadline)
            if self.metrics is not None:
                self.metrics.transfer_failures.labels(reason=outcome.code.value).inc()
            rv.done.set_exception(outcome)
        else:
            rv.done.set_result(outcome)
        if in_engine:
            assert rv.request_id is not None
            self.engine.release(rv.request_id)  # stops the request, or frees the pages it holds

    async def _wait(self, rv: _Rendezvous) -> TransferResult:
        try:
            # Shielded: the rendezvous is shared by both legs; one caller going away must not cancel it.
            return await asyncio.wait_for(asyncio.shield(rv.done), rv.deadline.remaining() + WRITE_GRACE_S)
        except TimeoutError:  # no answer of ours: the writes may still land
            raise Unanswered(ErrorCode.TRANSFER, f"transfer {rv.transfer_id!r}: writes still running "
                                                 f"{WRITE_GRACE_S:.0f}s after the deadline") from None
        except asyncio.CancelledError:
            self._fail(rv, RequestFailed(ErrorCode.ABORTED, f"transfer {rv.transfer_id!r}: a caller went away"))
            raise

    def _stuck_changed(self) -> None:
        """A write became stuck, or a stuck one's thread is free again (asyncio thread)."""
        serving = not self.writer.all_stuck
        if serving == self._serving:
            return
        self._serving = serving
        if serving:
            logger.warning("a transfer thread is free again (%d of %d still stuck): taking prefills again",
                           self.writer.stuck, self.writer.threads)
        else:
            logger.warning("all %d transfer threads are stuck writing to peers that do not answer: refusing "
                           "prefills (UNAVAILABLE) and answering NOT_SERVING until one is free", self.writer.threads)
        for listener in self.on_serving:
            listener()

    def _stuck_failure(self, transfer_id: str) -> RequestFailed:
        return RequestFailed(ErrorCode.UNAVAILABLE, f"transfer {transfer_id!r}: all {self.writer.threads} transfer "
                                                    "threads of this prefill worker are stuck writing to peers that "
                                                    "do not answer; retry on another prefill worker")

    def _remember(self, transfer_id: str, failure: RequestFailed, deadline: Deadline) -> None:
        now = time.monotonic()
        self._failed[transfer_id] = (failure, max(deadline.at, now) + _REMEMBER_S)
        if len(self._failed) > _MAX_REMEMBERED:
            self._failed = {k: v for k, v in self._failed.items() if v[1] > now}
            while len(self._failed) > _MAX_REMEMBERED:  # still too many: forget the oldest
                del self._failed[next(iter(self._failed))]


def _check_prompt_len(plan: TransferPlan, prompt_ids: list[int]) -> None:
    if plan.prompt_len != len(prompt_ids):
        raise RequestFailed(ErrorCode.INVALID_REQUEST, f"TransferPlan.prompt_len: {plan.prompt_len} tokens; the "
                                                       f"prompt has {len(prompt_ids)}")


def _deadline_message(rv: _Rendezvous) -> str:
    if rv.plan is None:
        return f"transfer {rv.transfer_id!r}: the decode worker's transfer plan did not arrive before the deadline"
    if rv.request_id is None:
        return f"transfer {rv.transfer_id!r}: the prefill request did not arrive before the deadline"
    return f"transfer {rv.transfer_id!r}: the prompt was not prefilled before the deadline"


def _consume(fut: asyncio.Future) -> None:
    """Mark a future's outcome as read (a rendezvous's, when a leg went away)."""
    if not fut.cancelled():
        fut.exception()
