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
from test_dsv4_tiny import streams_through

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
    got = streams_through(info, texts, 256, lambda: os.kill(info["services"]["decode-1"]["pid"], signal.SIGKILL),
                          structured_outputs=so, ignore_eos=False)
    assert got == want
    for ids in got:
        jsonschema.validate(json.loads(tiny.tokenizer.decode(ids)), schema)
