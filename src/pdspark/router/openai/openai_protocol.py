"""The OpenAI-compatible protocol: requests (validated by the pydantic models `CompletionRequest`,
`ChatCompletionRequest` and `GenerateRequest`) become a `ParsedRequest` with explicit `SamplingParams`; responses
are built in OpenAI's shapes.

The models bound every field on their own; what depends on the served model is checked here: the model's name
(404), a prompt's text against the context by its length (before it is tokenized: see `prompt_work`), the tokenized
prompt against the vocabulary and the context, `max_tokens` against the room the prompt leaves. Parsing touches
nothing but its arguments, so the router may run it on a thread of its own (`PromptWork`). Errors are `ApiError`s
in OpenAI's shape (see `api_error` for the statuses).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, TypeVar

from pydantic import BaseModel, ValidationError

from pdspark.errors import InvalidRequestError
from pdspark.router.openai.api_error import ApiError, from_validation_error
from pdspark.router.openai.assistant_output import AssistantDelta, AssistantOutput
from pdspark.router.openai.chat_completion_request import ChatCompletionRequest
from pdspark.router.openai.chat_grammar import chat_constraint
from pdspark.router.openai.chat_prompt import ChatShape, chat_prompt
from pdspark.router.openai.completion_request import CompletionRequest
from pdspark.router.openai.generate_request import GenerateRequest, GenerateSamplingParams
from pdspark.router.openai.openai_request import StreamOptions
from pdspark.router.openai.sampling_fields import SamplingFields
from pdspark.router.openai.structured_fields import generate_structured_outputs, structured_outputs
from pdspark.router.prompt_work import too_long_for_context
from pdspark.router.random_id import uuid4_hex
from pdspark.types import FinishReason, SamplingParams, TokenLogprobs

if TYPE_CHECKING:
    from pdspark.model.tokenizer import Tokenizer
    from pdspark.router.openai.chat_template import ChatTemplate

__all__ = ["ApiError", "ParsedRequest", "ServedModel", "check_text_fits", "parse", "parse_chat", "parse_completion",
           "parse_generate", "validate"]

M = TypeVar("M", bound=BaseModel)

# Tokens generated when a request does not say: OpenAI's 16 for completions (and `/generate`); for chat, which
# OpenAI lets run to the end of the context, a bounded 256.
DEFAULT_MAX_TOKENS = 16
DEFAULT_CHAT_MAX_TOKENS = 256


@dataclass(frozen=True)
class ServedModel:
    """What a request is checked against beyond the models' own bounds."""

    name: str
    max_model_len: int
    vocab_size: int
    tokenizer: Tokenizer | None = None
    chat_template: ChatTemplate | None = None
    # The most characters one token stands for (`Tokenizer.max_token_chars`; None: no bound): what refuses a text
    # too long for the context before it is tokenized.
    max_token_chars: int | None = None


@dataclass(frozen=True)
class ParsedRequest:
    prompt_ids: list[int]  # the (first) prompt
    params: SamplingParams
    stream: bool
    include_usage: bool  # a last chunk with the usage
    continuous_usage: bool  # the usage so far in every chunk
    chat: bool
    logprobs: int | None
    n: int = 1  # choices per prompt
    best_of: int = 1  # candidates per prompt (>= n): the n with the highest cumulative logprob are returned
    batch: tuple[list[int], ...] = ()  # every prompt of a batch (empty: `prompt_ids` alone)
    echo: tuple[str, ...] | None = None  # with `echo`: each prompt's text, put before its choices' text
    shape: ChatShape = ChatShape()  # (chat) how the text is read: thinking, tool calls
    score_only: bool = False  # `max_tokens: 0` with `echo`: the prompt alone is returned (its logprobs)

    @property
    def prompts(self) -> list[list[int]]:
        return list(self.batch) if self.batch else [self.prompt_ids]

    @property
    def candidates(self) -> int:
        """Requests the router runs for it: `best_of` (or `n`) per prompt."""
        return len(self.prompts) * max(self.n, self.best_of)


