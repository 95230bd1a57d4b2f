"""OpenAI-compatible request validation and response shapes (completions, chat completions).

Errors follow OpenAI's error object, `{"error": {"message", "type", "param", "code"}}`, with status:
400 malformed JSON or a value out of range (the message names the field and the allowed values), 404 an unknown
model, 422 a field of the wrong type.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass

from pdspark.errors import InvalidRequestError
from pdspark.types import FinishReason, SamplingParams, TokenLogprobs


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type_: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type_

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


@dataclass(frozen=True)
class ParsedRequest:
    prompt_ids: list[int]
    params: SamplingParams
    stream: bool
    include_usage: bool
    chat: bool
    logprobs: int | None


_UNSUPPORTED_NONZERO = ("presence_penalty", "frequency_penalty")


def _typed(body: dict, name: str, kinds: tuple, default=None, allow_none: bool = True):
    value = body.get(name, default)
    if value is None and allow_none:
        return default
    if isinstance(value, bool) and bool not in kinds:
        raise ApiError(422, f"`{name}` must be of type {' or '.join(k.__name__ for k in kinds)}", name)
    if not isinstance(value, kinds):
        raise ApiError(422, f"`{name}` must be of type {' or '.join(k.__name__ for k in kinds)}", name)
    return value


def check_model(body: dict, served: str) -> None:
    model = _typed(body, "model", (str,), default=served)
    if model != served:
        raise ApiError(404, f"The model `{model}` does not exist; this server serves `{served}`", "model",
                       "model_not_found")


def parse(body: object, *, chat: bool, served_model: str, tokenizer, chat_template, max_model_len: int,
          vocab_size: int) -> ParsedRequest:
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    check_model(body, served_model)
    prompt_ids = _chat_prompt(body, tokenizer, chat_template) if chat else _completion_prompt(body, tokenizer)
    if not prompt_ids:
        raise ApiError(400, "the prompt is empty: it must contain at least one token",
                       "messages" if chat else "prompt")
    bad = [t for t in prompt_ids if not 0 <= t < vocab_size]
    if bad:
        raise ApiError(400, f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab_size})", "prompt")
    room = max_model_len - len(prompt_ids)
    if room < 1:
        raise ApiError(400, f"This model's maximum context length is {max_model_len} tokens; the prompt has "
                       f"{len(prompt_ids)}", "messages" if chat else "prompt", "context_length_exceeded")
    max_tokens = _typed(body, "max_completion_tokens" if chat and "max_completion_tokens" in body else "max_tokens",
                        (int,), default=min(256, room) if chat else 16)
    if max_tokens < 1 or max_tokens > room:
        raise ApiError(400, f"`max_tokens` must be between 1 and {room} (this model's maximum context length is "
                       f"{max_model_len} tokens and the prompt has {len(prompt_ids)})", "max_tokens",
                       "context_length_exceeded" if max_tokens > room else None)
    n = _typed(body, "n", (int,), default=1)
    if n != 1:
        raise ApiError(400, "`n` must be 1 (one completion per request)", "n")
    for name in _UNSUPPORTED_NONZERO:
        if _typed(body, name, (int, float), default=0):
            raise ApiError(400, f"`{name}` is not supported; allowed: 0", name)
    if not chat and _typed(body, "echo", (bool,), default=False):
        raise ApiError(400, "`echo` is not supported; allowed: false", "echo")
    stop = _typed(body, "stop", (str, list), default=[])
    stops = [stop] if isinstance(stop, str) else stop
    if len(stops) > 4 or not all(isinstance(s, str) and s for s in stops):
        raise ApiError(400, "`stop` must be a non-empty string or a list of up to 4 of them", "stop")
    logprobs = _logprobs(body, chat)
    stream = _typed(body, "stream", (bool,), default=False)
    options = _typed(body, "stream_options", (dict,), default={})
    try:
        params = SamplingParams(
            temperature=float(_typed(body, "temperature", (int, float), default=1.0)),
            top_p=float(_typed(body, "top_p", (int, float), default=1.0)),
            top_k=_top_k(body),
            seed=_typed(body, "seed", (int,)),
            max_tokens=max_tokens,
            stop=tuple(stops),
            ignore_eos=_typed(body, "ignore_eos", (bool,), default=False),
            logprobs=logprobs,
        )
    except InvalidRequestError as e:
        raise ApiError(400, str(e), e.field) from e
    if params.temperature > 2:
        raise ApiError(400, f"invalid `temperature` = {params.temperature}; allowed: 0 to 2", "temperature")
    return ParsedRequest(prompt_ids, params, stream, bool(options.get("include_usage", False)), chat, logprobs)


def _top_k(body: dict) -> int | None:
    """`top_k` absent, null or -1 means no top-k filter (-1 is how vLLM and SGLang clients spell "off")."""
    top_k = _typed(body, "top_k", (int,))
    return None if top_k == -1 else top_k


def _completion_prompt(body: dict, tokenizer) -> list[int]:
    if "prompt" not in body:
        raise ApiError(422, "`prompt` is required", "prompt")
    prompt = body["prompt"]
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ApiError(400, "this model has no tokenizer; send `prompt` as a list of token ids", "prompt")
        return tokenizer.encode(prompt)
    if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return list(prompt)
    raise ApiError(422, "`prompt` must be a string or a list of token ids", "prompt")


def _chat_prompt(body: dict, tokenizer, chat_template) -> list[int]:
    messages = body.get("messages")
    if not isinstance(messages, list):
        raise ApiError(422, "`messages` must be a list of {role, content} objects", "messages")
    if not messages:
        raise ApiError(400, "`messages` must not be empty", "messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant"):
            raise ApiError(400, f"`messages[{i}].role` must be one of system, user, assistant", f"messages[{i}].role")
        if not isinstance(m.get("content"), str):
            raise ApiError(422, f"`messages[{i}].content` must be a string", f"messages[{i}].content")
    if tokenizer is None:
        raise ApiError(400, "this model has no tokenizer; use /v1/completions with token ids", "messages")
    return tokenizer.encode(chat_template.render(messages))


def _logprobs(body: dict, chat: bool) -> int | None:
    if chat:
        if not _typed(body, "logprobs", (bool,), default=False):
            return None
        top = _typed(body, "top_logprobs", (int,), default=0)
        if not 0 <= top <= 20:
            raise ApiError(400, "`top_logprobs` must be between 0 and 20", "top_logprobs")
        return top
    value = _typed(body, "logprobs", (int,))
    if value is not None and not 0 <= value <= 5:
        raise ApiError(400, "`logprobs` must be between 0 and 5", "logprobs")
    return value


# ---- responses ----------------------------------------------------------------------------------------------------
def new_id(chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]


def usage(prompt: int, completion: int, cached: int) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def logprobs_json(lps: list[TokenLogprobs], tokenizer, chat: bool) -> dict | None:
    if not lps:
        return None

    def tok(t: int) -> str:
        return tokenizer.decode([t], skip_special_tokens=False) if tokenizer is not None else str(t)

    if chat:
        return {"content": [{"token": tok(lp.token_id), "logprob": lp.logprob,
                             "top_logprobs": [{"token": tok(t), "logprob": v} for t, v in lp.top.items()]}
                            for lp in lps]}
    return {"tokens": [tok(lp.token_id) for lp in lps], "token_logprobs": [lp.logprob for lp in lps],
            "top_logprobs": [{tok(t): v for t, v in lp.top.items()} for lp in lps]}


def completion_body(rid: str, model: str, chat: bool, text: str, reason: FinishReason | None,
                    logprobs: dict | None, use: dict | None, stream: bool, first: bool = False) -> dict:
    """A completion (or one streamed chunk of one) in OpenAI's shape."""
    finish = reason.value if reason is not None else None
    if chat:
        if stream:
            delta = {"role": "assistant", "content": text} if first else {"content": text}
            choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        else:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
                      "finish_reason": finish}
        obj = "chat.completion.chunk" if stream else "chat.completion"
    else:
        choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}
        obj = "text_completion"
    body = {"id": rid, "object": obj, "created": int(time.time()), "model": model, "choices": [choice]}
    if use is not None:
        body["usage"] = use
    return body
