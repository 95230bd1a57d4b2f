"""`CompletionRequest`: the body of `POST /v1/completions`."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BeforeValidator, Field, Tag
from pydantic_core import PydanticCustomError

from pdspark.router.openai.openai_request import OpenAIRequest
from pdspark.router.openai.sampling_fields import (
    MAX_LOGPROBS,
    MAX_PROMPT_CHARS,
    MAX_PROMPT_TOKENS,
    EmptyStringOnly,
    FalseOnly,
    OneIntOnly,
    TokenId,
    by_json_type,
)

PromptText = Annotated[str, Field(max_length=MAX_PROMPT_CHARS)]
PromptIds = Annotated[list[TokenId], Field(min_length=1, max_length=MAX_PROMPT_TOKENS)]


def _one_prompt(value: Any) -> Any:
    if isinstance(value, list) and len(value) > 1:
        raise PydanticCustomError("batch_unsupported", "a batch of {count} prompts is not supported: send one prompt "
                                  "per request", {"count": len(value)})
    return value



# One prompt, spelled any way OpenAI allows: text, token ids, or a batch of exactly one of either (the openai client
# sends `[text]` for a single string in some versions). A batch of several is one completion per prompt: refused,
# as `n` > 1 is.
Prompt = Annotated[
    Annotated[PromptText, Tag("<text>")]
    | Annotated[PromptIds, Tag("<token_ids>")]
    | Annotated[list[PromptText], BeforeValidator(_one_prompt), Field(min_length=1, max_length=1), Tag("<texts>")]
    | Annotated[list[PromptIds], BeforeValidator(_one_prompt), Field(min_length=1, max_length=1),
                Tag("<token_id_lists>")],
    by_json_type("must be a string or a list of token ids", string="<text>", array="<token_ids>",
                 strings="<texts>", arrays="<token_id_lists>"),
]


class CompletionRequest(OpenAIRequest):
    prompt: Prompt = Field(description="a string or a list of token ids (or a list holding one of either)")
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS,
                                 description="return the log probabilities of this many most likely tokens too")
    # Accepted only at their neutral value.
    echo: FalseOnly = None
    best_of: OneIntOnly = None
    suffix: EmptyStringOnly = None

    def prompt_value(self) -> str | list[int]:
        """The one prompt, unwrapped from a batch of one."""
        p = self.prompt
        return p[0] if isinstance(p, list) and isinstance(p[0], (str, list)) else p  # type: ignore[return-value]