# Candidates one request may fan out to (a batch of prompts times `best_of` or `n`).
MAX_CANDIDATES = 128


def choice_seed(seed: int | None, j: int) -> int | None:
    """Choice j's seed from the request's: the request's own for choice 0 (n = 1 draws what a plain request draws),
    a splitmix64 mix of the two for the others (distinct streams, the same every time). None stays None: each
    choice then gets the engine's fresh entropy."""
    if seed is None or j == 0:
        return seed
    z = (seed + j * 0x9E3779B97F4A7C15) & (2**64 - 1)
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & (2**64 - 1)
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & (2**64 - 1)
    return (z ^ (z >> 31)) & (2**63 - 1)


def _choices(n: int | None, best_of: int | None, stream: bool, prompts: int) -> tuple[int, int]:
    """(`n`, `best_of`) checked: best_of >= n, no best_of > n on a stream, the fan-out bounded."""
    n = n or 1
    best = best_of or n
    if best < n:
        raise ApiError(400, f"`best_of` ({best}) must be >= `n` ({n})", "best_of")
    if stream and best > n:
        raise ApiError(400, "`best_of` > `n` cannot be streamed: the best candidates are known only at the end",
                       "best_of")
    if prompts * best > MAX_CANDIDATES:
        param = "n" if best == n else "best_of"
        raise ApiError(400, f"`{param}`: {prompts} prompt(s) x {best} choices = {prompts * best} generations; allowed: "
                       f"at most {MAX_CANDIDATES} per request", param)
    return n, best


def validate(model: type[M], body: bytes | str | object) -> M:
    """`body` (raw JSON, or the decoded object) as `model`; raises `ApiError` naming the first bad field."""
    try:
        if isinstance(body, (bytes, bytearray, str)):
            return model.model_validate_json(body)
        return model.model_validate(body)
    except ValidationError as e:
        raise from_validation_error(e) from None


def parse(body: bytes | object, *, chat: bool, served_model: str, tokenizer, chat_template, max_model_len: int,
          vocab_size: int, max_token_chars: int | None = None) -> ParsedRequest:
    served = ServedModel(served_model, max_model_len, vocab_size, tokenizer, chat_template, max_token_chars)
    if chat:
        return parse_chat(validate(ChatCompletionRequest, body), served)
    return parse_completion(validate(CompletionRequest, body), served)


def parse_completion(req: CompletionRequest, served: ServedModel) -> ParsedRequest:
    check_model(req.model, served)
    values = req.prompt_values()
    n, best_of = _choices(req.n, req.best_of, bool(req.stream), len(values))
    prompts: list[list[int]] = []
    for i, prompt in enumerate(values):
        param = "prompt" if len(values) == 1 else f"prompt[{i}]"
        if isinstance(prompt, str):
            if served.tokenizer is None:
                raise ApiError(400, "this model has no tokenizer; send `prompt` as a list of token ids", "prompt")
            ids = _tokenize(prompt, served, param)
        else:
            ids = list(prompt)
        _check_prompt(ids, served, param)
        prompts.append(ids)
    score_only = req.max_tokens == 0
    if score_only and not req.echo:
        raise ApiError(400, "`max_tokens` 0 asks for the prompt alone: it needs `echo: true`", "max_tokens")
    # One token budget for every prompt: the longest must leave room for it. (`max_tokens: 0`: one token is generated
    # and dropped; the prompt's logprobs come with the first.)
    max_tokens = _max_tokens(1 if score_only else req.max_tokens, "max_tokens", DEFAULT_MAX_TOKENS,
                             max(map(len, prompts)), served)
    params = replace(_sampling(req, max_tokens, req.logprobs, served), structured_outputs=structured_outputs(req))
    echo = None
    if req.echo:
        echo = tuple(v if isinstance(v, str) else served.tokenizer.decode(list(v), skip_special_tokens=False)
                     if served.tokenizer is not None else "" for v in values)
        if req.logprobs is not None:  # the prompt's logprobs, computed by the prefill worker
            params = replace(params, prompt_logprobs=req.logprobs)
    return ParsedRequest(prompts[0], params, bool(req.stream), *_usage_options(req.stream_options), chat=False,
                         logprobs=req.logprobs, n=n, best_of=best_of,
                         batch=tuple(prompts) if len(prompts) > 1 else (), echo=echo, score_only=score_only)


