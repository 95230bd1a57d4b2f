"""The router's gRPC API (`pdspark.v1.Router`): streaming `Generate` and `Abort`, over the same core as HTTP."""

from __future__ import annotations

import uuid

from pdspark.errors import InvalidRequestError, RequestFailed, as_request_failed
from pdspark.router.router_core import RouterCore, Totals
from pdspark.rpc import convert, status
from pdspark.v1 import router_pb2, router_pb2_grpc


class RouterServicer(router_pb2_grpc.RouterServicer):
    def __init__(self, core: RouterCore):
        self.core = core

    async def Generate(self, request, context):
        core = self.core
        try:
            ids = self._prompt(request)
            params = convert.sampling_from_pb(request.sampling)
            if len(ids) + params.max_tokens > core.max_model_len:
                raise InvalidRequestError(f"prompt ({len(ids)} tokens) + `max_tokens` ({params.max_tokens}) exceeds "
                                          f"the maximum context length {core.max_model_len}")
        except InvalidRequestError as e:
            await status.abort_async(context, as_request_failed(e))
        rid = request.request_id or uuid.uuid4().hex
        totals = Totals(len(ids))
        stream = core.run("grpc", rid, ids, params, totals, timeout_s=request.timeout_s or None)
        try:
            async for chunk in stream:
                yield router_pb2.RouterGenerateChunk(
                    request_id=rid, token_ids=chunk.token_ids, text=chunk.text,
                    logprobs=[convert.logprob_to_pb(lp) for lp in chunk.logprobs], finished=chunk.finished,
                    finish_reason=convert.finish_reason_to_pb(chunk.finish_reason), prompt_tokens=totals.prompt_tokens,
                    completion_tokens=chunk.completion_tokens, cached_tokens=chunk.cached_tokens,
                    prefill_worker=chunk.prefill_worker, decode_worker=chunk.decode_worker,
                )
        except RequestFailed as e:
            await status.abort_async(context, e)
        finally:
            await stream.aclose()

    async def Abort(self, request, context):
        return router_pb2.RouterAbortResponse(found=await self.core.dispatcher.abort(request.request_id))

    def _prompt(self, request) -> list[int]:
        which = request.WhichOneof("prompt")
        if which == "token_ids":
            ids = list(request.token_ids.ids)
        elif which == "text":
            if self.core.tokenizer is None:
                raise InvalidRequestError("this model has no tokenizer; send `token_ids`")
            ids = self.core.tokenizer.encode(request.text)
        else:
            raise InvalidRequestError("`prompt` is required: set `text` or `token_ids`")
        if not ids:
            raise InvalidRequestError("empty prompt: `text`/`token_ids` must give at least one token")
        vocab = self.core.model_config.vocab_size
        if any(not 0 <= t < vocab for t in ids):
            raise InvalidRequestError(f"`token_ids` must be in [0, {vocab})")
        return ids
