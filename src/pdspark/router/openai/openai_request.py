"""`OpenAIRequest`: what `/v1/completions` and `/v1/chat/completions` requests share beyond sampling (the model,
streaming and its options, the token budget, the caller's label, the output constraint)."""

from __future__ import annotations

from pydantic import BaseModel, Field

from pdspark.router.openai.sampling_fields import MAX_INT32, MAX_NAME_CHARS, STRICT, SamplingFields
from pdspark.router.openai.structured_fields import StructuredFields


class StreamOptions(BaseModel):
    model_config = STRICT

    include_usage: bool | None = Field(None, description="a last chunk with the request's usage")
    # vLLM's extension, which guidellm sends: the usage so far in every chunk.
    continuous_usage_stats: bool | None = Field(None, description="the usage so far in every chunk")


class OpenAIRequest(SamplingFields, StructuredFields):
    model: str | None = Field(None, max_length=MAX_NAME_CHARS, description="the served model's name (or absent)")
    max_tokens: int | None = Field(None, ge=1, le=MAX_INT32,
                                   description="tokens to generate; the prompt and these must fit the context")
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    user: str | None = Field(None, max_length=MAX_NAME_CHARS,
                             description="the caller's label: logged and echoed in X-Request-Id")
