"""Structured outputs through `pdspark up` on the shipped model (DSpark on, its default): 50 varied JSON schemas,
greedy and seeded, as the openai SDK sends them (`response_format` json_schema) all parse and validate and equal the
offline engine's; `chat.completions.parse` with a pydantic model returns the parsed object; streams constrained by a
schema whose only decode worker is killed mid-stream migrate and still equal offline."""

from __future__ import annotations

import json
import os
import signal
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import pytest
from test_dsv4_tiny import current_pid, streams_through

from pdspark import LLM, SamplingParams
from pdspark.router.openai.chat_template import ChatTemplate
from pdspark.testing.json_schemas import varied_schemas
from pdspark.testing.time_scale import scaled
from pdspark.types import StructuredOutputs

QUESTION = "Describe the object as JSON."


@pytest.fixture(scope="module")
def tiny() -> LLM:
    return LLM("dsv4-tiny", max_model_len=1024, max_num_seqs=16)


def _chat_prompt(tiny: LLM) -> str:
    return ChatTemplate(tiny.tokenizer.chat_template).render([{"role": "user", "content": QUESTION}])


def test_fifty_schemas_through_the_cluster_validate_and_equal_offline(tiny, dsv4_tiny_cluster):
    import openai

    client = openai.OpenAI(base_url=dsv4_tiny_cluster.info["http"] + "/v1", api_key="none", max_retries=0,
                           timeout=scaled(120))
    schemas = varied_schemas(50, seed=1)
    cases = [(s, t, 200 + i) for i, s in enumerate(schemas) for t in (0.0, 0.8)]

    def ask(case) -> str:
        schema, temperature, seed = case
        got = client.chat.completions.create(
            model="dsv4-tiny", messages=[{"role": "user", "content": QUESTION}], max_tokens=256,
            temperature=temperature, seed=seed,
            response_format={"type": "json_schema", "json_schema": {"name": "obj", "schema": schema, "strict": True}})
        assert got.choices[0].finish_reason == "stop", got.choices[0].message.content
        return got.choices[0].message.content

    with ThreadPoolExecutor(8) as pool:
        texts = list(pool.map(ask, cases))
    for (schema, _, _), text in zip(cases, texts):
        jsonschema.validate(json.loads(text), schema)
    want = tiny.generate([_chat_prompt(tiny)] * len(cases), [
        SamplingParams(temperature=t, seed=seed, max_tokens=256, structured_outputs=StructuredOutputs.of(json=s))
        for s, t, seed in cases])
    assert texts == [o.text for o in want]


def test_the_openai_sdks_parse_returns_the_pydantic_object(dsv4_tiny_cluster):
    import openai
    from pydantic import BaseModel, Field

    class Point(BaseModel):
        label: str = Field(max_length=8)
        x: int = Field(ge=0, le=100)
        y: int = Field(ge=0, le=100)

    client = openai.OpenAI(base_url=dsv4_tiny_cluster.info["http"] + "/v1", api_key="none", max_retries=0,
                           timeout=scaled(60))
    got = client.chat.completions.parse(model="dsv4-tiny", messages=[{"role": "user", "content": "A point."}],
                                        response_format=Point, temperature=0, max_tokens=128)
    point = got.choices[0].message.parsed
    assert isinstance(point, Point) and 0 <= point.x <= 100 and len(point.label) <= 8


@pytest.mark.kills
def test_constrained_streams_migrate_when_their_decode_worker_is_killed_and_equal_offline(tiny, dsv4_tiny_cluster):
    """Long enough to be running when the kill comes: arrays of up to 40 small integers (each a few tokens)."""
    schema = {"type": "object", "properties": {"xs": {"type": "array", "items": {"type": "integer", "minimum": 0,
                                                                                 "maximum": 9999},
                                                      "minItems": 40, "maxItems": 40}},
              "required": ["xs"], "additionalProperties": False}
    so = StructuredOutputs.of(json=schema)
    texts = ["def fibonacci(n):\n", "import os\nimport sys\n", "class Stack:\n"]
    want = [o.token_ids for o in tiny.generate(texts, SamplingParams(temperature=0, max_tokens=256,
                                                                     structured_outputs=so))]
    info = dsv4_tiny_cluster.info
    got = streams_through(info, texts, 256, lambda: os.kill(current_pid(dsv4_tiny_cluster, "decode-1"), signal.SIGKILL),
                          structured_outputs=so, ignore_eos=False)
    assert got == want
    for ids in got:
        jsonschema.validate(json.loads(tiny.tokenizer.decode(ids)), schema)


WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                           "days": {"type": "integer", "minimum": 1, "maximum": 7},
                                           "units": {"enum": ["c", "f"]}},
           "required": ["city", "days"], "additionalProperties": False}
ADD = {"type": "object", "properties": {"xs": {"type": "array", "items": {"type": "integer", "minimum": 0,
                                                                          "maximum": 99}, "maxItems": 3}},
       "required": ["xs"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Forecast", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "parameters": ADD}}]
SCHEMAS = {"get_weather": WEATHER, "add": ADD}


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "add"}}],
                         ids=["required", "named"])
def test_forced_tool_calls_are_valid_through_the_openai_sdk_streamed_and_not(dsv4_tiny_cluster, tool_choice):
    import openai

    client = openai.OpenAI(base_url=dsv4_tiny_cluster.info["http"] + "/v1", api_key="none", max_retries=0,
                           timeout=scaled(120))
    ask = dict(model="dsv4-tiny", messages=[{"role": "user", "content": "What's the weather in Oslo?"}], tools=TOOLS,
               tool_choice=tool_choice, max_tokens=600, temperature=0.8, seed=5)
    got = client.chat.completions.create(**ask)
    choice = got.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls, choice
    for call in choice.message.tool_calls:
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
        assert isinstance(tool_choice, str) or call.function.name == "add"
    # Streamed: the same calls, their arguments in pieces that add up.
    args: dict[int, str] = {}
    names: dict[int, str] = {}
    finish = None
    for chunk in client.chat.completions.create(**ask, stream=True):
        delta = chunk.choices[0].delta
        for tc in delta.tool_calls or ():
            names[tc.index] = names.get(tc.index, "") + (tc.function.name or "")
            args[tc.index] = args.get(tc.index, "") + (tc.function.arguments or "")
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls"
    assert [(names[i], json.loads(args[i])) for i in sorted(args)] == [
        (c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls]


def test_thinking_comes_back_as_reasoning_content_and_tool_results_are_read(dsv4_tiny_cluster):
    """`reasoning_effort` opens the thinking; `thinking_budget` ends it; the answer follows its JSON schema; streamed,
    the thinking arrives as `reasoning_content` deltas. A conversation with a call and its result is served."""
    import openai

    client = openai.OpenAI(base_url=dsv4_tiny_cluster.info["http"] + "/v1", api_key="none", max_retries=0,
                           timeout=scaled(120))
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    ask = dict(model="dsv4-tiny", temperature=0, max_tokens=200, reasoning_effort="high",
               extra_body={"thinking_budget": 16},
               response_format={"type": "json_schema", "json_schema": {"name": "r", "schema": schema}},
               messages=[{"role": "user", "content": "Think, then answer."},
                         {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function",
                          "function": {"name": "add", "arguments": '{"xs": [1, 2]}'}}]},
                         {"role": "tool", "tool_call_id": "c1", "content": "3"}])
    got = client.chat.completions.create(**ask).choices[0].message
    reasoning = got.model_extra["reasoning_content"]
    assert reasoning and "</think>" not in reasoning and json.loads(got.content) in ({"ok": True}, {"ok": False})
    streamed = {"reasoning_content": "", "content": ""}
    for chunk in client.chat.completions.create(**ask, stream=True):
        delta = chunk.choices[0].delta
        streamed["reasoning_content"] += (delta.model_extra or {}).get("reasoning_content") or ""
        streamed["content"] += delta.content or ""
    assert streamed == {"reasoning_content": reasoning, "content": got.content}