def parse_chat(req: ChatCompletionRequest, served: ServedModel) -> ParsedRequest:
    check_model(req.model, served)
    if served.tokenizer is None or served.chat_template is None:
        raise ApiError(400, "this model has no tokenizer; use /v1/completions with token ids", "messages")
    prompt = chat_prompt(req, served.chat_template)
    # Counted once rendered: the template decides how much of the messages the prompt holds.
    ids = _tokenize(prompt.text, served, "messages")
    _check_prompt(ids, served, "messages")
    name, value = (("max_completion_tokens", req.max_completion_tokens) if req.max_completion_tokens is not None
                   else ("max_tokens", req.max_tokens))
    max_tokens = _max_tokens(value, name, DEFAULT_CHAT_MAX_TOKENS, len(ids), served)
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    n, _ = _choices(req.n, None, bool(req.stream), 1)
    base = structured_outputs(req)
    if base is not None and prompt.forced_tools:
        raise ApiError(400, "`tool_choice` forces a tool call, which leaves no room for a response format",
                       "tool_choice")
    constraint = chat_constraint(base, prompt.forced_tools, prompt.parallel_tool_calls, prompt.shape.thinking,
                                 req.thinking_budget)
    params = replace(_sampling(req, max_tokens, logprobs, served), structured_outputs=constraint)
    return ParsedRequest(ids, params, bool(req.stream), *_usage_options(req.stream_options), chat=True,
                         logprobs=logprobs, n=n, shape=prompt.shape)


def parse_generate(req: GenerateRequest, served: ServedModel) -> ParsedRequest:
    if req.text is not None and req.input_ids is not None:
        raise ApiError(400, "give `text` or `input_ids`, not both", "input_ids")
    if req.input_ids is not None:
        ids, param = list(req.input_ids), "input_ids"
    elif req.text is not None:
        if served.tokenizer is None:
            raise ApiError(400, "this model has no tokenizer; send `input_ids`", "text")
        ids, param = _tokenize(req.text, served, "text"), "text"
    else:
        raise ApiError(422, "`text` (a string) or `input_ids` (token ids) is required", "text", "missing")
    _check_prompt(ids, served, param)
    sp = req.sampling_params or GenerateSamplingParams.model_validate({})
    name, value = (("max_new_tokens", sp.max_new_tokens) if sp.max_new_tokens is not None
                   else ("max_tokens", sp.max_tokens))
    max_tokens = _max_tokens(value, f"sampling_params.{name}", DEFAULT_MAX_TOKENS, len(ids), served)
    if sp.min_tokens is None and sp.min_new_tokens is not None:
        sp = sp.model_copy(update={"min_tokens": sp.min_new_tokens})
    if sp.include_stop_str_in_output is None and sp.no_stop_trim is not None:
        sp = sp.model_copy(update={"include_stop_str_in_output": sp.no_stop_trim})
    params = replace(_sampling(sp, max_tokens, sp.logprobs, served, prefix="sampling_params."),
                     structured_outputs=generate_structured_outputs(sp.json_schema, sp.regex, sp.ebnf))
    return ParsedRequest(ids, params, bool(req.stream), False, False, chat=False, logprobs=sp.logprobs)


def check_model(name: str | None, served: ServedModel) -> None:
    if name is not None and name != served.name:
        raise ApiError(404, f"`model`: the model `{name}` does not exist; this server serves `{served.name}`", "model",
                       "model_not_found")


def check_text_fits(text: object, served: ServedModel, param: str) -> None:
    """Refuse a text prompt (`text` of any other type: nothing to check) that cannot fit the context by its length
    alone. Cheap: the router does it before a long prompt waits for a thread to tokenize it (`PromptWork`)."""
    if isinstance(text, str):
        too_long = too_long_for_context(param, len(text), served.max_token_chars, served.max_model_len)
        if too_long is not None:
            raise ApiError(400, too_long, param, "context_length_exceeded")


