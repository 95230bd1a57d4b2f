"""`AssistantOutput`: a chat completion's generated text split, as it streams, into what OpenAI and DeepSeek clients
read: `reasoning_content` (the thinking, up to `</think>`), `content`, and `tool_calls` parsed from the model's DSML
block (`dsml_format`).

Text is fed delta by delta and comes back as `AssistantDelta`s; what might still turn out to be a marker (a tail
that begins `</think>` or the call block's opening, and whitespace before it) is held back until the next delta says
which it is. Each tool call streams as OpenAI's deltas do: its id and name when its `invoke` opens, then its
arguments as JSON text piece by piece (`{"a": 1`, `, "b": "x"`, `}`), each piece once its parameter is complete, so
the pieces concatenated are `json.dumps` of the arguments. A call block that does not parse (the model, unconstrained
under `tool_choice: auto`, wrote something else) is given back as content when no call came out of it.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from pdspark.router.openai.dsml_format import (
    CALLS_BEGIN,
    CALLS_END,
    INVOKE_END,
    INVOKE_PREFIX,
    PARAMETER_PREFIX,
    THINK_END,
)
from pdspark.router.random_id import uuid4_hex

_INVOKE = re.compile(re.escape(INVOKE_PREFIX) + r'([^"<>]*)">')
_PARAMETER = re.compile(re.escape(PARAMETER_PREFIX) + r'([^"<>]*)" string="(true|false)">(.*?)' +
                        re.escape("</｜DSML｜parameter>"), re.S)
_STARTS = (INVOKE_PREFIX, PARAMETER_PREFIX, INVOKE_END, CALLS_END)


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: dict[str, Any] = field(default_factory=dict)

    def openai(self) -> dict:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": json.dumps(self.arguments, ensure_ascii=False)}}


@dataclass
class AssistantDelta:
    reasoning: str = ""
    content: str = ""
    tool_calls: list[dict] = field(default_factory=list)  # OpenAI's streamed `tool_calls` entries

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.tool_calls)

    def add(self, other: AssistantDelta) -> AssistantDelta:
        self.reasoning += other.reasoning
        self.content += other.content
        self.tool_calls += other.tool_calls
        return self


class AssistantOutput:
    def __init__(self, thinking: bool, tools: bool):
        """`thinking`: the output begins inside the reasoning (the prompt opened it); `tools`: parse call blocks."""
        self._state = "reasoning" if thinking else "content"
        self.thinking = thinking
        self._tools = tools
        self._pending = ""  # text of the current state not yet handed out
        self._block = ""  # a call block's raw text (given back as content when it yields no call)
        self.reasoning, self.content = "", ""
        self.calls: list[ToolCall] = []
        self._open: ToolCall | None = None

    def feed(self, text: str) -> AssistantDelta:
        self._pending += text
        out = AssistantDelta()
        while self._step(out):
            pass
        return self._record(out)

    def finish(self) -> AssistantDelta:
        """What was held back, now that no more text comes."""
        out = AssistantDelta()
        if self._state == "reasoning":
            out.reasoning = self._pending
        elif self._state == "content":
            out.content = self._pending
        elif self._state in ("calls", "broken") and not self.calls:
            out.content = CALLS_BEGIN + self._block
        self._pending = ""
        return self._record(out)

    # ---- states ---------------------------------------------------------------------------------------------------
    def _step(self, out: AssistantDelta) -> bool:
        """Hand out what the pending text settles; True to look again (a state changed)."""
        if self._state == "reasoning":
            return self._reasoning(out)
        if self._state == "content":
            return self._content(out)
        if self._state == "calls":
            return self._calls(out)
        self._pending = ""  # (after the block: the grammar ends the turn there; anything else is dropped)
        return False

    def _reasoning(self, out: AssistantDelta) -> bool:
        end = self._pending.find(THINK_END)
        if end >= 0:
            out.reasoning += self._pending[:end]
            self._pending, self._state = self._pending[end + len(THINK_END):], "content"
            return True
        cut = len(self._pending) - _partial(self._pending, THINK_END)
        out.reasoning += self._pending[:cut]
        self._pending = self._pending[cut:]
        return False

    def _content(self, out: AssistantDelta) -> bool:
        if not self._tools:
            out.content += self._pending
            self._pending = ""
            return False
        begin = self._pending.find(CALLS_BEGIN)
        if begin >= 0:
            out.content += self._pending[:begin].rstrip()
            self._pending, self._state = self._pending[begin + len(CALLS_BEGIN):], "calls"
            return True
        cut = len(self._pending) - _partial(self._pending, CALLS_BEGIN)
        while cut and self._pending[cut - 1].isspace():  # (whitespace before a block is not content)
            cut -= 1
        out.content += self._pending[:cut]
        self._pending = self._pending[cut:]
        return False

    def _calls(self, out: AssistantDelta) -> bool:
        text = self._pending.lstrip()
        self._block += self._pending[: len(self._pending) - len(text)]
        self._pending = text
        if not text:
            return False
        if text.startswith(CALLS_END):
            self._consume(len(CALLS_END))
            self._state = "after"
            return True
        invoke = _INVOKE.match(text) if self._open is None else None
        if invoke:
            self._open = ToolCall(f"call_{uuid4_hex()[:24]}", invoke.group(1))
            out.tool_calls.append({"index": len(self.calls), "id": self._open.id, "type": "function",
                                   "function": {"name": self._open.name, "arguments": ""}})
            self._consume(invoke.end())
            return True
        parameter = _PARAMETER.match(text) if self._open is not None else None
        if parameter and self._open is not None:
            name, is_string, raw = parameter.groups()
            value = raw if is_string == "true" else _json_or_text(raw)
            piece = ("{" if not self._open.arguments else ", ") + json.dumps(name) + ": " + json.dumps(
                value, ensure_ascii=False)
            self._open.arguments[name] = value
            out.tool_calls.append({"index": len(self.calls), "function": {"arguments": piece}})
            self._consume(parameter.end())
            return True
        if self._open is not None and text.startswith(INVOKE_END):
            out.tool_calls.append({"index": len(self.calls),
                                   "function": {"arguments": "}" if self._open.arguments else "{}"}})
            self.calls.append(self._open)
            self._open = None
            self._consume(len(INVOKE_END))
            return True
        if any(s.startswith(text) or text.startswith(s) for s in _STARTS):
            return False  # an element still arriving
        self._state = "broken"  # (kept in `_block`: content at the finish if no call came out)
        self._block += self._pending
        self._pending = ""
        return False

    def _consume(self, n: int) -> None:
        self._block += self._pending[:n]
        self._pending = self._pending[n:]

    def _record(self, out: AssistantDelta) -> AssistantDelta:
        self.reasoning += out.reasoning
        self.content += out.content
        return out


def _partial(text: str, marker: str) -> int:
    """The length of the longest tail of `text` that begins `marker` (it may complete it)."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def _json_or_text(raw: str) -> Any:
    try:
        return json.loads(raw)
    except ValueError:
        return raw
