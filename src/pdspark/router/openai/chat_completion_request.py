"""`ChatCompletionRequest`: the body of `POST /v1/chat/completions`, with its `ChatMessage`s and their `TextPart`s,
its tools (`ToolDefinition`, `tool_choice`) and its thinking switches."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, Tag, ValidationInfo, field_validator
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


MAX_TOOLS = 128
FUNCTION_NAME = r"^[A-Za-z0-9_.:-]{1,64}$"  # (OpenAI's, with `.` and `:` for namespaced tools)


class CalledFunction(BaseModel):
    model_config = STRICT

    name: str = Field(pattern=FUNCTION_NAME)
    arguments: str = Field(max_length=MAX_PROMPT_CHARS, description="the arguments as JSON text")


class MessageToolCall(BaseModel):
    """A tool call of an earlier assistant turn, sent back as history."""

    model_config = STRICT

    id: str | None = Field(None, max_length=256)
    type: Literal["function"] = "function"
    function: CalledFunction


_HAS_CALLS: dict[str, Any] = {"required": ["role", "tool_calls"],
                              "properties": {"role": {"const": "assistant"},
                                             "tool_calls": {"type": "array", "minItems": 1}}}


class ChatMessage(BaseModel):
    # The checks of the validators below, for `/openapi.json`: content unless an assistant message with calls; calls
    # only on an assistant message.
    model_config = ConfigDict(**STRICT, json_schema_extra={"allOf": [
        {"anyOf": [{"required": ["content"], "properties": {"content": {"not": {"type": "null"}}}}, _HAS_CALLS]},
        {"anyOf": [{"not": {"required": ["tool_calls"]}}, {"properties": {"tool_calls": {"maxItems": 0}}},
                   {"properties": {"tool_calls": {"type": "null"}}}, {"properties": {"role": {"const": "assistant"}}}]},
    ]})

    role: Literal["system", "user", "assistant", "tool"]
    tool_calls: list[MessageToolCall] | None = Field(None, max_length=MAX_TOOLS)
    tool_call_id: str | None = Field(None, max_length=256, description="role tool: the call this result answers")
    reasoning_content: str | None = Field(None, max_length=MAX_PROMPT_CHARS,
                                          description="an assistant turn's thinking (not put back in the prompt)")
    # (declared after `role` and `tool_calls`, which its check reads)
    content: Content | None = Field(None, validate_default=True,
                                    description="required, but for an assistant message with `tool_calls`")

    @field_validator("tool_calls")
    @classmethod
    def _calls_are_the_assistants(cls, value: Any, info: ValidationInfo) -> Any:
        if value and info.data.get("role") != "assistant":
            raise PydanticCustomError("tool_calls_role", "only an assistant message has `tool_calls`")
        return value

    @field_validator("content")
    @classmethod
    def _content_given(cls, value: Any, info: ValidationInfo) -> Any:
        if value is None and not (info.data.get("role") == "assistant" and info.data.get("tool_calls")):
            raise PydanticCustomError("missing", "required (it may be absent or null only on an assistant message "
                                      "with `tool_calls`)")
        return value

    def text(self) -> str:
        """The content as one string; text parts are joined by newlines (as vLLM flattens them), so a single part
        renders exactly as the same text sent as a string."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content)


class FunctionDefinition(BaseModel):
    model_config = STRICT

    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = Field(None, max_length=MAX_PROMPT_CHARS)
    parameters: dict[str, Any] | None = Field(None, description="a JSON schema of the arguments (an object)")
    strict: bool | None = Field(None, description="accepted; forced calls always follow the schema")


class ToolDefinition(BaseModel):
    model_config = STRICT

    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(BaseModel):
    model_config = STRICT

    name: str = Field(pattern=FUNCTION_NAME)


class NamedToolChoice(BaseModel):
    model_config = STRICT

    type: Literal["function"]
    function: NamedFunction


class ThinkingOption(BaseModel):
    """DeepSeek's API spelling: `{"type": "enabled"}`."""

    model_config = STRICT

    type: Literal["enabled", "disabled"]


class ChatCompletionRequest(OpenAIRequest):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    # OpenAI's current name for `max_tokens`; it wins when both are given.
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_INT32)
    logprobs: bool | None = Field(None, description="return the sampled tokens' log probabilities")
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS,
                                     description="with `logprobs`: this many most likely tokens at each position")
    tools: list[ToolDefinition] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None, description="auto (the default with tools): the model decides and its calls are parsed; required or a "
        "named function: a call is enforced by the grammar")
    parallel_tool_calls: bool | None = Field(None, description="several calls in one turn (default true)")
    # Thinking, as DeepSeek's API, SGLang and vLLM clients switch it on: any of these.
    chat_template_kwargs: dict[str, Any] | None = Field(
        None, description="passed to the chat template; `thinking` or `enable_thinking` switch thinking on")
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = Field(
        None, description="any but none switches thinking on")
    thinking: ThinkingOption | None = None
    enable_thinking: bool | None = None
    thinking_budget: int | None = Field(None, ge=1, le=MAX_INT32, description="at most this many thinking tokens "
                                        "(then `</think>` is forced)")
