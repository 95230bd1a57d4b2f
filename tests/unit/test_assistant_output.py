"""Reading a chat completion's text (`AssistantOutput`): thinking up to `</think>`, content, DSML tool calls; the
same result whatever the deltas are cut into (every split point), arguments streamed as JSON pieces that add up to
the call's arguments; a block that does not parse is content. And the call grammar (`chat_grammar`) is xgrammar's own
DeepSeek-V4 tool-call tag; the prompt renders tools, calls and results in DSV4's DSML."""

from __future__ import annotations

import json

import pytest

from pdspark.router.openai.assistant_output import AssistantDelta, AssistantOutput
from pdspark.router.openai.chat_completion_request import ChatCompletionRequest
from pdspark.router.openai.chat_grammar import MAX_WHITESPACE, chat_constraint, tool_calls_format
from pdspark.router.openai.chat_prompt import chat_prompt
from pdspark.router.openai.chat_template import ChatTemplate
from pdspark.router.openai.dsml_format import CALLS_BEGIN, calls_block

CALLS = [("get_weather", {"city": "Paris <b>", "days": 3}), ("add", {"xs": [1, 2], "opts": {"a": True}})]
TEXT = "reasoning here</think>Sure, calling." + calls_block(CALLS)


def _read(pieces: list[str], thinking: bool = True, tools: bool = True) -> tuple[AssistantOutput, AssistantDelta]:
    out, total = AssistantOutput(thinking, tools), AssistantDelta()
    for p in pieces:
        total.add(out.feed(p))
    total.add(out.finish())
    return out, total


def test_the_whole_text_reads_as_thinking_content_and_calls():
    out, total = _read([TEXT])
    assert out.reasoning == "reasoning here" and out.content == "Sure, calling."
    assert [(c.name, c.arguments) for c in out.calls] == CALLS
    assert [json.loads(c.openai()["function"]["arguments"]) for c in out.calls] == [a for _, a in CALLS]


@pytest.mark.parametrize("cut", range(1, len(TEXT)))
def test_any_two_deltas_read_the_same_and_stream_argument_pieces(cut):
    out, total = _read([TEXT[:cut], TEXT[cut:]])
    assert (total.reasoning, total.content) == ("reasoning here", "Sure, calling.")
    args: dict[int, str] = {}
    for d in total.tool_calls:
        args[d["index"]] = args.get(d["index"], "") + d["function"]["arguments"]
    assert [json.loads(args[i]) for i in sorted(args)] == [a for _, a in CALLS]
    assert [d["function"]["name"] for d in total.tool_calls if "name" in d["function"]] == ["get_weather", "add"]


def test_character_by_character_equals_whole():
    out, total = _read(list(TEXT))
    assert (total.reasoning, total.content, [(c.name, c.arguments) for c in out.calls]) == (
        "reasoning here", "Sure, calling.", CALLS)


def test_a_block_that_does_not_parse_is_content_and_no_tools_means_no_parsing():
    broken = f"Look: {CALLS_BEGIN}\n<not a call>"
    out, total = _read([broken], thinking=False)
    # (the whitespace before a block is not content, whether or not the block parses)
    assert out.calls == [] and total.content == f"Look:{CALLS_BEGIN}\n<not a call>"
    out, total = _read([TEXT], thinking=False, tools=False)
    assert total.content == TEXT and out.calls == []
    out, total = _read(["never closed <thi"], thinking=True)
    assert total.reasoning == "never closed <thi" and total.content == ""


def test_the_call_grammar_is_xgrammars_deepseek_v4_tag():
    xgr = pytest.importorskip("xgrammar")
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
        {"type": "function", "function": {"name": "noop", "parameters": {"type": "object", "properties": {}}}}]
    for parallel in (True, False):
        theirs = xgr.get_model_structural_tag("deepseek_v4", tools=tools, tool_choice="required", reasoning="disabled",
                                              max_whitespace_cnt=MAX_WHITESPACE, parallel_tool_calls=parallel)
        ours = tool_calls_format([t["function"] for t in tools], parallel)
        assert json.loads(theirs.model_dump_json())["format"] == ours
    # With thinking, the reasoning comes first, ended by `</think>` (forced after the budget).
    so = chat_constraint(None, [tools[0]["function"]], True, thinking=True, thinking_budget=7)
    fmt = json.loads(so.spec)["format"]
    assert fmt["elements"][0]["end"] == "</think>" and fmt["elements"][0]["content"]["max_tokens"] == 7
    assert chat_constraint(None, None, True, thinking=True, thinking_budget=None) is None


def test_the_prompt_renders_tools_calls_and_results_in_dsml():
    req = ChatCompletionRequest.model_validate({"messages": [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "rain"},
        {"role": "tool", "tool_call_id": "c2", "content": "cold"}],
        "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}],
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}}, "reasoning_effort": "high"})
    prompt = chat_prompt(req, ChatTemplate(None))
    assert prompt.text.startswith("<|system|>\n## Tools") and '{"name": "get_weather"' in prompt.text
    assert calls_block([("get_weather", {"city": "Oslo"})]) in prompt.text
    assert "<|user|>\n<function_results>\n<result>rain</result>\n<result>cold</result>\n</function_results>" in (
        prompt.text)
    assert prompt.text.endswith("<|assistant|>\n<think>") and prompt.shape.thinking and prompt.shape.tools
    assert [f["name"] for f in prompt.forced_tools] == ["get_weather"]
