"""`TokenizeRequest` and `DetokenizeRequest`: the bodies of `POST /tokenize` and `POST /detokenize`, in vLLM's shapes
(what lm-evaluation-harness's `tokenizer_backend=remote` sends: `{"prompt", "add_special_tokens"}` and
`{"tokens"}`)."""

from __future__ import annotations

from pydantic import BaseModel, Field

from pdspark.router.openai.chat_completion_request import MAX_MESSAGES, ChatMessage
from pdspark.router.openai.sampling_fields import MAX_NAME_CHARS, MAX_PROMPT_CHARS, MAX_PROMPT_TOKENS, STRICT, TokenId


class TokenizeRequest(BaseModel):
    """A text (`prompt`) or chat messages (`messages`, rendered with the model's chat template), not both."""

    model_config = STRICT

    model: str | None = Field(None, max_length=MAX_NAME_CHARS, description="the served model's name (or absent)")
    prompt: str | None = Field(None, max_length=MAX_PROMPT_CHARS, description="a text to tokenize")
    messages: list[ChatMessage] | None = Field(None, min_length=1, max_length=MAX_MESSAGES,
                                               description="chat messages, tokenized as the chat route renders them")
    add_special_tokens: bool | None = Field(
        None, description="the tokenizer's special tokens around the text (default: true for `prompt`, false for "
                          "`messages`, whose template writes its own)")
    add_generation_prompt: bool = Field(True, description="with `messages`: the assistant turn's opening, as the "
                                                          "chat route renders it")
    return_token_strs: bool = Field(False, description="each token's string too (`token_strs`)")


class DetokenizeRequest(BaseModel):
    model_config = STRICT

    model: str | None = Field(None, max_length=MAX_NAME_CHARS, description="the served model's name (or absent)")
    tokens: list[TokenId] = Field(max_length=MAX_PROMPT_TOKENS, description="token ids to turn back into text")
