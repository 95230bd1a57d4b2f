"""`EngineClient`: the operations the workers perform on their engine, by name.

Each method runs on the engine-loop thread (between steps, in arrival order) and waits for it at most `timeout_s`
seconds, then raises `TimeoutError`; called from the loop thread itself (a listener or ticker) it runs at once.
An operation and the listener it registers happen in one command, so no output can be missed in between.

Prefill role: `submit(..., hold_pages=True)` -> the listener sees the first token -> `held_pages` (the transfer
reads them) -> `release`.
Decode role: `reserve` -> (transfer) -> `adopt` (joins the running batch; the listener streams tokens) ->
`release`; or `cancel_reservation` when the transfer failed.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pdspark.serving.engine_loop import EngineLoop, Listener, LoopStopped
from pdspark.transfer.plan import TransferResult
from pdspark.transfer.transfer_plan import destination
from pdspark.types import RequestOutput, SamplingParams

if TYPE_CHECKING:
    from pdspark.cache.kv_cache import ReqPages

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineLoad:
    """A snapshot of the engine's queues and pools (for `GetLoad` and the router's policies)."""

    running: int
    waiting: int
    pages_used: dict[str, int]
    pages_total: dict[str, int]
    pages_cached: dict[str, int]  # of pages_used, those held only by the prefix cache


@dataclass(frozen=True)
class Reservation:
    """Destination pages held for a prompt computed elsewhere, and the plan fields that tell the prefill side
    where to write (`TransferPlan`'s prompt_len, full_pages, swa_pages, swa_first_page, c128_pages, req_slot)."""

    pages: ReqPages
    plan_fields: dict


class EngineClient:
    def __init__(self, loop: EngineLoop, timeout_s: float = 30.0):
        self.loop = loop
        self.timeout_s = timeout_s
        self._engine = loop.engine

    # ---- both roles --------------------------------------------------------------------------------------------------
    def submit(self, request_id: str, prompt_ids: list[int], params: SamplingParams, listener: Listener,
               hold_pages: bool = False) -> None:
        """Queue a request and deliver its outputs to `listener` (on the loop thread). `hold_pages`: keep its
        pages after it finishes, until `release`. Raises `InvalidRequestError` / `CapacityError`."""
        self.loop.call(self._submit, request_id, prompt_ids, params, listener, hold_pages, timeout=self.timeout_s)

    def abort(self, request_id: str) -> bool:
        """Stop a request (its listener gets the aborted output); False if it is unknown or already finished."""
        return bool(self.loop.call(self._engine.abort, request_id, timeout=self.timeout_s))

    def release(self, request_id: str) -> bool:
        """Let go of everything the engine keeps for a request: stop it if it still runs, free the pages it holds
        for a transfer, forget it and its listener. False when the request was unknown (or see `_clean_up`)."""
        return bool(self._clean_up(self._release, request_id))

    def load(self, timeout_s: float | None = None) -> EngineLoad:
        return self.loop.call(self._load, timeout=timeout_s or self.timeout_s)

    # ---- prefill role ------------------------------------------------------------------------------------------------
    def held_pages(self, request_id: str) -> ReqPages:
        """The pages a finished `hold_pages` request keeps (what a transfer reads). Raises `KeyError` when the
        request is gone."""
        return self.loop.call(self._held_pages, request_id, timeout=self.timeout_s)

    # ---- decode role -------------------------------------------------------------------------------------------------
    def reserve(self, prompt_ids: list[int], params: SamplingParams) -> Reservation | None:
        """Destination pages for a prompt whose cache will arrive by transfer; None while the pools are too full.
        Raises `InvalidRequestError` / `CapacityError` for a request that can never be served."""
        return self.loop.call(self._reserve, prompt_ids, params, timeout=self.timeout_s)

    def cancel_reservation(self, reservation: Reservation) -> None:
        """Free a reservation whose transfer failed or expired (see `_clean_up`)."""
        self._clean_up(self._engine.cancel_transfer, reservation.pages)

    def adopt(self, request_id: str, prompt_ids: list[int], params: SamplingParams, reservation: Reservation,
              result: TransferResult, listener: Listener, prompt: str | None = None) -> RequestOutput:
        """Continue a request whose prompt cache (and first token) arrived into `reservation`; returns its first
        output, and delivers the later ones to `listener` (on the loop thread)."""
        return self.loop.call(self._adopt, request_id, prompt_ids, params, reservation, result, listener, prompt,
                              timeout=self.timeout_s)

    def _clean_up(self, fn, *args) -> object:
        """Run a clean-up operation; it never raises, because callers run it on their way out of a failure (or in
        a `finally`). One that cannot run within the deadline is not cancelled: it still runs when the loop gets
        to it, and this returns None; after the loop stopped there is nothing left to clean up."""
        try:
            return self.loop.call(fn, *args, timeout=self.timeout_s, cancel_on_timeout=False)
        except TimeoutError:
            logger.warning("%s is still queued on the engine loop after %.0fs", fn.__name__, self.timeout_s)
        except LoopStopped:
            pass
        return None

    # ---- on the loop thread ------------------------------------------------------------------------------------------
    def _submit(self, request_id, prompt_ids, params, listener, hold_pages) -> None:
        self._engine.add_request(prompt_ids, params, request_id=request_id, hold_pages=hold_pages)
        self.loop.listen(request_id, listener)

    def _release(self, request_id: str) -> bool:
        self.loop.forget(request_id)
        req = self._engine.requests.get(request_id)
        if req is None:
            return False
        if not req.finished:
            self._engine.abort(request_id)  # an aborted request frees its pages, held or not
        else:
            self._engine.release_held(request_id)
        self._engine.release(request_id)
        return True

    def _load(self) -> EngineLoad:
        usage = self._engine.kv.usage()
        return EngineLoad(
            running=len(self._engine.scheduler.running),
            waiting=len(self._engine.scheduler.waiting),
            pages_used={k: used for k, (used, _) in usage.items()},
            pages_total={k: total for k, (_, total) in usage.items()},
            pages_cached=dict(self._engine.kv.cached_pages()),
        )

    def _held_pages(self, request_id: str) -> ReqPages:
        pages = self._engine.requests[request_id].pages
        if pages is None:
            raise KeyError(f"request {request_id!r} holds no pages")
        return pages

    def _reserve(self, prompt_ids: list[int], params: SamplingParams) -> Reservation | None:
        pages = self._engine.reserve_transfer(prompt_ids, params)
        if pages is None:
            return None
        return Reservation(pages, destination(self._engine.kv, pages, len(prompt_ids)))

    def _adopt(self, request_id, prompt_ids, params, reservation: Reservation, result: TransferResult,
               listener: Listener, prompt) -> RequestOutput:
        out = self._engine.adopt(request_id, prompt_ids, params, reservation.pages, result.first_token,
                                 result.num_cached_tokens, result.first_logprob, prompt)
        if not out.finished:
            self.loop.listen(request_id, listener)
        return out