def _tokenize(text: str, served: ServedModel, param: str) -> list[int]:
    """`text`'s tokens; a text too long for the context is refused by its length first, untokenized."""
    assert served.tokenizer is not None  # the callers refused a model without one
    check_text_fits(text, served, param)
    return served.tokenizer.encode(text)


def _check_prompt(ids: list[int], served: ServedModel, param: str) -> None:
    if not ids:
        raise ApiError(400, f"`{param}` is empty: the prompt must contain at least one token", param)
    bad = [t for t in ids if not 0 <= t < served.vocab_size]
    if bad:
        raise ApiError(400, f"`{param}`: token ids {bad[:5]} are outside the vocabulary [0, {served.vocab_size})",
                       param)
    if len(ids) >= served.max_model_len:
        raise ApiError(400, f"This model's maximum context length is {served.max_model_len} tokens; the prompt "
                       f"(`{param}`) has {len(ids)}, which leaves no room to generate", param,
                       "context_length_exceeded")


def _max_tokens(value: int | None, param: str, default: int, prompt_len: int, served: ServedModel) -> int:
    room = served.max_model_len - prompt_len
    if value is None:
        return min(default, room)
    if value > room:
        raise ApiError(400, f"`{param}` must be between 1 and {room}: this model's maximum context length is "
                       f"{served.max_model_len} tokens and the prompt has {prompt_len}", param,
                       "context_length_exceeded")
    return value


def _sampling(fields: SamplingFields, max_tokens: int, logprobs: int | None, served: ServedModel,
              prefix: str = "") -> SamplingParams:
    stop_ids = fields.stop_token_ids or []
    bad = [t for t in stop_ids if t >= served.vocab_size]
    if bad:
        raise ApiError(400, f"`{prefix}stop_token_ids`: token ids {bad[:5]} are outside the vocabulary "
                       f"[0, {served.vocab_size})", f"{prefix}stop_token_ids")
    bias: dict[int, float] = {}
    for key, value in (fields.logit_bias or {}).items():
        token = int(key) if key.isdigit() else -1
        if not 0 <= token < served.vocab_size:
            raise ApiError(400, f"`{prefix}logit_bias`: key {key[:32]!r} is not a token id in [0, {served.vocab_size})",
                           f"{prefix}logit_bias")
        bias[token] = value
    banned = fields.banned_token_ids or []
    if any(t >= served.vocab_size for t in banned):
        raise ApiError(400, f"`{prefix}banned_token_ids`: token ids outside the vocabulary [0, {served.vocab_size})",
                       f"{prefix}banned_token_ids")
    try:
        return SamplingParams(
            temperature=1.0 if fields.temperature is None else fields.temperature,
            top_p=1.0 if fields.top_p is None else fields.top_p,
            top_k=None if fields.top_k in (None, -1) else fields.top_k,
            seed=fields.seed,
            max_tokens=max_tokens,
            stop=fields.stop_strings(),
            stop_token_ids=tuple(stop_ids),
            ignore_eos=bool(fields.ignore_eos),
            include_stop_str_in_output=bool(fields.include_stop_str_in_output),
            logprobs=logprobs,
            presence_penalty=fields.presence_penalty or 0.0,
            frequency_penalty=fields.frequency_penalty or 0.0,
            repetition_penalty=1.0 if fields.repetition_penalty is None else fields.repetition_penalty,
            min_p=fields.min_p or 0.0,
            min_tokens=fields.min_tokens or 0,
            logit_bias=bias or None,
            banned_token_ids=tuple(banned),
        )
    except InvalidRequestError as e:  # the models' bounds are at least as tight; kept as a backstop
        raise ApiError(400, str(e), f"{prefix}{e.field}" if e.field else None) from e


def _usage_options(options: StreamOptions | None) -> tuple[bool, bool]:
    if options is None:
        return False, False
    return bool(options.include_usage), bool(options.continuous_usage_stats)


