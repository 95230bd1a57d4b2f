"""`ChatCompletionRequest`: the body of `POST /v1/chat/completions`, with its `ChatMessage`s and their `TextPart`s."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, Tag, field_validator
from pydantic_core import PydanticCustomError

from pdspark.router.openai.openai_request import OpenAIRequest
from pdspark.router.openai.sampling_fields import MAX_INT32, MAX_LOGPROBS, MAX_PROMPT_CHARS, STRICT, by_json_type

MAX_MESSAGES = 2048
MAX_CONTENT_PARTS = 256


class TextPart(BaseModel):
    """One part of a message's content given as a list (guidellm's and the OpenAI SDK's multi-part form)."""

    model_config = STRICT

    type: Literal["text"]
    text: str = Field(max_length=MAX_PROMPT_CHARS)

    @field_validator("type", mode="before")
    @classmethod
    def _text_only(cls, value: Any) -> Any:
        # Named before the literal check so that an image or audio part is refused as what it is.
        if isinstance(value, str) and value != "text":
            raise PydanticCustomError("unsupported_content", "content parts of type `{got}` are not supported: this "
                                      "model reads text only; allowed: text", {"got": value[:64]})
        return value


Content = Annotated[
    Annotated[str, Field(max_length=MAX_PROMPT_CHARS), Tag("<text>")]
    | Annotated[list[TextPart], Field(min_length=1, max_length=MAX_CONTENT_PARTS), Tag("<parts>")],
    by_json_type("must be a string or a list of text parts", string="<text>", array="<parts>"),
]


class ChatMessage(BaseModel):
    model_config = STRICT

    role: Literal["system", "user", "assistant"]
    content: Content

    def text(self) -> str:
        """The content as one string; text parts are joined by newlines (as vLLM flattens them), so a single part
        renders exactly as the same text sent as a string."""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content)


class ChatCompletionRequest(OpenAIRequest):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    # OpenAI's current name for `max_tokens`; it wins when both are given.
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_INT32)
    logprobs: bool | None = Field(None, description="return the sampled tokens' log probabilities")
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS,
                                     description="with `logprobs`: this many most likely tokens at each position")
