"""`SamplingFields`: the sampling values the OpenAI routes and `/generate` share, as a pydantic model, with the
bounds every request field is held to.

NOTE: models are strict (a JSON string is not a number, `1` is not `true`, `5.0` is not an integer) and bounded: an
out-of-range value is refused here, by the library, before any of it reaches a worker. The bounds come from the
wire (`common.proto`: `top_k`, `max_tokens` and token ids are int32, `seed` is int64), the engine's limits
(`SamplingParams`: logprobs up to 20, the penalties' ranges) and OpenAI's API (temperature up to 2; 16 stop strings
where OpenAI takes 4). Limits that depend on the served model (prompt + `max_tokens` within the context, token ids
within the vocabulary) are checked after validation, in `openai_protocol`. Unknown fields are ignored, as
OpenAI-compatible servers do.

Values the engine cannot honour are accepted only at their neutral setting (`n` and `best_of` of 1, `echo` false),
so a client that sends the default explicitly is served and one that asks for more is told which field it is.
"""

from __future__ import annotations

import json
from typing import Annotated, Any

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
)
from pydantic_core import PydanticCustomError

MAX_INT32 = 2**31 - 1  # `top_k`, `max_tokens`, token ids: int32 on the wire
MAX_SEED = 2**63 - 1  # int64 on the wire; the engine draws its own seeds below 2**63 as well
MAX_TEMPERATURE = 2.0
# `top_p` travels as a float32: a smaller positive value could arrive as 0, which the worker refuses. Any top_p this
# small keeps only the most likely token anyway.
MIN_TOP_P = 1e-6
MAX_LOGPROBS = 20  # `SamplingParams.logprobs`
MAX_STOP_STRINGS = 16  # (OpenAI's 4 is too few for lm-eval's humaneval, which sends 6)
MAX_STOP_CHARS = 1024
MAX_STOP_TOKEN_IDS = 64
# A prompt is bounded in tokens by the served model's context (checked after tokenizing); these bound what the router
# reads and tokenizes before that: DSV4's context is 1M tokens, and 4 characters per token is generous.
MAX_PROMPT_TOKENS = 1 << 20
MAX_PROMPT_CHARS = 4 << 20
MAX_NAME_CHARS = 256  # `model`, `user`, `rid`

STRICT = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)

TokenId = Annotated[int, Field(ge=0, le=MAX_INT32)]
MAX_CHOICES = 16  # `n` and `best_of`
MAX_LOGIT_BIAS = 4096  # entries of `logit_bias` (OpenAI allows 300) and of `banned_token_ids`
StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]


def by_json_type(message: str, *, string: str | None = None, array: str | None = None, strings: str | None = None,
                 arrays: str | None = None) -> Discriminator:
    """Pick a union member by the input's JSON type: the tag of the member for a string, an array (of numbers, or
    empty), an array of strings and an array of arrays. Any other input is refused with `message`.

    NOTE: union member tags appear in pydantic's error locations; they are written `<like this>` so that
    `api_error.param_of` can drop them and name the field as the client wrote it (`prompt[3]`)."""

    def pick(value: Any) -> str | None:
        if isinstance(value, str):
            return string
        if isinstance(value, list):
            first = value[0] if value else None
            if isinstance(first, str) and strings:
                return strings
            if isinstance(first, list) and arrays:
                return arrays
            return array
        return None

    return Discriminator(pick, custom_error_type="union_type", custom_error_message=message)


Stop = Annotated[
    Annotated[StopString, Tag("<string>")]
    | Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS), Tag("<list>")],
    by_json_type("must be a string or a list of strings", string="<string>", array="<list>"),
]


def neutral_only(neutral: float | bool | str | dict) -> BeforeValidator:
    """Accept a field this server does not implement only at its neutral value (or null). A value of another JSON
    type is left to the field's type check (a 422, not "unsupported")."""

    def check(value: Any) -> Any:
        if value is not None and _same_json_type(value, neutral) and value != neutral:
            raise PydanticCustomError("unsupported_value", "this server supports only {allowed} (or null)",
                                      {"allowed": json.dumps(neutral)})
        return value

    return BeforeValidator(check)


def _same_json_type(value: Any, like: Any) -> bool:
    if isinstance(like, bool) or isinstance(value, bool):
        return isinstance(value, bool) and isinstance(like, bool)
    if isinstance(like, (int, float)):
        return isinstance(value, (int, float))
    return isinstance(value, type(like))


def _top_k_not_zero(value: int | None) -> int | None:
    if value == 0:
        raise PydanticCustomError("top_k_zero", "0 would leave no token to sample; -1 or null turn the filter off, "
                                  "else use a value >= 1")
    return value


# Fields accepted only at their neutral value (or null); the inner bounds pin the schema to that value.
OneIntOnly = Annotated[Annotated[int, Field(ge=1, le=1)] | None, neutral_only(1)]
# NOTE: not `Literal[False]`, which takes 0 for false: the JSON value must be the boolean.
FalseOnly = Annotated[Annotated[bool, Field(json_schema_extra={"const": False})] | None, neutral_only(False)]
EmptyStringOnly = Annotated[Annotated[str, Field(max_length=0)] | None, neutral_only("")]

# -1 (vLLM's and SGLang's spelling) or null turn the filter off.
TopK = Annotated[int, Field(ge=-1, le=MAX_INT32), AfterValidator(_top_k_not_zero)]


class SamplingFields(BaseModel):
    """How to sample, as OpenAI, vLLM and SGLang clients spell it; `None` means the engine's default."""

    model_config = STRICT

    temperature: float | None = Field(None, ge=0, le=MAX_TEMPERATURE, description="0 is greedy")
    top_p: float | None = Field(None, ge=MIN_TOP_P, le=1)
    top_k: TopK | None = Field(None, description="-1 or null: no top-k filter",
                               json_schema_extra={"not": {"const": 0}})
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    stop: Stop | None = Field(None, description=f"up to {MAX_STOP_STRINGS} strings that end the generation")
    stop_token_ids: list[TokenId] | None = Field(None, max_length=MAX_STOP_TOKEN_IDS)
    ignore_eos: bool | None = None
    include_stop_str_in_output: bool | None = Field(None, description="keep the stop string that ended the text")
    n: int | None = Field(None, ge=1, le=MAX_CHOICES, description="choices per prompt (each its own seed, derived "
                          "from `seed`)")
    # The controls (`pdspark.engine.logits_controls`): applied to every sampled position, greedy included.
    presence_penalty: float | None = Field(None, ge=-2, le=2, description="minus this for each token already in the "
                                                                           "output")
    frequency_penalty: float | None = Field(None, ge=-2, le=2, description="minus this times each token's count in "
                                                                            "the output")
    repetition_penalty: float | None = Field(None, gt=0, le=2, description="tokens in the prompt or output: positive "
                                             "logits divided by this, negative ones multiplied (1: off)")
    min_p: float | None = Field(None, ge=0, le=1, description="drop tokens under this times the top token's "
                                                              "probability")
    min_tokens: int | None = Field(None, ge=0, le=MAX_INT32, description="no EOS or stop token id before this many "
                                                                         "tokens")
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100)]] | None = Field(
        None, max_length=MAX_LOGIT_BIAS, description="token id (as a string) -> added to its logit (-100 bans it)")
    banned_token_ids: list[TokenId] | None = Field(None, max_length=MAX_LOGIT_BIAS,
                                                   description="token ids never sampled (pdspark's extension)")

    def stop_strings(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
