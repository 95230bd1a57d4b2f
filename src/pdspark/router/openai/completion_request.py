"""`CompletionRequest`: the body of `POST /v1/completions`."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BeforeValidator, Field, Tag
from pydantic_core import PydanticCustomError

from pdspark.router.openai.openai_request import OpenAIRequest
from pdspark.router.openai.sampling_fields import (
    MAX_CHOICES,
    MAX_INT32,
    MAX_LOGPROBS,
    MAX_PROMPT_CHARS,
    MAX_PROMPT_TOKENS,
    EmptyStringOnly,
    TokenId,
    by_json_type,
)

PromptText = Annotated[str, Field(max_length=MAX_PROMPT_CHARS)]
PromptIds = Annotated[list[TokenId], Field(min_length=1, max_length=MAX_PROMPT_TOKENS)]


MAX_BATCH_PROMPTS = 64  # prompts in one request (each `n` choices, `MAX_CHOICES` candidates at most in all)


def _batch_size(value: Any) -> Any:
    if isinstance(value, list) and len(value) > MAX_BATCH_PROMPTS:
        raise PydanticCustomError("batch_too_large", "a batch of {count} prompts; allowed: at most {limit}",
                                  {"count": len(value), "limit": MAX_BATCH_PROMPTS})
    return value


# The prompt(s), spelled any way OpenAI allows: text, token ids, or a batch of either (one completion per prompt, each
# with `n` choices; the openai client sends `[text]` for a single string in some versions).
Prompt = Annotated[
    Annotated[PromptText, Tag("<text>")]
    | Annotated[PromptIds, Tag("<token_ids>")]
    | Annotated[list[PromptText], BeforeValidator(_batch_size), Field(min_length=1, max_length=MAX_BATCH_PROMPTS),
                Tag("<texts>")]
    | Annotated[list[PromptIds], BeforeValidator(_batch_size), Field(min_length=1, max_length=MAX_BATCH_PROMPTS),
                Tag("<token_id_lists>")],
    by_json_type("must be a string or a list of token ids (or a list of either)", string="<text>",
                 array="<token_ids>", strings="<texts>", arrays="<token_id_lists>"),
]


class CompletionRequest(OpenAIRequest):
    prompt: Prompt = Field(description="a string or a list of token ids, or a batch (a list) of either")
    max_tokens: int | None = Field(None, ge=0, le=MAX_INT32, description="tokens to generate; the prompt and these "
                                   "must fit the context; 0 with `echo`: the prompt (and its logprobs) only")
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS,
                                 description="return the log probabilities of this many most likely tokens too")
    best_of: int | None = Field(None, ge=1, le=MAX_CHOICES, description="candidates per prompt (>= n), the n with the "
                                "highest cumulative logprob returned; not with `stream`")
    # NOTE: not `Literal`/`bool` coercion: the JSON value must be the boolean.
    echo: bool | None = Field(None, description="the prompt before the completion in `text`, and with `logprobs` its "
                              "tokens' logprobs first (the first null); streamed, in each choice's first chunk")
    # Accepted only at its neutral value.
    suffix: EmptyStringOnly = None

    def prompt_values(self) -> list[str | list[int]]:
        """Every prompt of the request (one, unless it is a batch)."""
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            return list(p)  # type: ignore[arg-type]
        return [p]  # type: ignore[list-item]
