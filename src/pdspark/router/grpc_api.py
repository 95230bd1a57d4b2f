"""The router's gRPC API (`pdspark.v1.Router`): streaming `Generate` and `Abort`, over the same core as HTTP.

`Generate` tells its caller the router's id of the request at once, in the initial metadata under
`REQUEST_ID_KEY` (and again in every chunk's `request_id`); `Abort` takes only that id (see `RouterCore`).
A request refused because the router is full ends with RESOURCE_EXHAUSTED, its `ErrorDetail` trailer and a
`retry-after` trailer (seconds).

Keys: `AuthInterceptor` refuses a call without a valid one before it gets here; a caller who may not list workers
gets chunks without their `prefill_worker`/`decode_worker`. Values the protobuf message can carry but HTTP's request
models would refuse (a stop list longer than OpenAI's, a negative seed, an infinite temperature) are refused here
with the same bounds (`sampling_fields`), so both front ends admit the same requests.
"""

from __future__ import annotations

import math

from pdspark.errors import ErrorCode, InvalidRequestError, RequestFailed, as_request_failed
from pdspark.router.auth.auth_interceptor import authorization_of
from pdspark.router.openai.sampling_fields import (
    MAX_LOGIT_BIAS,
    MAX_PROMPT_CHARS,
    MAX_SEED,
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    MAX_TEMPERATURE,
)
from pdspark.router.prompt_work import too_long_for_context
from pdspark.router.router_core import RETRY_AFTER_S, RouterCore, Totals, clean_label
from pdspark.rpc import convert, status, tracing
from pdspark.types import SamplingParams
from pdspark.v1 import router_pb2, router_pb2_grpc

REQUEST_ID_KEY = "pdspark-request-id"  # initial metadata: the router's id of the request
RETRY_AFTER_KEY = "retry-after"  # trailing metadata of an OVERLOADED call: seconds, as HTTP's Retry-After


