"""`StructuredFields`: the request fields that constrain the output, in the spellings clients send, and
`structured_outputs()`, which turns whichever one a request gives into the engine's `StructuredOutputs`.

- OpenAI: `response_format` `{"type": "json_object"}` or `{"type": "json_schema", "json_schema": {"name", "schema",
  "strict"}}` (what the openai SDK's `chat.completions.parse(response_format=Model)` sends); `{"type": "text"}` is no
  constraint.
- vLLM: a `structured_outputs` object with exactly one of `json`, `regex`, `choice`, `grammar`, `json_object`,
  `structural_tag`; and its older top-level `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`.
- SGLang (`/generate`'s `sampling_params`): `json_schema` (a JSON string), `regex`, `ebnf`.

At most one may be given. The router checks the shapes; whether a schema, regex or grammar compiles is the workers'
answer (they hold the tokenizer-specific compiler, `engine/grammar.py`): a 400 whose message names
`structured_outputs.<kind>`. A JSON schema is compiled strictly whatever `strict` says (no properties beyond those
listed unless the schema allows them): the output then always validates against it.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from pdspark.router.openai.api_error import ApiError
from pdspark.router.openai.sampling_fields import STRICT
from pdspark.types import MAX_STRUCTURED_CHARS, StructuredOutputs

MAX_CHOICE_STRINGS = 256
MAX_NAME_CHARS = 64  # OpenAI's bound on a schema's `name`


class JsonSchemaFormat(BaseModel):
    """`response_format.json_schema`."""

    model_config = ConfigDict(**STRICT, populate_by_name=True)

    name: str | None = Field(None, max_length=MAX_NAME_CHARS)
    description: str | None = None
    # (`schema` would shadow a BaseModel attribute: the field is read under its JSON name)
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema", description="a JSON schema")
    strict: bool | None = Field(None, description="accepted; outputs always follow the schema strictly")


class ResponseFormat(BaseModel):
    model_config = STRICT

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsField(BaseModel):
    """vLLM's `structured_outputs`: exactly one constraint."""

    model_config = ConfigDict(**STRICT, populate_by_name=True)

    json_: dict[str, Any] | str | None = Field(None, alias="json", description="a JSON schema (object or JSON text)")
    regex: str | None = Field(None, max_length=MAX_STRUCTURED_CHARS)
    choice: list[str] | None = Field(None, min_length=1, max_length=MAX_CHOICE_STRINGS)
    grammar: str | None = Field(None, max_length=MAX_STRUCTURED_CHARS, description="EBNF (GBNF: `root ::= ...`)")
    json_object: bool | None = None
    structural_tag: str | None = Field(None, max_length=MAX_STRUCTURED_CHARS,
                                       description="xgrammar's structural tag, as JSON text")


class StructuredFields(BaseModel):
    """Mixed into the chat and completions requests."""

    model_config = STRICT

    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsField | None = None
    guided_json: dict[str, Any] | str | None = Field(None, description="vLLM's older `structured_outputs.json`")
    guided_regex: str | None = Field(None, max_length=MAX_STRUCTURED_CHARS)
    guided_choice: list[str] | None = Field(None, min_length=1, max_length=MAX_CHOICE_STRINGS)
    guided_grammar: str | None = Field(None, max_length=MAX_STRUCTURED_CHARS)


def structured_outputs(req: StructuredFields) -> StructuredOutputs | None:
    """The one constraint a chat or completions request gives, or None; `ApiError` (400) naming the field for
    two at once or a malformed one."""
    given: list[tuple[str, dict[str, Any]]] = []
    fmt = req.response_format
    if fmt is not None and fmt.type == "json_object":
        given.append(("response_format", {"json_object": True}))
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None:
            raise ApiError(400, "`response_format.json_schema` is required when `type` is json_schema",
                           "response_format.json_schema")
        given.append(("response_format.json_schema.schema", {"json": fmt.json_schema.schema_}))
    so = req.structured_outputs
    if so is not None:
        kinds: dict[str, Any] = {k: v for k, v in (("json", so.json_), ("regex", so.regex), ("choice", so.choice),
                                   ("grammar", so.grammar), ("structural_tag", so.structural_tag)) if v is not None}
        if so.json_object:
            kinds["json_object"] = True
        if len(kinds) != 1:
            raise ApiError(400, "`structured_outputs` takes exactly one of json, regex, choice, grammar, json_object, "
                           f"structural_tag (got {', '.join(sorted(kinds)) or 'none'})", "structured_outputs")
        kind, value = next(iter(kinds.items()))
        given.append((f"structured_outputs.{kind}", {kind: value}))
    guided: list[tuple[str, str, Any]] = [("guided_json", "json", req.guided_json),
                                          ("guided_regex", "regex", req.guided_regex),
                                          ("guided_choice", "choice", req.guided_choice),
                                          ("guided_grammar", "grammar", req.guided_grammar)]
    given += [(name, {kind: value}) for name, kind, value in guided if value is not None]
    return _one(given)


def generate_structured_outputs(json_schema: str | None, regex: str | None, ebnf: str | None,
                                prefix: str = "sampling_params.") -> StructuredOutputs | None:
    """SGLang's spellings (`/generate`): `json_schema` is JSON text."""
    given = [(f"{prefix}{name}", {kind: value}) for name, kind, value in
             (("json_schema", "json", json_schema), ("regex", "regex", regex), ("ebnf", "grammar", ebnf))
             if value is not None]
    return _one(given)


def _one(given: list[tuple[str, dict[str, Any]]]) -> StructuredOutputs | None:
    if not given:
        return None
    if len(given) > 1:
        names = ", ".join(f"`{name}`" for name, _ in given)
        raise ApiError(400, f"{names}: give at most one output constraint", given[1][0])
    param, spelled = given[0]
    kind, value = next(iter(spelled.items()))
    if kind == "json" and isinstance(value, str):
        value = _schema_text(value, param)
    try:
        return StructuredOutputs.of(**{kind: value})
    except ValueError as e:  # (`InvalidRequestError`: a schema that is not an object, an empty choice)
        raise ApiError(400, f"`{param}`: {e}", param) from e


def _schema_text(text: str, param: str) -> dict[str, Any]:
    if len(text) > MAX_STRUCTURED_CHARS:
        raise ApiError(400, f"`{param}`: a schema of more than {MAX_STRUCTURED_CHARS} characters", param)
    return json_object(text, param, " (a JSON schema)")


def json_object(text: str, param: str, what: str = "") -> dict[str, Any]:
    """`text` (the value of request field `param`) parsed as a JSON object; an `ApiError` (400) naming the field
    otherwise (`what`: said after "must be a JSON object")."""
    try:
        value = json.loads(text)
    except ValueError as e:
        raise ApiError(400, f"`{param}` is not valid JSON: {e}", param) from e
    if not isinstance(value, dict):
        raise ApiError(400, f"`{param}` must be a JSON object{what}", param)
    return value
