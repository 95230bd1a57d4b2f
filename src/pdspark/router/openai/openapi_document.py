"""`openapi_document`: the router's public HTTP API as an OpenAPI 3.1 document, generated from the request models
(so the schema a client or a fuzzer reads is the one the router validates with) and the error model.

Worker administration (`/workers`) and Prometheus's service discovery (`/prometheus/targets`) are left out: they
are for operators with an admin key, not part of the public API. A router with API keys says
that the generation routes and `/v1/models` need one (HTTP Bearer); `/health`, `/metrics` and this document need
none. A router without keys documents none: it asks for none.
"""

from __future__ import annotations

import functools
from importlib import metadata
from typing import Any

from pydantic.json_schema import models_json_schema

from pdspark.router.openai.api_error import ErrorResponse
from pdspark.router.openai.chat_completion_request import ChatCompletionRequest
from pdspark.router.openai.completion_request import CompletionRequest
from pdspark.router.openai.generate_request import GenerateRequest
from pdspark.router.openai.tokenize_request import DetokenizeRequest, TokenizeRequest

_REF = "#/components/schemas/{model}"

# The statuses a generation route answers with an error body (besides 5xx): see `api_error` and `error_middleware`.
_REQUEST_ERRORS = {
    "400": "a value out of range or not supported, or malformed JSON",
    "404": "an unknown model",
    "413": "the request body is over the size limit",
    "415": "the body is not JSON",
    "422": "a field of the wrong type, or a required field missing",
    "429": "no room for the request in the router, or its API key has too many in flight: retry after `Retry-After` "
           "seconds",
}
# What every keyed route may answer.
_KEY_ERRORS = {"401": "no API key, or one that is not valid (when the router has API keys)"}
_SECURITY_SCHEMES = {"apiKey": {"type": "http", "scheme": "bearer",
                                "description": "an API key of the router (`--api-key`), sent as `Authorization: "
                                               "Bearer <key>`"}}


# One server-sent event of a stream: its `data` is a JSON chunk (or an error object), the last one `[DONE]`.
_SSE_EVENT = {"type": "object", "required": ["data"],
              "properties": {"data": {"type": "string"}, "event": {"type": "string"}}}


def _version() -> str:
    try:
        return metadata.version("pdspark")
    except metadata.PackageNotFoundError:
        return "0+unknown"


def _error_responses(statuses: dict[str, str]) -> dict[str, Any]:
    error = {"application/json": {"schema": {"$ref": _REF.format(model="ErrorResponse")}}}
    out = {status: {"description": why, "content": error} for status, why in statuses.items()}
    out["5XX"] = {"description": "a server-side failure (no worker, a worker failed, a deadline passed)",
                  "content": error}
    return out


# Request examples (what common clients send); `model` is left out: it may be omitted, and the name is the server's.
EXAMPLES: dict[str, dict[str, dict[str, Any]]] = {
    "CompletionRequest": {
        "text": {"summary": "a text prompt", "value": {"prompt": "def fibonacci(n):", "max_tokens": 16,
                                                       "temperature": 0}},
        "token_ids": {"summary": "token ids, streamed with usage",
                      "value": {"prompt": [5, 6, 7], "max_tokens": 8, "stream": True,
                                "stream_options": {"include_usage": True}}},
    },
    "ChatCompletionRequest": {
        "openai": {"summary": "the openai SDK", "value": {
            "messages": [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "a stack"}],
            "max_completion_tokens": 32, "temperature": 0.7, "top_p": 0.95, "seed": 1}},
        "guidellm": {"summary": "guidellm's default request", "value": {
            "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True},
            "max_completion_tokens": 16, "stop": None, "ignore_eos": True,
            "messages": [{"role": "user", "content": [{"type": "text", "text": "the quick brown fox"}]}]}},
    },
    "GenerateRequest": {
        "sglang": {"summary": "SGLang's native shape", "value": {
            "text": "def main():", "sampling_params": {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True}}},
    },
    "TokenizeRequest": {
        "lm_eval": {"summary": "lm-evaluation-harness's remote tokenizer",
                    "value": {"prompt": "def main():", "add_special_tokens": False}},
        "chat": {"summary": "chat messages, as the chat route renders them",
                 "value": {"messages": [{"role": "user", "content": "hello"}], "return_token_strs": True}},
    },
    "DetokenizeRequest": {"ids": {"summary": "token ids", "value": {"tokens": [5, 6, 7]}}},
}
# The tokenizer routes' answers (vLLM's shapes).
_TOKENIZE_RESPONSE = {"type": "object", "required": ["count", "max_model_len", "tokens", "token_strs"], "properties": {
    "count": {"type": "integer"}, "max_model_len": {"type": "integer"},
    "tokens": {"type": "array", "items": {"type": "integer"}},
    "token_strs": {"anyOf": [{"type": "array", "items": {"type": ["string", "null"]}}, {"type": "null"}]}}}
