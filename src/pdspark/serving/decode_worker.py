"""`DecodeWorker`: receives prompt caches from prefill workers and continues generation (DSpark when enabled).

One request: reserve destination pages (SWA only for the window tail) -> send the plan to the prefill worker,
which answers once every payload is in our memory -> check the integrity value -> join the running batch and
stream tokens. A failed or late transfer frees the reservation; nothing waits without a deadline.
"""

from __future__ import annotations

import ctypes
import queue
import time
from collections.abc import Callable, Iterator

from pdspark.errors import ErrorCode, PdsparkError, RequestFailed, as_request_failed
from pdspark.serving.engine_client import EngineClient, Reservation
from pdspark.serving.engine_loop import EngineLoop
from pdspark.serving.metrics import WorkerMetrics
from pdspark.serving.prefill_worker import WRITE_GRACE_S
from pdspark.transfer.base import TransferBackend
from pdspark.transfer.compat import CompatDescriptor
from pdspark.transfer.plan import TransferPlan, TransferResult
from pdspark.transfer.transfer_plan import cache_buffers, destination_checksum
from pdspark.types import RequestOutput, SamplingParams

# submit_plan(prefill_address, plan, timeout_s) -> TransferResult (raises RequestFailed)
PlanSender = Callable[[str, TransferPlan, float], TransferResult]
_RESERVE_RETRY_S = 0.02


class DecodeWorker:
    def __init__(self, loop: EngineLoop, backend: TransferBackend, compat: CompatDescriptor, send_plan: PlanSender,
                 metrics: WorkerMetrics | None = None):
        self.loop = loop
        self.engine = EngineClient(loop)
        self.backend = backend
        self.compat = compat
        self.send_plan = send_plan
        self.metrics = metrics
        self.buffers = cache_buffers(loop.engine.kv.pools)  # fixed at start: the pools never move
        self.transfers_in_flight = 0
        self.stall_timeout_s = 120.0

    def generate(self, request_id: str, transfer_id: str, prompt_ids: list[int], params: SamplingParams,
                 prefill_address: str, deadline: float, prompt: str | None = None) -> Iterator[RequestOutput]:
        """Yield cumulative outputs until the request finishes; raises `RequestFailed` before the first one."""
        reservation = self._reserve(prompt_ids, params, deadline)
        self.transfers_in_flight += 1
        try:
            result = self._receive(request_id, transfer_id, prompt_ids, reservation, prefill_address, deadline)
        except BaseException:
            self.engine.cancel_reservation(reservation)
            raise
        finally:
            self.transfers_in_flight -= 1
        outputs: queue.Queue[RequestOutput] = queue.Queue()
        out = self.engine.adopt(request_id, prompt_ids, params, reservation, result, outputs.put, prompt)
        try:
            yield out
            while not out.finished:
                try:
                    out = outputs.get(timeout=self.stall_timeout_s)
                except queue.Empty:
                    raise RequestFailed(ErrorCode.UNAVAILABLE, f"no token for {self.stall_timeout_s:.0f}s") from None
                yield out
        finally:
            # Normal end, client gone or stalled: make sure the engine lets go of the request.
            self.engine.release(request_id)

    def abort(self, request_id: str) -> bool:
        return self.engine.abort(request_id)

    def _reserve(self, prompt_ids: list[int], params: SamplingParams, deadline: float) -> Reservation:
        """Destination pages, waiting (until the deadline) while the pools are full."""
        while True:
            try:
                reservation = self.engine.reserve(prompt_ids, params)
            except PdsparkError as e:
                raise as_request_failed(e) from e
            if reservation is not None:
                return reservation
            if time.time() + _RESERVE_RETRY_S > deadline:
                raise RequestFailed(ErrorCode.UNAVAILABLE, "no free pages for the prompt's cache before the deadline")
            time.sleep(_RESERVE_RETRY_S)

    def _receive(self, request_id: str, transfer_id: str, prompt_ids: list[int], reservation: Reservation,
                 prefill_address: str, deadline: float) -> TransferResult:
        plan = TransferPlan(
            transfer_id=transfer_id,
            request_id=request_id,
            session=self.backend.session_id,
            compat=self.compat,
            buffers=tuple(self.buffers),
            deadline=deadline,
            **reservation.plan_fields,
        )
        # The prefill side starts writing only before the deadline, and finishes what it started.
        result = self.send_plan(prefill_address, plan, max(0.0, deadline - time.time()) + WRITE_GRACE_S)
        arrived = destination_checksum(self.buffers, plan, ctypes.string_at)
        if arrived != result.checksum:
            if self.metrics is not None:
                self.metrics.transfer_failures.labels(reason="checksum").inc()
            raise RequestFailed(ErrorCode.TRANSFER, f"transfer {transfer_id!r}: integrity check failed")
        if self.metrics is not None:
            self.metrics.observe_transfer(result.stats)
        return result