class RouterServicer(router_pb2_grpc.RouterServicer):
    def __init__(self, core: RouterCore):
        self.core = core

    async def Generate(self, request, context):
        core = self.core
        try:
            which = request.WhichOneof("prompt")
            text = request.text if which == "text" else None  # each read of the field copies it out of the message
            if text is not None:
                self._check_text(text)  # here: a text refused by its length need not wait for a thread
            # A long prompt is tokenized off the event loop: see `prompt_work`.
            weight = len(text) if text is not None else len(request.token_ids.ids) if which else 0
            ids = await core.prompt_work.run(weight, self._prompt, request, text)
            params = convert.sampling_from_pb(request.sampling)
            _check_bounds(params, core.model_config.vocab_size)
            if len(ids) + params.max_tokens > core.max_model_len:
                raise InvalidRequestError(f"prompt ({len(ids)} tokens) + `max_tokens` ({params.max_tokens}) exceeds "
                                          f"the maximum context length {core.max_model_len}")
            if not request.timeout_s >= 0 or math.isinf(request.timeout_s):  # `not >=`: NaN too
                raise InvalidRequestError(f"`timeout_s` must be a number of seconds >= 0 (0: the router's default), "
                                          f"not {request.timeout_s}")
        except InvalidRequestError as e:
            core.metrics.count_request("grpc", "invalid")
            await status.abort_async(context, as_request_failed(e))
        rid = core.new_request_id()
        label = clean_label(request.request_id)
        # The caller's own gRPC deadline bounds the request too (the SDK sets both to its `timeout`).
        asked = [t for t in (request.timeout_s, context.time_remaining()) if t is not None and t > 0]
        totals = Totals(len(ids))
        caller = core.keys.identify(authorization_of(context.invocation_metadata()))
        stream = core.run("grpc", rid, ids, params, totals, timeout_s=min(asked, default=None), label=label,
                          caller=caller, trace_parent=tracing.parent_of(context))
        try:
            await context.send_initial_metadata(((REQUEST_ID_KEY, rid),))
            async for chunk in stream:
                yield router_pb2.RouterGenerateChunk(
                    request_id=rid, client_request_id=label, token_ids=chunk.token_ids, text=chunk.text,
                    logprobs=[convert.logprob_to_pb(lp) for lp in chunk.logprobs], finished=chunk.finished,
                    finish_reason=convert.finish_reason_to_pb(chunk.finish_reason), prompt_tokens=totals.prompt_tokens,
                    completion_tokens=chunk.completion_tokens, cached_tokens=chunk.cached_tokens,
                    prefill_worker=chunk.prefill_worker, decode_worker=chunk.decode_worker,
                    prompt_logprobs=[convert.logprob_to_pb(lp) for lp in chunk.prompt_logprobs],
                )
        except RequestFailed as e:
            extra = ((RETRY_AFTER_KEY, str(RETRY_AFTER_S)),) if e.code is ErrorCode.OVERLOADED else ()
            await context.abort(status.status_of(e.code), e.message, trailing_metadata=status.trailers(e) + extra)
        finally:
            await stream.aclose()

    async def Abort(self, request, context):
        """Abort by the router's id of the request (what `Generate` told its caller); a client's label finds
        nothing."""
        return router_pb2.RouterAbortResponse(found=await self.core.abort_anywhere(request.request_id))

    def _check_text(self, text: str) -> None:
        """A text prompt's checks before it is tokenized: a tokenizer to do it, and a length that may fit."""
        if self.core.tokenizer is None:
            raise InvalidRequestError("this model has no tokenizer; send `token_ids`")
        if len(text) > MAX_PROMPT_CHARS:
            raise InvalidRequestError(f"`text` has {len(text)} characters; at most {MAX_PROMPT_CHARS}", "text")
        too_long = too_long_for_context("text", len(text), self.core.max_token_chars, self.core.max_model_len)
        if too_long is not None:
            raise InvalidRequestError(too_long, "text")

    def _prompt(self, request, text: str | None) -> list[int]:
        """The prompt's token ids, checked (`text`: the request's text prompt, checked by `_check_text`); reads its
        arguments and the core's fixed parts only (it may run on a thread of its own)."""
        which = request.WhichOneof("prompt")
        if which == "token_ids":
            ids = list(request.token_ids.ids)
        elif text is not None:
            assert self.core.tokenizer is not None  # `_check_text` refused a model without one
            ids = self.core.tokenizer.encode(text)
        else:
            raise InvalidRequestError("`prompt` is required: set `text` or `token_ids`")
        if not ids:
            raise InvalidRequestError("empty prompt: `text`/`token_ids` must give at least one token")
        vocab = self.core.model_config.vocab_size
        if any(not 0 <= t < vocab for t in ids):
            raise InvalidRequestError(f"`token_ids` must be in [0, {vocab})")
        return ids


def _check_bounds(params: SamplingParams, vocab_size: int) -> None:
    """The bounds HTTP's request models hold every request to, for what the protobuf message can carry beyond them."""
    if not params.temperature <= MAX_TEMPERATURE:  # `not <=`: NaN too
        raise InvalidRequestError(f"`temperature` must be in [0, {MAX_TEMPERATURE}], not {params.temperature}")
    if params.seed is not None and not 0 <= params.seed <= MAX_SEED:
        raise InvalidRequestError(f"`seed` must be in [0, {MAX_SEED}], not {params.seed}")
    stops = params.stop_strings
    if len(stops) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_CHARS for s in stops):
        raise InvalidRequestError(f"`stop`: at most {MAX_STOP_STRINGS} strings of at most {MAX_STOP_CHARS} "
                                  f"characters each")
    ids = params.stop_token_ids
    if len(ids) > MAX_STOP_TOKEN_IDS or any(t >= vocab_size for t in ids):
        raise InvalidRequestError(f"`stop_token_ids`: at most {MAX_STOP_TOKEN_IDS} token ids in [0, {vocab_size})")
    for name, tokens in (("logit_bias", list(params.logit_bias or ())), ("banned_token_ids", params.banned_token_ids)):
        if len(tokens) > MAX_LOGIT_BIAS or any(t >= vocab_size for t in tokens):
            raise InvalidRequestError(f"`{name}`: at most {MAX_LOGIT_BIAS} token ids in [0, {vocab_size})",
                                      field=name)
