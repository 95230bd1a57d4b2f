"""gRPC servicers of the workers (grpc.aio): message conversion, deadlines and status mapping only; the work is in
the workers. Every handler is a coroutine on the server's asyncio loop and holds no thread while it waits.

Deadlines: a request's `timeout_ms` (relative) and the call's own gRPC deadline become one local `Deadline` on
receipt. Failures: `Generate` ends its stream with the code's gRPC status and the typed `ErrorDetail` trailer;
`Prefill` and `SubmitPlan` answer with the failure inside their `TransferResult`, except a refusal at admission
(OVERLOADED), which fails the call at once with RESOURCE_EXHAUSTED and the trailer, and a `SubmitPlan` whose
writes were given up on while they may still land (`Unanswered`), which fails without the trailer, as the transport
would. `GetLoad` reads the snapshot the engine loop publishes (and a decode worker's own counts of its reservation
queue and quarantined pages) and `Abort` only flags the request, so neither waits for an engine step.

`Calls` (both services) takes the router's Prefill or Generate calls multiplexed on one stream
(`rpc/multiplexed_server.py`): each runs this servicer's own `Prefill` or `Generate`, with the same deadlines,
failures, trace context and metrics as the gRPC call it stands for.

Metrics: each `Prefill` call and `Generate` stream is counted once as it ends, by outcome (`ok`, `cancelled` when
the caller went away before the last chunk, the failure's code, or `error`: an unexpected exception). A multiplexed
call cancelled before its handler ran (its cancel in the message that brought it) counts `cancelled` too.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Callable, Sequence

from pdspark.deadline import Deadline
from pdspark.engine.output_text import stream_text
from pdspark.errors import ErrorCode, PdsparkError, RequestFailed, Unanswered, as_request_failed
from pdspark.rpc import convert, status, tracing
from pdspark.rpc.multiplexed_server import CallHandler, MultiplexedServer
from pdspark.serving.decode_worker import DecodeWorker
from pdspark.serving.engine_load import EngineLoad
from pdspark.serving.metrics import WorkerMetrics
from pdspark.serving.prefill_worker import PrefillWorker
from pdspark.transfer.compat import CompatDescriptor
from pdspark.types import RequestOutput
from pdspark.v1 import worker_pb2, worker_pb2_grpc


def _load(load: EngineLoad, in_flight: int, metrics_url: str, rank_states: list[str], compat: CompatDescriptor,
          queued: int = 0, quarantined_pages: dict[str, int] | None = None) -> worker_pb2.LoadReport:
    quarantined = quarantined_pages or {}
    return worker_pb2.LoadReport(
        compat=convert.compat_to_pb(compat),
        running=load.running,
        waiting=load.waiting,
        pages_used=dict(load.pages_used),
        pages_total=dict(load.pages_total),
        transfers_in_flight=in_flight,
        pages_cached=dict(load.pages_cached),
        metrics_url=metrics_url,
        queued=queued,
        quarantined_pages=quarantined,
        quarantined_slots=quarantined.get("req_slots", 0),
        rank_states=rank_states,
    )


def _one_process() -> list[str]:
    return ["running"]


def _deadline(timeout_ms: int, context) -> Deadline:
    return Deadline.on_receipt(convert.timeout_from_ms(timeout_ms), context.time_remaining())


class PrefillServicer(worker_pb2_grpc.PrefillWorkerServicer):
    def __init__(self, worker: PrefillWorker, metrics: WorkerMetrics | None = None):
        self.worker = worker
        self.metrics = metrics
        self.metrics_url = ""  # set by the server once its metrics endpoint listens
        self.rank_states: Callable[[], list[str]] = _one_process  # a worker group's: set by the server
        self.calls = MultiplexedServer({"prefill": CallHandler(self.Prefill, "prefill", streaming=False,
                                                               unstarted=self._unstarted)})

    async def Calls(self, request_iterator, context):
        async with contextlib.aclosing(self.calls.serve(request_iterator, context)) as replies:
            async for message in replies:
                yield message

    def _unstarted(self, request) -> None:
        _count(self.metrics, "cancelled")  # a multiplexed call cancelled before `Prefill` ran

    async def Prefill(self, request, context):
        outcome = "error"
        span = tracing.start("prefill", tracing.parent_of(context), {
            "pdspark.request_id": request.request_id, "pdspark.transfer_id": request.transfer_id,
            "pdspark.prompt_tokens": len(request.prompt_token_ids)})
        try:
            result = await self.worker.prefill(
                request.request_id, request.transfer_id, list(request.prompt_token_ids),
                convert.sampling_from_pb(request.sampling), _deadline(request.timeout_ms, context), trace=span,
                num_generated=request.num_generated,
            )
            outcome = "ok"
            if span.is_recording():
                span.set_attribute("pdspark.cached_tokens", result.num_cached_tokens)
                span.set_attribute("pdspark.prefill_seconds", result.stats.prefill_s)
                span.set_attribute("pdspark.plan_wait_seconds", result.stats.plan_wait_s)
            return worker_pb2.PrefillResponse(result=convert.result_to_pb(result, None, request.transfer_id))
        except PdsparkError as e:
            outcome = as_request_failed(e).code.value
            failure = await _refuse_if_overloaded(context, e)
            return worker_pb2.PrefillResponse(result=convert.result_to_pb(None, failure, request.transfer_id))
        except asyncio.CancelledError:
            outcome = "cancelled"
            raise
        finally:
            _count(self.metrics, outcome)
            tracing.finish(span, None if outcome == "ok" else outcome)

    async def SubmitPlan(self, request, context):
        deadline = _deadline(request.timeout_ms, context)
        span = tracing.start("submit_plan", tracing.parent_of(context), {
            "pdspark.request_id": request.request_id, "pdspark.transfer_id": request.transfer_id})
        error = "cancelled"  # None once it answered
        try:
            try:
                plan = convert.plan_from_pb(request)
            except RequestFailed as e:  # a plan we cannot read: its transfer fails on both legs
                error = e.code.value
                self.worker.refuse_plan(request.transfer_id, e, deadline)
                return convert.result_to_pb(None, e, request.transfer_id)
            try:
                result = await self.worker.submit_plan(plan, deadline)
                error = None
                return convert.result_to_pb(result, None, request.transfer_id)
            except Unanswered as e:
                # Not an answer: the writes may still land. Without the typed trailer the decode worker reads it as
                # the transport's failure, and keeps its pages until no write can land.
                error = e.code.value
                await context.abort(status.status_of(e.code), e.message)
            except PdsparkError as e:
                error = as_request_failed(e).code.value
                return convert.result_to_pb(None, await _refuse_if_overloaded(context, e), request.transfer_id)
        finally:
            tracing.finish(span, error)

    async def Abort(self, request, context):
        return worker_pb2.AbortResponse(found=self.worker.abort(request.request_id))

    async def GetLoad(self, request, context):
        return _load(self.worker.engine.load(), self.worker.in_flight, self.metrics_url, self.rank_states(),
                     self.worker.compat)


class DecodeServicer(worker_pb2_grpc.DecodeWorkerServicer):
    def __init__(self, worker: DecodeWorker, metrics: WorkerMetrics | None = None):
        self.worker = worker
        self.metrics = metrics
        self.metrics_url = ""  # set by the server once its metrics endpoint listens
        self.rank_states: Callable[[], list[str]] = _one_process  # a worker group's: set by the server
        self.calls = MultiplexedServer({"generate": CallHandler(self.Generate, "chunk", streaming=True,
                                                                unstarted=self._unstarted)})

    async def Calls(self, request_iterator, context):
        async with contextlib.aclosing(self.calls.serve(request_iterator, context)) as replies:
            async for message in replies:
                yield message

    def _unstarted(self, request) -> None:
        _count(self.metrics, "cancelled")  # a multiplexed call cancelled before `Generate` ran

    async def Generate(self, request, context):
        outcome = "error"
        span = tracing.start("decode", tracing.parent_of(context), {
            "pdspark.request_id": request.request_id, "pdspark.transfer_id": request.transfer_id,
            "pdspark.prompt_tokens": len(request.prompt_token_ids),
            "pdspark.generated_tokens": len(request.generated_token_ids)})
        out = None  # the last output: the span's closing attributes
        try:
            params = convert.sampling_from_pb(request.sampling)
            generated = list(request.generated_token_ids)
            stream = self.worker.generate(
                request.request_id, request.transfer_id, list(request.prompt_token_ids), params,
                request.prefill_address, _deadline(request.timeout_ms, context), generated=generated,
            )
            # Closed explicitly: a caller that goes away cancels us at a `yield`, where the worker's generator is
            # suspended; closing it there releases the request now rather than when it is garbage-collected.
            # Its SubmitPlan call carries the decode span's trace context.
            async with contextlib.aclosing(stream), tracing.calls_under(span):
                # A migrated stream's generated tokens reached the client already, with their stable text (the
                # earlier worker streamed exactly that, the same tails held back): only what follows is new.
                # Decoded once the first output came: by then the engine has checked that those ids are in the
                # vocabulary.
                sent, sent_text, stops = len(generated), None, params.stop_strings
                async for out in stream:
                    if sent_text is None:
                        sent_text = self.worker.stable_text_of(generated, stops)
                    text = stable_text(out, stops)
                    yield _chunk(out, sent, sent_text, text, logprob_base=len(generated))
                    sent, sent_text = len(out.token_ids), text
            outcome = "ok"
        except PdsparkError as e:
            failure = as_request_failed(e)
            outcome = failure.code.value
            await status.abort_async(context, failure)
        except (GeneratorExit, asyncio.CancelledError):  # the caller went away
            # After the last chunk it may (the router stops reading there and cancels the call before its status
            # arrives): the request was served, so it counts as such.
            outcome = "ok" if out is not None and out.finished else "cancelled"
            raise
        finally:
            _count(self.metrics, outcome)
            if span.is_recording():
                tracing.finish(span, None if outcome == "ok" else outcome, _decode_attributes(out, request))

    async def Abort(self, request, context):
        return worker_pb2.AbortResponse(found=self.worker.abort(request.request_id))

    async def GetLoad(self, request, context):
        # The reservation queue and the quarantined slots: capacity the engine's own counts do not show as taken,
        # which the router counts as load.
        return _load(self.worker.engine.load(), self.worker.transfers_in_flight, self.metrics_url, self.rank_states(),
                     self.worker.compat, self.worker.waiting, self.worker.quarantined_pages)


def _decode_attributes(out: RequestOutput | None, request) -> dict[str, str | int | float]:
    """The decode span's closing attributes: tokens decoded here and DSpark's verify steps and acceptance."""
    if out is None:
        return {}
    steps, accepted = out.spec_verify_steps, out.spec_accepted_tokens
    attributes: dict[str, str | int | float] = {
        "pdspark.completion_tokens": len(out.token_ids) - len(request.generated_token_ids),
        "pdspark.cached_tokens": out.num_cached_tokens,
        "pdspark.finish_reason": out.finish_reason.value if out.finish_reason else "",
        "pdspark.spec.verify_steps": steps, "pdspark.spec.accepted_tokens": accepted}
    if steps:
        # Tokens committed per verify step (accepted drafts + the verifier's own), as the decode metrics'.
        attributes["pdspark.spec.acceptance_length"] = 1 + accepted / steps
    return attributes


def _count(metrics: WorkerMetrics | None, outcome: str) -> None:
    if metrics is not None:
        metrics.requests.labels(outcome=outcome).inc()


async def _refuse_if_overloaded(context, e: PdsparkError) -> RequestFailed:
    """The failure to answer with in-band; an OVERLOADED refusal instead ends the call with its status."""
    failure = as_request_failed(e)
    if failure.code is ErrorCode.OVERLOADED:
        await status.abort_async(context, failure)
    return failure


def stable_text(out: RequestOutput, stop_strings: Sequence[str] = ()) -> str:
    """The decoded text safe to stream (`output_text.stream_text`): while the request runs, a trailing incomplete
    UTF-8 sequence and the longest tail that may start one of `stop_strings` wait for the tokens after them, so no
    part of a stop string is ever sent and streamed pieces always concatenate to the final text. Token ids are sent
    as generated; only the text waits."""
    return stream_text(out.text or "", out.finished, stop_strings)


def _chunk(out: RequestOutput, sent: int, sent_text: str, text: str, logprob_base: int = 0
           ) -> worker_pb2.GenerateChunk:
    """The part of `out` not streamed yet (`text` is its stable text; `sent_text` a prefix of it). `out.logprobs`
    start at token `logprob_base` (a migrated stream's, after the tokens generated before)."""
    common = len(sent_text) if text.startswith(sent_text) else len(os.path.commonprefix([text, sent_text]))
    chunk = worker_pb2.GenerateChunk(
        request_id=out.request_id,
        token_ids=out.token_ids[sent:],
        text=text[common:],
        finished=out.finished,
        finish_reason=convert.finish_reason_to_pb(out.finish_reason),
        num_cached_tokens=out.num_cached_tokens,
        spec_verify_steps=out.spec_verify_steps,
        spec_accepted_tokens=out.spec_accepted_tokens,
    )
    if out.logprobs:
        chunk.logprobs.extend(convert.logprob_to_pb(lp) for lp in out.logprobs[sent - logprob_base:])
    if out.prompt_logprobs:  # (the decode worker's first output alone carries them)
        chunk.prompt_logprobs.extend(convert.logprob_to_pb(lp) for lp in out.prompt_logprobs if lp is not None)
    return chunk

