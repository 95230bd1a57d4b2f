"""`/openapi.json` is a valid OpenAPI 3.1 document, and its request schemas say what the router's models accept:
a body the schema allows is a body the model allows, and the other way round (so a client, a fuzzer or a
generated SDK that trusts the schema is not refused for it, and one that breaks it is)."""

from __future__ import annotations

import json

import jsonschema_rs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, ValidationError

from pdspark.router.openai.api_error import ErrorResponse
from pdspark.router.openai.chat_completion_request import ChatCompletionRequest
from pdspark.router.openai.completion_request import CompletionRequest
from pdspark.router.openai.generate_request import GenerateRequest
from pdspark.router.openai.openapi_document import openapi_document

DOC = openapi_document()
SCHEMAS = DOC["components"]["schemas"]
PUBLIC_POSTS = {"/v1/completions": "CompletionRequest", "/v1/chat/completions": "ChatCompletionRequest",
                "/generate": "GenerateRequest"}


def validator(name: str):
    """A validator of one component schema, its `$ref`s resolved within the document."""
    return jsonschema_rs.validator_for({"$ref": f"#/components/schemas/{name}", "components": DOC["components"]})


def test_it_is_openapi_3_1_and_plain_json():
    assert DOC["openapi"].startswith("3.1") and DOC["info"]["title"] and DOC["info"]["version"]
    assert json.loads(json.dumps(DOC)) == DOC


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_every_schema_is_valid_json_schema(name):
    jsonschema_rs.meta.validate(SCHEMAS[name])


@pytest.mark.parametrize("path, model", sorted(PUBLIC_POSTS.items()))
def test_every_generation_route_documents_its_body_and_errors(path, model):
    op = DOC["paths"][path]["post"]
    assert op["requestBody"]["required"]
    assert op["requestBody"]["content"]["application/json"]["schema"] == {"$ref": f"#/components/schemas/{model}"}
    for status in ("400", "401", "404", "413", "415", "422", "429", "5XX"):
        error = op["responses"][status]["content"]["application/json"]["schema"]
        assert error == {"$ref": "#/components/schemas/ErrorResponse"}


def test_a_router_with_api_keys_documents_which_routes_need_one():
    keyed = openapi_document(api_keys=True)
    assert keyed["components"]["securitySchemes"]["apiKey"]["scheme"] == "bearer"
    assert "securitySchemes" not in DOC["components"]  # a router without keys asks for none
    for path, ops in keyed["paths"].items():
        for method, op in ops.items():
            needs_key = path.startswith("/v1/") or path in ("/generate", "/tokenize", "/detokenize", "/tokenizer_info")
            assert op["security"] == ([{"apiKey": []}] if needs_key else []), path
            assert ("401" in op["responses"]) == needs_key, path
            assert "security" not in DOC["paths"][path][method]


@pytest.mark.parametrize("path, model", sorted(PUBLIC_POSTS.items()))
def test_the_request_examples_are_valid_requests(path, model):
    content = DOC["paths"][path]["post"]["requestBody"]["content"]["application/json"]
    cls = {"CompletionRequest": CompletionRequest, "ChatCompletionRequest": ChatCompletionRequest,
           "GenerateRequest": GenerateRequest}[model]
    assert content["examples"]
    for example in content["examples"].values():
        assert validator(model).is_valid(example["value"]) and model_accepts(cls, example["value"])


def test_the_error_schema_is_the_error_body():
    body = {"error": {"message": "m", "type": "invalid_request_error", "param": None, "code": None}}
    assert validator("ErrorResponse").is_valid(body)
    assert not validator("ErrorResponse").is_valid({"error": {"message": "m"}})
    ErrorResponse.model_validate(body)


# ---- the schemas agree with the models -----------------------------------------------------------------------------
def model_accepts(model: type[BaseModel], body: object) -> bool:
    try:
        model.model_validate_json(json.dumps(body))
    except ValidationError:
        return False
    return True


