"""`chat_constraint`: the one output constraint a chat request runs under, from what it asks: a response format
(`structured_fields`), tools that must be called (`tool_choice` `required` or a named function), thinking.

Written as xgrammar structural tags (JSON, compiled by the workers; the router needs no grammar library):
- forced tool calls: the DSML block of `dsml_format` (one call, or several with `parallel_tool_calls`), each call's
  parameters following its function's JSON schema (the format xgrammar's `deepseek_v4` model tag builds; a unit test
  holds the two equal);
- thinking: the reasoning first, any text without `<think>`/`</think>` up to `</think>` (at most `thinking_budget`
  tokens when given: then `</think>` is forced), then the rest under its constraint, or free.

Whitespace inside a call or a JSON value is limited to one character in a row: a small model otherwise pads forever.
"""

from __future__ import annotations

import json
from typing import Any

from pdspark.router.openai.dsml_format import CALLS_BEGIN, CALLS_END, INVOKE_END, INVOKE_PREFIX, THINK_BEGIN, THINK_END
from pdspark.types import StructuredOutputs

MAX_WHITESPACE = 1


def chat_constraint(base: StructuredOutputs | None, forced_tools: list[dict[str, Any]] | None, parallel: bool,
                    thinking: bool, thinking_budget: int | None) -> StructuredOutputs | None:
    """`forced_tools`: the functions one of which must be called (None: calls are not forced)."""
    body: dict[str, Any] | None = None
    if forced_tools:
        body = tool_calls_format(forced_tools, parallel)
    elif base is not None and thinking:
        body = _as_format(base)
    elif base is not None:
        return base
    if not thinking:
        return None if body is None else _tag(body)
    if body is None and thinking_budget is None:
        return None  # (free thinking, free answer: nothing to constrain)
    reasoning = {"type": "tag", "begin": "", "end": THINK_END,
                 "content": {"type": "any_text", "excludes": [THINK_BEGIN, THINK_END], "max_tokens": thinking_budget}}
    rest = body if body is not None else {"type": "any_text", "excludes": [THINK_BEGIN, THINK_END]}
    return _tag({"type": "sequence", "elements": [reasoning, rest]})


def tool_calls_format(functions: list[dict[str, Any]], parallel: bool) -> dict[str, Any]:
    """The DSML call block over `functions` (OpenAI `function` objects)."""
    tags = [{"type": "tag", "begin": f'{INVOKE_PREFIX}{f["name"]}">\n',
             "content": {"type": "json_schema", "json_schema": f.get("parameters") or {"type": "object",
                                                                                      "properties": {}},
                         "style": "deepseek_xml", "any_order": False, "max_whitespace_cnt": MAX_WHITESPACE,
                         "excludes": []},
             "end": f"{INVOKE_END}\n"} for f in functions]
    return {"type": "sequence", "elements": [
        {"type": "const_string", "value": f"\n\n{CALLS_BEGIN}\n"},
        {"type": "tags_with_separator", "tags": tags, "separator": "", "at_least_one": True,
         "stop_after_first": not parallel},
        {"type": "const_string", "value": CALLS_END}]}


def _as_format(so: StructuredOutputs) -> dict[str, Any]:
    """A plain constraint as a structural tag's format (to follow the reasoning)."""
    if so.kind == "json":
        return {"type": "json_schema", "json_schema": json.loads(so.spec), "max_whitespace_cnt": MAX_WHITESPACE}
    if so.kind == "json_object":
        return {"type": "json_schema", "json_schema": {"type": "object"}, "max_whitespace_cnt": MAX_WHITESPACE}
    if so.kind == "regex":
        return {"type": "regex", "pattern": so.spec}
    if so.kind == "choice":
        return {"type": "or", "elements": [{"type": "const_string", "value": c} for c in json.loads(so.spec)]}
    if so.kind == "grammar":
        return {"type": "grammar", "grammar": so.spec}
    return json.loads(so.spec)["format"]  # (a structural tag: its format)


def _tag(fmt: dict[str, Any]) -> StructuredOutputs:
    return StructuredOutputs.of(structural_tag={"type": "structural_tag", "format": fmt})
