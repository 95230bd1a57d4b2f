"""`RouterCore`: what the HTTP and gRPC front ends share: the model's tokenizer and limits, admission, the
dispatcher, the requests being served (for `abort`) and the per-request accounting (metrics).

Request identity: the router mints every request's id (`new_request_id`: a random uuid4, unique across routers without
coordination, and unguessable). The workers see only that id, so two requests can never share one there. What a
client calls its request (gRPC `request_id`, HTTP `X-Request-Id` or the body's `user`) is a label: logged and
echoed back, never used to find a request. `abort` takes the router's id, which only the request's own caller
was told: knowing or guessing another client's label cannot reach its request.

Callers: each request runs for a `Caller` (the key it presented, see `api_keys`). A key has at most
`max_in_flight_per_key` requests in the router (`KeyQuota`), and a caller who may not see worker addresses gets
none: not in the chunks (`prefill_worker`/`decode_worker` left empty) and not in a failure's message (each known
worker's address replaced by its name, any other IP address by `<address>`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pdspark.config import RouterConfig
from pdspark.deadline import Deadline
from pdspark.errors import ErrorCode, RequestFailed
from pdspark.model.model_config import ModelConfig
from pdspark.model.tokenizer import Tokenizer
from pdspark.router.admission_queue import AdmissionQueue, AdmissionTicket
from pdspark.router.auth.api_keys import ANONYMOUS, Access, ApiKeys, Caller
from pdspark.router.auth.key_quota import KeyQuota
from pdspark.router.auth.shared_key_quota import SharedKeyQuota
from pdspark.router.dispatcher import Dispatcher, pairs
from pdspark.router.openai.chat_template import ChatTemplate
from pdspark.router.pair_attempt import DispatchChunk
from pdspark.router.peer_link import PeerLink
from pdspark.router.prompt_work import PromptWork
from pdspark.router.random_id import uuid4_hex
from pdspark.router.router_metrics import RouterMetrics
from pdspark.router.workers.worker_registry import WorkerRegistry
from pdspark.rpc import tracing
from pdspark.types import FinishReason, SamplingParams

logger = logging.getLogger(__name__)

# The Retry-After a refused request is given, in seconds. The queue drains as requests finish; a second later a
# client meets a new state, and a whole second spreads a flood's retries instead of echoing it back at once.
RETRY_AFTER_S = 1
MAX_LABEL_LEN = 128  # a client's label is logged and echoed: bounded
# IP addresses (v4, or v6 in brackets), with a port or not: what a worker's own messages may name (a peer, a
# transfer endpoint) besides the registered addresses.
_IP_ADDRESS = re.compile(r"\b(?:\d{1,3}\.){3}\d{1,3}(?::\d+)?\b|\[[0-9A-Fa-f:.]+\](?::\d+)?")


@dataclass
class Totals:
    prompt_tokens: int
    completion_tokens: int = 0
    cached_tokens: int = 0
    finish_reason: FinishReason | None = None
    prefill_worker: str = ""
    decode_worker: str = ""


@dataclass
class _Live:
    """A request between arrival and its end: what `abort` needs to reach it wherever it is."""

    ticket: AdmissionTicket
    aborted: asyncio.Event = field(default_factory=asyncio.Event)


class _Observed:
    """One request's span, outcome and metrics, as a context around its admission and dispatch: the clock starts
    on entry; each chunk is timed (TTFT, inter-token latency) and counted into `totals`; the way the block is left
    is the outcome (a `RequestFailed`'s code, `cancelled` when the client went away, `error` for anything else),
    and the latency, token counters, outcome count and span's end are recorded on the way out, whatever it was."""

    def __init__(self, metrics: RouterMetrics, api: str, request_id: str, label: str, totals: Totals,
                 trace_parent: Any = None):
        self.trace_parent = trace_parent  # the client's trace context (`tracing.parent_of_headers`), if it sent one
        self.metrics = metrics
        self.api = api
        self.request_id = request_id
        self.label = label
        self.totals = totals
        self.rejected = "key_limit"  # what an OVERLOADED failure from here on is a rejection by
        self.span = tracing.NO_SPAN

    def __enter__(self) -> _Observed:
        self.t0 = self.last = time.perf_counter()  # `last`: when the last chunk with tokens arrived
        self.first = True
        self.span = tracing.start("request", parent=self.trace_parent, attributes={
            "pdspark.request_id": self.request_id, "pdspark.api": self.api,
            "pdspark.prompt_tokens": self.totals.prompt_tokens,
        } if tracing.enabled() else None)
        return self

    def admitted(self, queue_time_s: float) -> None:
        self.metrics.queue_time.observe(queue_time_s)
        self.span.add_event("admitted")

    def chunk(self, chunk: DispatchChunk) -> None:
        totals = self.totals
        now = time.perf_counter()
        if self.first:
            self.metrics.ttft.observe(now - self.t0)
            self.first = False
        elif chunk.token_ids:
            self.metrics.observe_tokens(now - self.last, len(chunk.token_ids))
        if chunk.token_ids:
            self.last = now
        totals.completion_tokens = chunk.completion_tokens
        totals.cached_tokens = chunk.cached_tokens
        totals.prefill_worker, totals.decode_worker = chunk.prefill_worker, chunk.decode_worker
        if chunk.finished:
            totals.finish_reason = chunk.finish_reason

    def __exit__(self, exc_type: type[BaseException] | None, e: BaseException | None, tb: object) -> None:
        m, totals = self.metrics, self.totals
        outcome = "error"
        if e is None:
            outcome = "ok"
        elif isinstance(e, RequestFailed):
            outcome = e.code.value
            if e.code is ErrorCode.OVERLOADED:
                m.rejected.labels(reason=self.rejected).inc()
            # A refused request is routine under load: not one log line each.
            log = logger.debug if e.code is ErrorCode.OVERLOADED else logger.info
            log("request %s (label %r, %s) failed: %s", self.request_id, self.label, self.api, e)
        elif isinstance(e, (GeneratorExit, asyncio.CancelledError)):
            outcome = "cancelled"  # the client went away; the dispatcher cancels both legs
        m.e2e.observe(time.perf_counter() - self.t0)
        m.count_request(self.api, outcome)
        m.prompt_tokens.inc(totals.prompt_tokens)
        if totals.completion_tokens:  # an `inc(0)` changes nothing and costs a lock (most requests cache none)
            m.completion_tokens.inc(totals.completion_tokens)
        if totals.cached_tokens:
            m.cached_tokens.inc(totals.cached_tokens)
        logger.debug("request %s (label %r, %s): %s in %.3f s", self.request_id, self.label, self.api, outcome,
                     time.perf_counter() - self.t0)
        if self.span is not tracing.NO_SPAN:
            tracing.finish(self.span, None if outcome == "ok" else outcome, {
                "pdspark.outcome": outcome, "pdspark.completion_tokens": totals.completion_tokens,
                "pdspark.cached_tokens": totals.cached_tokens,
                "pdspark.finish_reason": totals.finish_reason.value if totals.finish_reason else ""})


def clean_label(label: str | None) -> str:
    """A client's label as the router logs and echoes it: printable ASCII, at most `MAX_LABEL_LEN` characters."""
    label = (label or "")[:MAX_LABEL_LEN]
    if label.isascii() and label.isprintable():  # the common case (and ""): nothing to drop, no loop per character
        return label
    return "".join(c for c in label if " " <= c <= "~")


class RouterCore:
    def __init__(self, model_path: str, served_name: str, max_model_len: int, registry: WorkerRegistry,
                 dispatcher: Dispatcher, metrics: RouterMetrics, options: RouterConfig | None = None,
                 key_quota: KeyQuota | SharedKeyQuota | None = None, peers: PeerLink | None = None):
        """`key_quota`, `peers`: a process of a router group's (`router_group`): the group's shared per-key counts,
        and its line to the other processes (worker changes and aborts reach them all)."""
        cfg = ModelConfig.from_dir(model_path)
        options = options or RouterConfig()
        self.model_config = cfg
        self.served_name = served_name
        self.max_model_len = max_model_len
        self.tokenizer = Tokenizer.from_dir(Path(model_path), cfg.eos_token_ids)
        self.chat_template = ChatTemplate(self.tokenizer.chat_template if self.tokenizer else None)
        # Read here, at start: it reads the whole vocabulary once.
        self.max_token_chars = self.tokenizer.max_token_chars if self.tokenizer else None
        self.prompt_work = PromptWork()
        self.registry = registry
        self.dispatcher = dispatcher
        self.metrics = metrics
        self.options = options
        self.request_timeout_s = options.admission.request_timeout_s
        self.keys = ApiKeys(options.auth, options.host)
        self.admission = AdmissionQueue(options.admission.max_in_flight, options.admission.max_queued)
        self.key_quota = key_quota or KeyQuota(options.admission.key_in_flight_limit)
        self.peers = peers
        self.live: dict[str, _Live] = {}
        if not metrics.multiprocess:
            # Read at scrape time: the queue is the one source of these numbers. (A group's processes write theirs
            # when a scrape asks: `publish_gauges`.)
            metrics.in_flight.set_function(lambda: self.admission.in_flight)
            metrics.queued.set_function(lambda: self.admission.queued)
        metrics.max_in_flight.set(options.admission.max_in_flight)
        metrics.max_queued.set(options.admission.max_queued)
        for w in registry.workers.values():
            metrics.worker_added(w.role, w.name)

    @staticmethod
    def new_request_id() -> str:
        return uuid4_hex()

    def timeout_for(self, requested_s: float | None) -> float:
        """A request's timeout: what its caller asked for (None or <= 0: nothing), at most `request_timeout_s`,
        which is also the default."""
        if requested_s is None or not requested_s > 0:
            return self.request_timeout_s
        return min(requested_s, self.request_timeout_s)

    def redact(self, message: str) -> str:
        """`message` without worker addresses: a registered worker's becomes its name, any other IP address
        `<address>`."""
        for w in self.registry.workers.values():
            message = re.sub(re.escape(w.address) + r"(?!\d)", w.name, message)  # not a longer port's prefix
        return _IP_ADDRESS.sub("<address>", message)

    async def run(self, api: str, request_id: str, prompt_ids: list[int], params: SamplingParams, totals: Totals,
                  timeout_s: float | None = None, label: str = "",
                  caller: Caller = ANONYMOUS, trace_parent: Any = None) -> AsyncGenerator[DispatchChunk, None]:
        """Admit, dispatch and account (queue time, TTFT, inter-token latency, latency, tokens, outcome, 429s).

        Args:
            request_id: the router's id, from `new_request_id` (what `abort` takes).
            timeout_s: what the caller asked for; see `timeout_for`.
            label: the client's name for the request, for the logs only.
            trace_parent: the client's trace context (HTTP headers or gRPC metadata), the request span's parent.
            caller: who asked: its key's quota is charged, and unless it may list workers, worker addresses are
                left out of the chunks and the failure.

        Raises:
            RequestFailed: `OVERLOADED` at once when the caller's key or the admission queue is full; `DEADLINE`
                when the timeout passed (queued or at the workers); `ABORTED`; or why no pair could serve it.
        """
        reveal = self.keys.allows(caller, Access.LIST_WORKERS)
        assert request_id not in self.live, f"request id {request_id} is in use: ids come from new_request_id"
        try:
            with _Observed(self.metrics, api, request_id, label, totals, trace_parent) as observed:
                deadline = Deadline.after(self.timeout_for(timeout_s))
                self.key_quota.enter(caller.key_id)
                observed.rejected = "queue_full"
                try:
                    live = _Live(self.admission.enter())
                except RequestFailed:
                    self.key_quota.leave(caller.key_id)
                    raise
                observed.rejected = "workers_full"
                self.live[request_id] = live
                try:
                    observed.admitted(await live.ticket.wait(deadline.remaining()))
                    # `aclosing`: a caller that goes away (GeneratorExit at the `yield`) ends the attempt's legs
                    # here and now, not whenever the garbage collector finalizes the dispatcher's generator.
                    async with contextlib.aclosing(self.dispatcher.generate(
                            request_id, prompt_ids, params, deadline, live.aborted, trace=observed.span)) as chunks:
                        async for chunk in chunks:
                            if not reveal:
                                chunk = chunk.without_workers()
                            observed.chunk(chunk)
                            yield chunk
                finally:
                    live.ticket.release()
                    del self.live[request_id]
                    self.key_quota.leave(caller.key_id)
        except RequestFailed as e:
            if reveal:
                raise
            raise RequestFailed(e.code, self.redact(e.message)) from None

    def publish_gauges(self) -> None:
        """Set the gauges a scrape reads from this process's state (the admission queue, the workers' health)."""
        reg = self.registry
        if self.metrics.multiprocess:
            self.metrics.in_flight.set(self.admission.in_flight)
            self.metrics.queued.set(self.admission.queued)
        for role in ("prefill", "decode"):
            healthy = len(reg.healthy(role))
            total = sum(1 for w in reg.workers.values() if w.role == role)
            self.metrics.workers.labels(worker_role=role, healthy="true").set(healthy)
            self.metrics.workers.labels(worker_role=role, healthy="false").set(total - healthy)
        self.metrics.incompatible_pairs.set(sum(not pairs(p, d) for p in reg.healthy("prefill")
                                                for d in reg.healthy("decode")))

    async def change_workers(self, op: str, args: dict) -> dict:
        """`add_worker` (args: role, address, metrics_url) or `remove_worker` (args: address), in this process or,
        in a group, in every process in the group's one order: this process's `apply_worker_change` answer."""
        if self.peers is None:
            return await self.apply_worker_change(op, args)
        answers = await self.peers.ask(op, args)
        mine = answers.get(self.peers.index)
        if mine is None:
            raise RequestFailed(ErrorCode.UNAVAILABLE, f"this router process did not answer its own {op!r}")
        return mine

    async def apply_worker_change(self, op: str, args: dict) -> dict:
        """`{"worker": its JSON}`, or `{"error": why, "field": which}` when the registry refused it."""
        address = args["address"]
        try:
            if op == "add_worker":
                w = self.registry.add(args["role"], address, args.get("metrics_url", ""))
            else:
                w = self.registry.remove(address)
        except (ValueError, KeyError) as e:
            return {"error": str(e), "field": "role" if op == "add_worker" else "address"}
        if op == "add_worker":
            self.metrics.worker_added(w.role, w.name)
            await self.registry.check(w)
        else:
            self.metrics.worker_removed(w.role, w.name)
            self.dispatcher.prefill_policy.forget(address)
            self.dispatcher.decode_policy.forget(address)
        return {"worker": w.to_json()}

    async def abort_anywhere(self, request_id: str) -> bool:
        """`abort` here, or in a group in whichever process serves the request."""
        if self.abort(request_id):
            return True
        if self.peers is None:
            return False
        return any((await self.peers.ask("abort", {"request_id": request_id})).values())

    def abort(self, request_id: str) -> bool:
        """Abort the request with the router's id `request_id`, wherever it is (queued or at the workers); it ends
        with `ABORTED`. False when no such request is being served."""
        live = self.live.get(request_id)
        if live is None:
            return False
        live.aborted.set()
        failure = RequestFailed(ErrorCode.ABORTED, "aborted by its caller")
        if not live.ticket.abort(failure):
            self.dispatcher.abort(request_id)  # no-op between attempts: `aborted` stops the next one
        return True
