"""gRPC servicers of the workers: message conversion and status mapping only; the work is in the workers."""

from __future__ import annotations

import os

from pdspark.errors import PdsparkError, as_request_failed
from pdspark.rpc import convert, status
from pdspark.serving.decode_worker import DecodeWorker
from pdspark.serving.engine_client import EngineClient
from pdspark.serving.prefill_worker import PrefillWorker
from pdspark.types import RequestOutput
from pdspark.v1 import worker_pb2, worker_pb2_grpc

# GetLoad feeds the router's health and load views: answer quickly or fail, never hang a server thread.
_LOAD_TIMEOUT_S = 10.0


def _load(engine: EngineClient, in_flight: int, metrics_url: str) -> worker_pb2.LoadReport:
    load = engine.load(_LOAD_TIMEOUT_S)
    return worker_pb2.LoadReport(
        running=load.running,
        waiting=load.waiting,
        pages_used=load.pages_used,
        pages_total=load.pages_total,
        transfers_in_flight=in_flight,
        pages_cached=load.pages_cached,
        metrics_url=metrics_url,
    )


class PrefillServicer(worker_pb2_grpc.PrefillWorkerServicer):
    def __init__(self, worker: PrefillWorker):
        self.worker = worker
        self.metrics_url = ""  # set by the server once its metrics endpoint listens

    def Prefill(self, request, context):
        try:
            result = self.worker.prefill(
                request.request_id, request.transfer_id, list(request.prompt_token_ids),
                convert.sampling_from_pb(request.sampling), request.deadline_unix_s,
            )
            return worker_pb2.PrefillResponse(result=convert.result_to_pb(result, None, request.transfer_id))
        except PdsparkError as e:
            failure = as_request_failed(e)
            return worker_pb2.PrefillResponse(result=convert.result_to_pb(None, failure, request.transfer_id))

    def SubmitPlan(self, request, context):
        try:
            result = self.worker.submit_plan(convert.plan_from_pb(request))
            return convert.result_to_pb(result, None, request.transfer_id)
        except PdsparkError as e:
            return convert.result_to_pb(None, as_request_failed(e), request.transfer_id)

    def Abort(self, request, context):
        return worker_pb2.AbortResponse(found=self.worker.abort(request.request_id))

    def GetLoad(self, request, context):
        return _load(self.worker.engine, self.worker.in_flight, self.metrics_url)


class DecodeServicer(worker_pb2_grpc.DecodeWorkerServicer):
    def __init__(self, worker: DecodeWorker):
        self.worker = worker
        self.metrics_url = ""  # set by the server once its metrics endpoint listens

    def Generate(self, request, context):
        try:
            params = convert.sampling_from_pb(request.sampling)
            stream = self.worker.generate(
                request.request_id, request.transfer_id, list(request.prompt_token_ids), params,
                request.prefill_address, request.deadline_unix_s,
            )
            sent, sent_text = 0, ""
            for out in stream:
                if not context.is_active():
                    break  # client gone: leaving the generator aborts the request
                text = stable_text(out)
                yield _chunk(out, sent, sent_text, text)
                sent, sent_text = len(out.token_ids), text
        except PdsparkError as e:
            status.abort(context, as_request_failed(e))

    def Abort(self, request, context):
        return worker_pb2.AbortResponse(found=self.worker.abort(request.request_id))

    def GetLoad(self, request, context):
        return _load(self.worker.engine, self.worker.transfers_in_flight, self.metrics_url)


def stable_text(out: RequestOutput) -> str:
    """The decoded text safe to stream: a trailing incomplete UTF-8 sequence (decoded as U+FFFD) waits for the
    tokens that complete it, so streamed pieces always concatenate to the final text."""
    text = out.text or ""
    return text if out.finished else text.rstrip("\ufffd")


def _chunk(out: RequestOutput, sent: int, sent_text: str, text: str) -> worker_pb2.GenerateChunk:
    """The part of `out` not streamed yet (`text` is its stable text; `sent_text` a prefix of it)."""
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
        chunk.logprobs.extend(convert.logprob_to_pb(lp) for lp in out.logprobs[sent:])
    return chunk

