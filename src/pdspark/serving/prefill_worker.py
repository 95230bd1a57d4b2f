"""`PrefillWorker`: computes prompts and pushes their DSV4 cache into decode workers' memory.

A transfer is a rendezvous keyed by `transfer_id` between two calls that may arrive in either order:
`prefill(request)` (from the router) and `submit_plan(plan)` (from the decode worker). The prompt is prefilled as
soon as the request arrives (its pages held after the first token is sampled); once the plan is there too, and
the compatibility descriptors match, the engine thread writes every payload and both calls return the result.
Every wait ends by the request's deadline; on any failure the held pages are released (into the prefix cache).

NOTE: once writes into the decode worker's memory have started they always run to the end before either call
returns (an abort or deadline meanwhile turns into an error afterwards), so the decode side never frees pages that
are still being written. A transfer is never started after the deadline.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field, replace

from pdspark.errors import ErrorCode, PdsparkError, RequestFailed, as_request_failed
from pdspark.serving.engine_client import EngineClient
from pdspark.serving.engine_loop import EngineLoop
from pdspark.serving.metrics import WorkerMetrics
from pdspark.transfer.base import TransferBackend
from pdspark.transfer.compat import CompatDescriptor
from pdspark.transfer.plan import TransferPlan, TransferResult, TransferStats
from pdspark.transfer.transfer_plan import cache_buffers, plan_writes
from pdspark.types import FinishReason, RequestOutput, SamplingParams

logger = logging.getLogger(__name__)
# How long a transfer that started before its deadline may still take (the decode side waits this much longer).
WRITE_GRACE_S = 30.0


@dataclass
class _Rendezvous:
    transfer_id: str
    deadline: float
    created: float = field(default_factory=time.monotonic)
    request_id: str | None = None
    plan: TransferPlan | None = None
    plan_at: float | None = None
    first: RequestOutput | None = None
    prefill_s: float = 0.0
    started: bool = False
    finished_writing: bool = False
    pending_failure: RequestFailed | None = None  # a failure that arrived while the writes were in flight
    result: TransferResult | None = None
    error: RequestFailed | None = None
    done: threading.Event = field(default_factory=threading.Event)


class PrefillWorker:
    def __init__(self, loop: EngineLoop, backend: TransferBackend, compat: CompatDescriptor,
                 metrics: WorkerMetrics | None = None):
        self.loop = loop
        self.engine = EngineClient(loop)
        self.backend = backend
        self.compat = compat
        self.metrics = metrics
        self.buffers = cache_buffers(loop.engine.kv.pools)  # fixed at start: the pools never move
        self._lock = threading.Lock()
        self._pending: dict[str, _Rendezvous] = {}
        # Failed transfer ids, remembered until their deadline: a leg arriving after the failure fails at once.
        self._failed: dict[str, tuple[RequestFailed, float]] = {}
        loop.add_ticker(self._expire)

    # ---- the two legs ------------------------------------------------------------------------------------------------
    def prefill(self, request_id: str, transfer_id: str, prompt_ids: list[int], params: SamplingParams,
                deadline: float) -> TransferResult:
        """Prefill the prompt and wait (until `deadline`, unix seconds) for the transfer; raises `RequestFailed`."""
        rv = self._rendezvous(transfer_id, deadline)
        with self._lock:
            if rv.request_id is not None:
                raise RequestFailed(ErrorCode.INVALID_REQUEST,
                                    f"transfer_id {transfer_id!r} is already being prefilled")
            rv.request_id = request_id
        first_only = replace(params, max_tokens=1, stop=(), stop_token_ids=())
        t0 = time.monotonic()
        try:
            self.engine.submit(request_id, prompt_ids, first_only,
                               lambda out: self._prefilled(rv, out, time.monotonic() - t0), hold_pages=True)
        except PdsparkError as e:
            self._fail(rv, as_request_failed(e))
        return self._wait(rv)

    def submit_plan(self, plan: TransferPlan) -> TransferResult:
        """Accept a decode worker's plan; returns once the cache is in its memory; raises `RequestFailed`."""
        rv = self._rendezvous(plan.transfer_id, plan.deadline)
        diff = self.compat.diff(plan.compat)
        if diff:
            message = f"prefill and decode workers differ in {', '.join(diff)}; refusing to transfer"
            self._fail(rv, RequestFailed(ErrorCode.INCOMPATIBLE, message))
        else:
            with self._lock:
                rv.plan, rv.plan_at = plan, time.monotonic()
            self._maybe_start(rv)
        return self._wait(rv)

    def abort(self, request_id: str) -> bool:
        with self._lock:
            rv = next((r for r in self._pending.values() if r.request_id == request_id), None)
        if rv is None:
            return False
        self._fail(rv, RequestFailed(ErrorCode.ABORTED, f"request {request_id!r} aborted"))
        return True

    @property
    def in_flight(self) -> int:
        with self._lock:
            return len(self._pending)

    # ---- internals ---------------------------------------------------------------------------------------------------
    def _rendezvous(self, transfer_id: str, deadline: float) -> _Rendezvous:
        with self._lock:
            failed = self._failed.get(transfer_id)
            if failed is not None:
                raise failed[0]
            rv = self._pending.get(transfer_id)
            if rv is None:
                rv = self._pending[transfer_id] = _Rendezvous(transfer_id, deadline)
            rv.deadline = min(rv.deadline, deadline)
            return rv

    def _prefilled(self, rv: _Rendezvous, out: RequestOutput, seconds: float) -> None:
        """Loop thread: the prompt is computed and the first token sampled (pages held)."""
        if not out.finished:
            return
        if rv.done.is_set():  # failed while the request was being queued: nobody else frees its pages now
            self._release(rv)
            return
        if out.finish_reason == FinishReason.ABORT:
            self._fail(rv, RequestFailed(ErrorCode.ABORTED, "prefill aborted"))
            return
        with self._lock:
            rv.first, rv.prefill_s = out, seconds
        self._maybe_start(rv)

    def _maybe_start(self, rv: _Rendezvous) -> None:
        with self._lock:
            if rv.started or rv.done.is_set() or rv.plan is None or rv.first is None:
                return
            rv.started = True
        # NOTE: the writes run on the loop thread, between steps, like every other touch of the engine's pages.
        self.loop.submit(self._transfer, rv)

    def _transfer(self, rv: _Rendezvous) -> None:
        """Loop thread: write every payload into the decode worker's memory, then release the held pages."""
        assert rv.plan is not None and rv.first is not None and rv.request_id is not None
        if rv.done.is_set():  # expired or aborted while queued; the failure path released the pages
            return
        with self._lock:
            queued_failure = rv.pending_failure
            if queued_failure is not None:  # aborted after the start was queued: write nothing
                rv.finished_writing = True
        if queued_failure is not None:
            self._fail(rv, queued_failure)
            return
        if time.time() > rv.deadline:
            with self._lock:
                rv.finished_writing = True
            self._fail(rv, RequestFailed(ErrorCode.DEADLINE,
                                         f"transfer {rv.transfer_id!r}: deadline passed before writing"))
            return
        try:
            t0 = time.monotonic()
            writes = plan_writes(self.buffers, rv.plan, self.engine.held_pages(rv.request_id), _read_memory)
            self.backend.write(rv.plan.session, writes.writes)
            seconds = time.monotonic() - t0
        except Exception as e:  # TransferError, or pages no longer there
            logger.warning("transfer %s failed: %s", rv.transfer_id, e)
            with self._lock:
                rv.finished_writing = True
            self._fail(rv, RequestFailed(ErrorCode.TRANSFER, str(e)))
            return
        stats = TransferStats(
            bytes=writes.nbytes, num_writes=len(writes.writes), transfer_s=seconds, prefill_s=rv.prefill_s,
            plan_wait_s=max(0.0, (rv.plan_at or rv.created) - rv.created), bytes_by_pool=writes.bytes_by_pool,
        )
        first = rv.first
        result = TransferResult(
            transfer_id=rv.transfer_id, first_token=first.token_ids[0], num_cached_tokens=first.num_cached_tokens,
            checksum=writes.checksum, stats=stats, first_logprob=first.logprobs[0] if first.logprobs else None,
        )
        if self.metrics is not None:
            self.metrics.observe_transfer(stats)
        with self._lock:
            rv.finished_writing = True
            late_failure = rv.pending_failure
        if late_failure is not None:
            self._fail(rv, late_failure)
            return
        self._release(rv)
        with self._lock:
            rv.result = result
            self._pending.pop(rv.transfer_id, None)
        rv.done.set()

    def _fail(self, rv: _Rendezvous, error: RequestFailed) -> None:
        with self._lock:
            if rv.done.is_set():
                return
            if rv.started and not rv.finished_writing:
                rv.pending_failure = rv.pending_failure or error  # reported once the writes are done
                return
            rv.error = error
            self._pending.pop(rv.transfer_id, None)
            self._failed[rv.transfer_id] = (error, rv.deadline)
        if self.metrics is not None:
            self.metrics.transfer_failures.labels(reason=error.code.value).inc()
        self._release(rv)
        rv.done.set()

    def _release(self, rv: _Rendezvous) -> None:
        """Stop the request or free its held pages, whichever state it is in."""
        if rv.request_id is not None:
            self.engine.release(rv.request_id)

    def _wait(self, rv: _Rendezvous) -> TransferResult:
        if not rv.done.wait(max(0.0, rv.deadline - time.time())):
            self._fail(rv, RequestFailed(ErrorCode.DEADLINE, self._deadline_message(rv)))
            # Writes already in flight finish first (bounded by the transfer engine's own timeouts).
            if not rv.done.wait(WRITE_GRACE_S):
                raise RequestFailed(ErrorCode.TRANSFER, f"transfer {rv.transfer_id!r}: writes did not finish")
        if rv.error is not None:
            raise rv.error
        assert rv.result is not None
        return rv.result

    def _expire(self) -> None:
        """Ticker: fail rendezvous whose deadline passed (a plan that never came, a prefill that never came)."""
        now = time.time()
        with self._lock:
            late = [rv for rv in self._pending.values() if rv.deadline < now and not rv.started]
            self._failed = {k: v for k, v in self._failed.items() if v[1] > now}
        for rv in late:
            self._fail(rv, RequestFailed(ErrorCode.DEADLINE, self._deadline_message(rv)))

    @staticmethod
    def _deadline_message(rv: _Rendezvous) -> str:
        missing = "the decode worker's transfer plan" if rv.plan is None else "the prefill request"
        return f"transfer {rv.transfer_id!r}: {missing} did not arrive before the deadline"


def _read_memory(addr: int, nbytes: int) -> bytes:
    import ctypes

    return ctypes.string_at(addr, nbytes)


