"""`GenerateRequest`: the body of the native `POST /generate` (SGLang's shape: `text` or `input_ids`, and
`sampling_params` with `max_new_tokens`)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from pdspark.router.openai.sampling_fields import (
    MAX_INT32,
    MAX_LOGPROBS,
    MAX_NAME_CHARS,
    MAX_PROMPT_CHARS,
    MAX_PROMPT_TOKENS,
    STRICT,
    OneIntOnly,
    SamplingFields,
    TokenId,
)
from pdspark.types import MAX_STRUCTURED_CHARS


class GenerateSamplingParams(SamplingFields):
    n: OneIntOnly = Field(None, description="one output per request (`/v1/completions` takes `n`)")
    max_new_tokens: int | None = Field(None, ge=1, le=MAX_INT32)
    max_tokens: int | None = Field(None, ge=1, le=MAX_INT32, description="`max_new_tokens` wins when both are given")
    min_new_tokens: int | None = Field(None, ge=0, le=MAX_INT32,
                                       description="SGLang's `min_tokens`: `min_tokens` wins when both are given")
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    no_stop_trim: bool | None = Field(None, description="SGLang's `include_stop_str_in_output`")
    # SGLang's output constraints (at most one; `structured_fields`)
    json_schema: str | None = Field(None, max_length=MAX_STRUCTURED_CHARS, description="a JSON schema, as JSON text")
    regex: str | None = Field(None, max_length=MAX_STRUCTURED_CHARS)
    ebnf: str | None = Field(None, max_length=MAX_STRUCTURED_CHARS, description="an EBNF grammar (`root ::= ...`)")


class GenerateRequest(BaseModel):
    """Exactly one of `text` and `input_ids` (checked after validation, where the message can name both)."""

    model_config = ConfigDict(**STRICT, json_schema_extra={"anyOf": [{"required": ["text"]},
                                                                     {"required": ["input_ids"]}]})

    text: str | None = Field(None, max_length=MAX_PROMPT_CHARS)
    input_ids: list[TokenId] | None = Field(None, max_length=MAX_PROMPT_TOKENS)
    sampling_params: GenerateSamplingParams | None = None
    stream: bool | None = None
    rid: str | None = Field(None, min_length=1, max_length=MAX_NAME_CHARS,
                            description="the caller's label (the router mints the request id)")