# NOTE: integral floats (5.0) are left out: JSON Schema counts them as integers, the router's strict models do not.
INTS = st.integers(-(2**63), 2**64 - 1) | st.sampled_from([-1, 0, 1, 2, 4, 5, 20, 21, 2**31 - 1, 2**31, 2**63 - 1])
FLOATS = st.floats(allow_nan=False, allow_infinity=False).filter(lambda x: not x.is_integer()) | st.sampled_from(
    [0.5, 1e-7, 1e-6, 1.5, 2.5, -0.5])
SCALARS = st.none() | st.booleans() | INTS | FLOATS | st.text(max_size=5) | st.sampled_from(["", "text", "user"])


def mostly(likely: st.SearchStrategy, other: st.SearchStrategy) -> st.SearchStrategy:
    """`likely` three times in four: bodies with several fields need each to be valid often enough that some are."""
    return st.integers(0, 3).flatmap(lambda i: other if i == 0 else likely)


PARTS = st.lists(st.fixed_dictionaries({"type": mostly(st.just("text"), st.sampled_from(["image_url"]) | SCALARS)},
                                       optional={"text": mostly(st.text(max_size=3), SCALARS)}), max_size=3)
MESSAGES = st.lists(st.fixed_dictionaries({
    "role": mostly(st.sampled_from(["system", "user", "assistant"]), st.sampled_from(["tool", ""]) | SCALARS),
    "content": mostly(st.text(max_size=5) | PARTS, SCALARS),
}), max_size=3)
VALUES = SCALARS | st.lists(INTS, max_size=5) | st.lists(st.text(max_size=3), max_size=6) | st.just({})
PROMPTS = (st.text(max_size=5) | st.lists(INTS, max_size=3) | st.lists(st.text(max_size=3), max_size=2)
           | st.lists(st.lists(INTS, max_size=2), max_size=2) | SCALARS)


def bodies(model: type[BaseModel]) -> st.SearchStrategy[dict]:
    # Optional fields are absent, null (valid everywhere) or anything at all.
    fields = {name: mostly(st.none(), VALUES) for name in model.model_fields}
    fields["stream_options"] = mostly(st.fixed_dictionaries({}, optional={"include_usage": SCALARS,
                                                                          "continuous_usage_stats": SCALARS}), VALUES)
    fields["logit_bias"] = VALUES | st.dictionaries(st.text(max_size=2), FLOATS, max_size=2)
    if "messages" in fields:
        fields["messages"] = mostly(MESSAGES, VALUES)
    if "prompt" in fields:
        fields["prompt"] = PROMPTS
    fields["an_unknown_field"] = VALUES
    required = {name: fields.pop(name) for name, f in model.model_fields.items() if f.is_required()}
    return st.fixed_dictionaries(required, optional=fields)


@pytest.mark.parametrize("model", [CompletionRequest, ChatCompletionRequest], ids=lambda m: m.__name__)
def test_a_body_is_schema_valid_exactly_when_the_model_accepts_it(model):
    check = validator(model.__name__)
    seen = {True: 0, False: 0}

    @settings(max_examples=400, derandomize=True, database=None, deadline=None)
    @given(body=bodies(model))
    def agree(body):
        accepted = model_accepts(model, body)
        seen[accepted] += 1
        assert check.is_valid(body) == accepted, (body, [e.message for e in check.iter_errors(body)])

    agree()
    assert min(seen.values()) >= 10, seen  # both sides were exercised (the split varies with the run order)


@pytest.mark.parametrize("body, valid", [
    ({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 4, "top_k": -1}}, True),
    ({"text": "hi", "sampling_params": {"stop": ["x"], "min_new_tokens": 0}}, True),
    ({"sampling_params": {"max_new_tokens": 4}}, False),  # neither text nor input_ids
    ({"input_ids": [1], "sampling_params": {"top_k": 0}}, False),
    ({"input_ids": [1], "sampling_params": {"seed": 2**63}}, False),
    ({"input_ids": [1], "sampling_params": {"min_new_tokens": 3}}, True),
    ({"input_ids": [1], "sampling_params": {"min_new_tokens": -1}}, False),
    ({"input_ids": [-1]}, False),
    ({"text": "x", "rid": ""}, False),
])
def test_the_generate_schema_agrees_with_the_router(body, valid):
    assert validator("GenerateRequest").is_valid(body) == valid