_DETOKENIZE_RESPONSE = {"type": "object", "required": ["prompt"], "properties": {"prompt": {"type": "string"}}}
# What the tokenizer routes refuse (no admission: no 429).
_TOKENIZER_ERRORS = {status: why for status, why in _REQUEST_ERRORS.items() if status != "429"}


def _generation(summary: str, request_model: str, operation_id: str) -> dict[str, Any]:
    return {"post": {
        "summary": summary,
        "operationId": operation_id,
        "requestBody": {"required": True, "content": {"application/json": {
            "schema": {"$ref": _REF.format(model=request_model)}, "examples": EXAMPLES[request_model]}}},
        "responses": {
            "200": {"description": "the completion (JSON), or with `stream` a server-sent event stream of chunks "
                                   "ending with `data: [DONE]`",
                    "content": {"application/json": {"schema": {"type": "object"}},
                                "text/event-stream": {"schema": _SSE_EVENT}}},
            **_error_responses({**_REQUEST_ERRORS, **_KEY_ERRORS}),
        },
    }}


def _post(summary: str, request_model: str, operation_id: str, response: dict[str, Any]) -> dict[str, Any]:
    """A keyed JSON route that is not a generation (one JSON answer, no stream)."""
    return {"post": {
        "summary": summary,
        "operationId": operation_id,
        "requestBody": {"required": True, "content": {"application/json": {
            "schema": {"$ref": _REF.format(model=request_model)}, "examples": EXAMPLES[request_model]}}},
        "responses": {"200": {"description": summary, "content": {"application/json": {"schema": response}}},
                      **_error_responses({**_TOKENIZER_ERRORS, **_KEY_ERRORS})},
    }}


def _get(summary: str, operation_id: str, content_type: str, schema: dict[str, Any],
         keyed: bool = False) -> dict[str, Any]:
    return {"get": {"summary": summary, "operationId": operation_id,
                    "responses": {"200": {"description": summary, "content": {content_type: {"schema": schema}}},
                                  **_error_responses(_KEY_ERRORS if keyed else {})}}}


def _secured(paths: dict[str, Any]) -> dict[str, Any]:
    """`paths` with each operation's key requirement: an API key on the routes that answer 401, none elsewhere."""
    return {path: {method: {**op, "security": [{"apiKey": []}] if "401" in op["responses"] else []}
                   for method, op in ops.items()} for path, ops in paths.items()}


@functools.cache
def openapi_document(api_keys: bool = False) -> dict[str, Any]:
    """The document of a router with API keys or without (built once each; treat it as read-only)."""
    _, defs = models_json_schema(
        [(CompletionRequest, "validation"), (ChatCompletionRequest, "validation"), (GenerateRequest, "validation"),
         (TokenizeRequest, "validation"), (DetokenizeRequest, "validation"), (ErrorResponse, "serialization")],
        ref_template=_REF,
    )
    doc: dict[str, Any] = {
        "openapi": "3.1.0",
        "info": {"title": "pdspark router", "version": _version(),
                 "description": "OpenAI-compatible completions and chat completions, and SGLang-style /generate, "
                                "served by disaggregated prefill/decode workers."},
        "paths": {
            "/v1/completions": _generation("Create a completion", "CompletionRequest", "createCompletion"),
            "/v1/chat/completions": _generation("Create a chat completion", "ChatCompletionRequest",
                                                "createChatCompletion"),
            "/generate": _generation("Generate from text or token ids (SGLang's native shape)", "GenerateRequest",
                                     "generate"),
            "/v1/models": _get("The served model", "listModels", "application/json", {"type": "object"},
                               keyed=True),
            "/tokenize": _post("Tokenize a text or chat messages (vLLM's shape)", "TokenizeRequest", "tokenize",
                               _TOKENIZE_RESPONSE),
            "/detokenize": _post("Turn token ids back into text (vLLM's shape)", "DetokenizeRequest", "detokenize",
                                 _DETOKENIZE_RESPONSE),
            "/tokenizer_info": _get("The tokenizer's configuration: special tokens, chat template, context (vLLM's "
                                    "shape)", "tokenizerInfo", "application/json", {"type": "object"}, keyed=True),
            "/health": _get("Ready: a prefill and a decode worker are healthy (503 otherwise); the readiness probe",
                            "health", "application/json", {"type": "object"}),
            "/live": _get("Alive: the router's event loop answers (whatever the workers); the liveness and startup "
                          "probes", "live", "application/json", {"type": "object"}),
            "/metrics": _get("Prometheus metrics", "metrics", "text/plain", {"type": "string"}),
            "/openapi.json": _get("This document", "openapi", "application/json", {"type": "object"}),
        },
        "components": {"schemas": defs["$defs"]},
    }
    if api_keys:
        doc["paths"] = _secured(doc["paths"])
        doc["components"]["securitySchemes"] = _SECURITY_SCHEMES
    return doc
