"""Structured outputs through the offline engine on the shipped model: 50 varied JSON schemas, greedy and seeded,
all parse and validate (jsonschema), with DSpark on exactly as off (the mask applies to every verify row, and the
rows after a rejected draft roll back); a regex, a choice, an EBNF grammar and JSON mode likewise; a bad spec is
refused naming its field before the request takes any page."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from pdspark import LLM, SamplingParams
from pdspark.errors import InvalidRequestError
from pdspark.testing.json_schemas import varied_schemas
from pdspark.types import StructuredOutputs

PROMPT = "<|user|>\nDescribe the object as JSON.<|end|>\n<|assistant|>\n"


@pytest.fixture(scope="module")
def engines():
    plain = LLM("dsv4-tiny", max_model_len=1024, max_num_seqs=16)
    spec = LLM("dsv4-tiny", max_model_len=1024, max_num_seqs=16, speculative="dspark")
    yield plain, spec


def _params(so: StructuredOutputs, i: int) -> list[SamplingParams]:
    return [SamplingParams(temperature=0, max_tokens=256, structured_outputs=so),
            SamplingParams(temperature=0.8, seed=100 + i, max_tokens=256, structured_outputs=so)]


def test_fifty_schemas_greedy_and_seeded_validate_with_dspark_as_without(engines):
    plain, spec = engines
    schemas = varied_schemas(50, seed=0)
    params = [p for i, s in enumerate(schemas) for p in _params(StructuredOutputs.of(json=s), i)]
    want = plain.generate([PROMPT] * len(params), params)
    steps_before = spec.engine.spec.verify_steps
    got = spec.generate([PROMPT] * len(params), params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert spec.engine.spec.verify_steps > steps_before
    for p, o in zip(params, want):
        assert o.finish_reason == "stop", o.text  # the grammar completed, then EOS
        jsonschema.validate(json.loads(o.text), json.loads(p.structured_outputs.spec))
    assert len({o.text for o in want}) > 50  # (seeded and greedy differ; the schemas do)


@pytest.mark.parametrize("so, check", [
    (StructuredOutputs.of(regex=r"[a-z]{2,6}_[0-9]{1,3}"), lambda t: re.fullmatch(r"[a-z]{2,6}_[0-9]{1,3}", t)),
    (StructuredOutputs.of(choice=["yes", "no", "a|b"]), lambda t: t in ("yes", "no", "a|b")),
    (StructuredOutputs.of(grammar='root ::= "def " [a-z_]+ "(" [a-z]* "):"'),
     lambda t: re.fullmatch(r"def [a-z_]+\([a-z]*\):", t)),
    (StructuredOutputs.of(json_object=True), lambda t: t.startswith("{") and "\n" not in t),
], ids=["regex", "choice", "grammar", "json_object"])
def test_regex_choice_grammar_and_json_mode(engines, so, check):
    plain, spec = engines
    params = _params(so, 0)
    want = plain.generate(["def main():\n    "] * 2, params)
    assert [o.token_ids for o in spec.generate(["def main():\n    "] * 2, params)] == [o.token_ids for o in want]
    for o in want:
        assert check(o.text), o.text
    if so.kind != "json_object":  # (JSON mode over a code model may run to max_tokens; its prefix is still JSON)
        assert all(o.finish_reason == "stop" for o in want)


def test_a_bad_spec_is_refused_naming_its_field_and_takes_no_page(engines):
    plain, _ = engines
    used = plain.engine.kv.usage()
    with pytest.raises(InvalidRequestError) as e:
        plain.generate([PROMPT], SamplingParams(structured_outputs=StructuredOutputs.of(regex="(unclosed")))
    assert e.value.field == "structured_outputs.regex"
    assert plain.engine.kv.usage() == used and not plain.engine.requests


def test_thinking_budgets_and_forced_tool_calls_give_dspark_the_plain_tokens(engines):
    """Structural tags (`chat_grammar`): thinking with a token budget, then a schema's JSON; a forced DSML tool call
    after a budgeted thinking. The budget ends the thinking at the same token with DSpark on as off (the cursor drives
    its matcher as plain decoding does), and the answers validate."""
    from pdspark.router.openai.assistant_output import AssistantOutput
    from pdspark.router.openai.chat_grammar import chat_constraint

    plain, spec = engines
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0,
                                                                              "maximum": 9}},
              "required": ["ok", "n"], "additionalProperties": False}
    xs = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "maxItems": 3}
    tool = {"name": "add", "parameters": {"type": "object", "properties": {"xs": xs}, "required": ["xs"]}}
    constraints = [chat_constraint(StructuredOutputs.of(json=schema), None, True, thinking=True, thinking_budget=b)
                   for b in (4, 16)] + [chat_constraint(None, [tool], False, thinking=True, thinking_budget=8)]
    params = [SamplingParams(temperature=t, seed=9, max_tokens=400, structured_outputs=c)
              for c in constraints for t in (0, 0.8)]
    prompts = [PROMPT + "<think>"] * len(params)
    want = plain.generate(prompts, params)
    assert [o.token_ids for o in spec.generate(prompts, params)] == [o.token_ids for o in want]
    for k, o in enumerate(want):
        reader = AssistantOutput(thinking=True, tools=k >= 4)
        reader.feed(o.text)
        reader.finish()
        assert o.finish_reason == "stop" and reader.reasoning, o.text
        if k < 4:
            jsonschema.validate(json.loads(reader.content), schema)
        else:
            assert [c.name for c in reader.calls] == ["add"]
            jsonschema.validate(reader.calls[0].arguments, tool["parameters"])
