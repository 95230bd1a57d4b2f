"""`EngineClient`: the operations the workers perform on their engine, by name, as coroutines.

Each operation runs on the engine-loop thread (between steps, in arrival order); the coroutine awaits its result
through `asyncio.wrap_future`, so no thread waits for the engine. An operation the loop has not started within
`timeout_s`, or whose caller is cancelled first, is cancelled and never runs. Clean-ups and aborts (`release`,
`cancel_reservation`, `abort`) are queued and not awaited: they run even when their caller has gone, and in order after
whatever that caller queued before them. An operation and the listener it registers happen in one command, so no
output can be missed in between. Listeners run on the loop thread; `OutputStream` carries outputs to coroutines.

Prefill role: `submit(..., hold_pages=True)` -> the listener sees the first token -> `held_pages` (the transfer
reads them) -> `release`.
Decode role: `reserve` (waits in the `ReservationQueue`) -> (transfer) -> `adopt` (joins the running batch; the
listener streams tokens) -> `release`; or `cancel_reservation` when the transfer failed.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from pdspark.errors import ErrorCode, PdsparkError, RequestFailed, as_request_failed
from pdspark.serving.engine_load import EngineLoad
from pdspark.serving.engine_loop import EngineLoop, Listener, LoopStopped
from pdspark.serving.reservation_queue import Reservation, ReservationQueue, ReservationTicket, no_room
from pdspark.transfer.plan import TransferResult
from pdspark.types import RequestOutput, SamplingParams

if TYPE_CHECKING:
    from pdspark.cache.kv_cache import ReqPages
    from pdspark.model.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

# A structured output's grammar that takes longer than this to compile is refused. xgrammar compiles a JSON schema
# in milliseconds; a pathological regex or grammar can take minutes, and the compile cannot be interrupted: it goes
# on in its thread and lands in the cache, the request is answered now.
GRAMMAR_COMPILE_TIMEOUT_S = 10.0


class EngineClient:
    def __init__(self, loop: EngineLoop, timeout_s: float = 30.0):
        self.loop = loop
        self.timeout_s = timeout_s
        self._engine = loop.engine
        self._reservations = ReservationQueue(loop.engine)
        loop.add_ticker(self._reservations.grant)

    @property
    def tokenizer(self) -> Tokenizer | None:
        """The engine's tokenizer (stateless: safe to use from any thread)."""
        return self._engine.tokenizer

    # ---- both roles --------------------------------------------------------------------------------------------------
    async def submit(self, request_id: str, prompt_ids: list[int], params: SamplingParams, listener: Listener,
                     hold_pages: bool = False) -> None:
        """Queue a request and deliver its outputs to `listener` (on the loop thread). `hold_pages`: keep its
        pages after it finishes, until `release`. Raises `RequestFailed` (INVALID_REQUEST, CAPACITY,
        ALREADY_EXISTS, or UNAVAILABLE when the loop does not answer)."""
        await self._compile_grammar(params)
        await self._call(self._submit, request_id, prompt_ids, params, listener, hold_pages)

    def abort(self, request_id: str) -> None:
        """Queue stopping a request (not awaited: an abort never waits for a step); its listener gets the aborted
        output. A request that is unknown or already finished is left alone."""
        self._queue(self._abort, request_id)

    def release(self, request_id: str) -> None:
        """Queue letting go of everything the engine keeps for a request: stop it if it still runs, free the
        pages it holds for a transfer, forget it and its listener. Not awaited (see the module doc)."""
        self._queue(self._release, request_id)

    def load(self) -> EngineLoad:
        """The latest snapshot the loop published (never waits for a step)."""
        return self.loop.load

    # ---- prefill role ------------------------------------------------------------------------------------------------
    async def held_pages(self, request_id: str) -> ReqPages:
        """The pages a finished `hold_pages` request keeps (what a transfer reads). They stay as they are until
        `release`. Raises `RequestFailed` when the request is gone."""
        return await self._call(self._held_pages, request_id)

    # ---- decode role -------------------------------------------------------------------------------------------------
    async def reserve(self, prompt_ids: list[int], params: SamplingParams, deadline: float) -> Reservation:
        """Destination pages for a prompt whose cache will arrive by transfer, waiting in line (until `deadline`,
        `time.monotonic()` seconds) while the pools are full. Raises `RequestFailed`: OVERLOADED when none came in
        time (`reservation_queue.no_room`), or INVALID_REQUEST / CAPACITY for a prompt that can never be served."""
        await self._compile_grammar(params)  # (adopt finds it compiled)
        ticket = ReservationTicket(prompt_ids, params, deadline)
        try:
            await self._call(self._reservations.offer, ticket)
            return await asyncio.wait_for(asyncio.wrap_future(ticket.future), max(0.0, deadline - time.monotonic()))
        except TimeoutError:
            self._queue(self._reservations.withdraw, ticket)
            raise no_room() from None
        except BaseException:
            # Gone (cancelled) or failed: whatever the ticket became meanwhile, nothing of it may stay behind.
            self._queue(self._reservations.withdraw, ticket)
            raise

    def cancel_reservation(self, reservation: Reservation) -> None:
        """Queue freeing a reservation whose transfer failed or whose caller is gone (a no-op once adopted)."""
        self._queue(self._reservations.cancel, reservation)

    async def adopt(self, request_id: str, prompt_ids: list[int], params: SamplingParams, reservation: Reservation,
                    result: TransferResult, listener: Listener, prompt: str | None = None,
                    generated: list[int] | tuple[int, ...] = ()) -> RequestOutput:
        """Continue a request whose prompt cache (and first token) arrived into `reservation`; returns its first
        output, and delivers the later ones to `listener` (on the loop thread). Raises `RequestFailed`
        (ALREADY_EXISTS: the reservation is then still the caller's). `generated`: see `Engine.adopt`."""
        return await self._call(self._adopt, request_id, prompt_ids, params, reservation, result, listener, prompt,
                                generated)

    # ---- plumbing ----------------------------------------------------------------------------------------------------
    async def _compile_grammar(self, params: SamplingParams) -> None:
        """Compile a constrained request's grammar on a helper thread (cached), so that neither this event loop nor
        the engine loop waits for a compile; raises `RequestFailed` (INVALID_REQUEST) for one that does not compile
        or takes longer than `GRAMMAR_COMPILE_TIMEOUT_S`."""
        so = params.structured_outputs
        if so is None:
            return
        try:
            await asyncio.wait_for(asyncio.to_thread(self._engine.grammars.compile, so), GRAMMAR_COMPILE_TIMEOUT_S)
        except TimeoutError:
            raise RequestFailed(ErrorCode.INVALID_REQUEST, f"`structured_outputs.{so.kind}` did not compile within "
                                f"{GRAMMAR_COMPILE_TIMEOUT_S:.0f}s; simplify it") from None
        except PdsparkError as e:
            raise as_request_failed(e) from e

    async def _call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run `fn(*args)` on the loop thread and await its result (engine errors as `RequestFailed`)."""
        fut = self.loop.submit(fn, *args, awaited=True)
        try:
            # Cancelling the wrapper (timeout, or our caller cancelled) cancels `fut` unless it already started.
            return await asyncio.wait_for(asyncio.wrap_future(fut), self.timeout_s)
        except TimeoutError:
            raise RequestFailed(ErrorCode.UNAVAILABLE, f"the engine loop did not run {fn.__name__} within "
                                                       f"{self.timeout_s:.0f}s") from None
        except LoopStopped as e:
            raise RequestFailed(ErrorCode.UNAVAILABLE, "the worker is shutting down") from e
        except PdsparkError as e:
            raise as_request_failed(e) from e

    def _queue(self, fn: Callable[..., Any], *args: Any) -> None:
        """Queue a clean-up on the loop thread without waiting for it (after the loop stopped there is nothing
        left to clean up: the future then carries `LoopStopped`, ignored). Nobody reads its result, so a failure
        (a broken invariant, e.g. a page freed twice) is logged here rather than lost."""
        self.loop.submit(fn, *args).add_done_callback(functools.partial(_log_failure, fn.__name__))

    # ---- on the loop thread ------------------------------------------------------------------------------------------
    def _submit(self, request_id, prompt_ids, params, listener, hold_pages) -> None:
        self._engine.add_request(prompt_ids, params, request_id=request_id, hold_pages=hold_pages)
        self.loop.listen(request_id, listener)

    def _abort(self, request_id: str) -> bool:
        if not self._engine.abort(request_id):
            return False
        self.loop.deliver(self._engine.output(self._engine.requests[request_id]))
        return True

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

    def _held_pages(self, request_id: str) -> ReqPages:
        req = self._engine.requests.get(request_id)
        if req is None or req.pages is None:
            raise RequestFailed(ErrorCode.ABORTED, f"request {request_id!r} holds no pages any more")
        return req.pages

    def _adopt(self, request_id, prompt_ids, params, reservation: Reservation, result: TransferResult,
               listener: Listener, prompt, generated) -> RequestOutput:
        out = self._engine.adopt(request_id, prompt_ids, params, reservation.pages, result.first_token,
                                 result.num_cached_tokens, result.first_logprob, prompt, generated)
        self._reservations.adopted(reservation)
        if not out.finished:
            self.loop.listen(request_id, listener)
        return out


def _log_failure(name: str, fut: Future) -> None:
    if fut.cancelled():
        return
    e = fut.exception()
    if e is not None and not isinstance(e, LoopStopped):
        logger.error("engine-loop clean-up %s failed", name, exc_info=e)
