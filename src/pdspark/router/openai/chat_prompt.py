"""`chat_prompt`: a chat request's messages, tools and thinking switch as the prompt text, with what the output
must be read for (`ChatShape`) and the functions a call is forced to (`tool_choice`).

- Tools (unless `tool_choice` is none) are described in the system prompt in DSV4's format (`dsml_format`); an
  assistant turn's `tool_calls` are written back as the model wrote them; `role: tool` results go into the next user
  turn. A chat template that reads `tools` itself gets them (and the messages unchanged) instead.
- Thinking (`chat_template_kwargs.thinking` / `enable_thinking`, `thinking: {"type": "enabled"}`, `enable_thinking`,
  a `reasoning_effort` other than none): the prompt ends with `<think>` (unless the template already put it there),
  and the output is read as reasoning up to `</think>`. `chat_template_kwargs` also reach the template.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pdspark.router.openai.api_error import ApiError
from pdspark.router.openai.chat_completion_request import ChatCompletionRequest, ChatMessage, NamedToolChoice
from pdspark.router.openai.dsml_format import THINK_BEGIN, calls_block, results_block, tools_section
from pdspark.router.openai.structured_fields import json_object

if TYPE_CHECKING:
    from pdspark.router.openai.chat_template import ChatTemplate


@dataclass(frozen=True)
class ChatShape:
    """How a chat completion's text is read (`AssistantOutput`): from inside its thinking, and/or for call blocks."""

    thinking: bool = False
    tools: bool = False

    @property
    def plain(self) -> bool:
        return not (self.thinking or self.tools)


@dataclass(frozen=True)
class ChatPrompt:
    text: str
    shape: ChatShape
    forced_tools: list[dict[str, Any]] | None  # the functions a call must be made to (None: not forced)
    parallel_tool_calls: bool


def chat_prompt(req: ChatCompletionRequest, template: ChatTemplate) -> ChatPrompt:
    functions = [t.function.model_dump(exclude_none=True) for t in req.tools or []]
    choice = req.tool_choice if req.tool_choice is not None else "auto"
    forced = _forced(choice, functions)
    offered = functions if choice != "none" else []
    kwargs = dict(req.chat_template_kwargs or {})
    if offered and "tools" in template.source:  # the template renders tools itself
        messages = [m.model_dump(exclude_none=True) for m in req.messages]
        text = template.render(messages, tools=[{"type": "function", "function": f} for f in offered], **kwargs)
    else:
        text = template.render(_template_messages(req.messages, offered), **kwargs)
    thinking = thinking_on(req)
    if thinking and not text.rstrip().endswith(THINK_BEGIN):
        text += THINK_BEGIN
    return ChatPrompt(text, ChatShape(thinking, bool(offered)), forced, req.parallel_tool_calls is not False)


def thinking_on(req: ChatCompletionRequest) -> bool:
    kwargs = req.chat_template_kwargs or {}
    for key in ("thinking", "enable_thinking"):
        if key in kwargs:
            return bool(kwargs[key])
    if req.thinking is not None:
        return req.thinking.type == "enabled"
    if req.enable_thinking is not None:
        return req.enable_thinking
    return req.reasoning_effort is not None and req.reasoning_effort != "none"


def _forced(choice: object, functions: list[dict[str, Any]]) -> list[dict[str, Any]] | None:
    if (choice == "required" or isinstance(choice, NamedToolChoice)) and not functions:
        raise ApiError(400, "`tool_choice` forces a call but no `tools` are given", "tool_choice")
    if choice == "required":
        return functions
    if isinstance(choice, NamedToolChoice):
        named = [f for f in functions if f["name"] == choice.function.name]
        if not named:
            raise ApiError(400, f"`tool_choice.function.name`: no tool is named {choice.function.name!r}; allowed: "
                           f"{', '.join(f['name'] for f in functions)}", "tool_choice.function.name")
        return named
    return None


def _template_messages(messages: list[ChatMessage], functions: list[dict[str, Any]]) -> list[dict[str, str]]:
    out: list[dict[str, str]] = []
    results: list[str] = []
    for i, m in enumerate(messages):
        if m.role == "tool":
            results.append(m.text())
            continue
        if results:
            out.append({"role": "user", "content": results_block(results)})
            results = []
        content = m.text()
        if m.tool_calls:
            content += calls_block([(c.function.name, json_object(c.function.arguments,
                                                                  f"messages[{i}].tool_calls[{j}].function.arguments"))
                                    for j, c in enumerate(m.tool_calls)])
        out.append({"role": m.role, "content": content})
    if results:
        out.append({"role": "user", "content": results_block(results)})
    if functions:
        section = tools_section(functions)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{section}"}
        else:
            out.insert(0, {"role": "system", "content": section})
    return out