# ---- responses ----------------------------------------------------------------------------------------------------
def new_id(chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + uuid4_hex()[:24]


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


def echo_logprobs_json(prompt_ids: list[int], prompt_lps: tuple[TokenLogprobs, ...], lps: list[TokenLogprobs],
                       tokenizer) -> dict:
    """OpenAI's legacy `logprobs` of an echoed completion: the prompt's tokens first (the first with null logprob and
    top_logprobs: nothing predicts it), then the completion's."""
    body = logprobs_json(lps, tokenizer, chat=False) or {"tokens": [], "token_logprobs": [], "top_logprobs": []}
    prompt = logprobs_json([TokenLogprobs(t, 0.0, {}) for t in prompt_ids], tokenizer, chat=False)
    assert prompt is not None  # (a prompt has a token)
    return {"tokens": prompt["tokens"] + body["tokens"],
            "token_logprobs": [None, *(lp.logprob for lp in prompt_lps), *body["token_logprobs"]],
            "top_logprobs": [None, *(logprobs_json([lp], tokenizer, chat=False)["top_logprobs"][0]  # type: ignore[index]
                                     for lp in prompt_lps), *body["top_logprobs"]]}


def completion_body(rid: str, model: str, chat: bool, text: str, reason: FinishReason | None,
                    logprobs: dict | None, use: dict | None, stream: bool, first: bool = False,
                    index: int = 0, reader: AssistantOutput | None = None) -> dict:
    """A completion (or one streamed chunk of one) in OpenAI's shape, with one choice (`index`)."""
    body: dict[str, Any] = {"id": rid, "object": ("chat.completion.chunk" if stream else "chat.completion") if chat else
            "text_completion", "created": int(time.time()), "model": model,
            "choices": [choice(chat, text, reason, logprobs, stream, first, index, reader)]}
    if use is not None:
        body["usage"] = use
    return body


def choice(chat: bool, text: str, reason: FinishReason | None, logprobs: dict | None, stream: bool,
           first: bool = False, index: int = 0, reader: AssistantOutput | None = None) -> dict:
    """One choice of a completion (or of a streamed chunk) in OpenAI's shape. `reader` (chat): the choice's
    `AssistantOutput` when its text is read for thinking and tool calls; fed `text` here (the whole text, or this
    chunk's), and finished with the last chunk."""
    finish = reason.value if reason is not None else None
    if not chat:
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}
    if reader is None:
        if stream:
            delta = {"role": "assistant", "content": text} if first else {"content": text}
            return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        return {"index": index, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
                "finish_reason": finish}
    part = reader.feed(text)
    if reason is not None:
        part.add(reader.finish())
    if reason is FinishReason.STOP and reader.calls:
        finish = "tool_calls"
    if stream:
        return {"index": index, "delta": _delta(part, first), "logprobs": logprobs, "finish_reason": finish}
    message: dict[str, Any] = {"role": "assistant", "content": reader.content or (None if reader.calls else "")}
    if reader.thinking:
        message["reasoning_content"] = reader.reasoning
    if reader.calls:
        message["tool_calls"] = [c.openai() for c in reader.calls]
    return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish}


def assistant_reader(shape: ChatShape) -> AssistantOutput | None:
    """A choice's reader of its text, for a chat request whose text holds thinking or tool calls."""
    return None if shape.plain else AssistantOutput(shape.thinking, shape.tools)


def _delta(part: AssistantDelta, first: bool) -> dict:
    delta: dict[str, Any] = {"role": "assistant"} if first else {}
    if part.reasoning:
        delta["reasoning_content"] = part.reasoning
    if part.content or (first and not part):
        delta["content"] = part.content
    if part.tool_calls:
        delta["tool_calls"] = part.tool_calls
    return delta


def usage_chunk(rid: str, model: str, chat: bool, use: dict) -> dict:
    """The last chunk of a stream with `stream_options.include_usage`: no choices, the request's usage."""
    return {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": int(time.time()),
            "model": model, "choices": [], "usage": use}
