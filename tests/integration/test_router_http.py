"""The router's HTTP API over a real socket, workers faked (`router_app.RouterApp`): every error on every path is
OpenAI's error object (404, 405, 413, 415, 400, 422, 500), streams carry usage as asked, guidellm's and the openai
SDK's requests are served, and `/openapi.json` documents exactly the public routes."""

from __future__ import annotations

import json
import logging
import socket
import urllib.error
import urllib.request

import openai
import pytest

from pdspark.router.openai.api_error import ErrorResponse
from pdspark.router.openai.openapi_document import openapi_document
from pdspark.testing.time_scale import scaled
from router_app import FAIL_AT_ONCE, FAIL_MID_STREAM, HANG_AFTER_FIRST, RouterApp


@pytest.fixture(scope="module")
def app():
    r = RouterApp()
    yield r
    r.close()


def call(app: RouterApp, method: str, path: str, body: bytes | dict | None = None,
         content_type: str | None = "application/json") -> tuple[int, dict, bytes]:
    data = body if body is None or isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"Content-Type": content_type} if content_type and data is not None else {}
    req = urllib.request.Request(app.url + path, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=scaled(30)) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


def openai_error(status: int, headers: dict, raw: bytes) -> dict:
    """The error object of a response, checked to be exactly OpenAI's shape."""
    assert headers["Content-Type"].startswith("application/json"), (status, headers, raw[:200])
    body = json.loads(raw)
    ErrorResponse.model_validate(body)
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


def events(raw: bytes) -> list:
    """The `data:` payloads of an SSE body, JSON-decoded except the final `[DONE]`."""
    out = []
    for block in raw.decode().split("\n\n"):
        if block.startswith("data: "):
            data = block[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


CHAT = {"messages": [{"role": "user", "content": "hello"}]}


@pytest.mark.parametrize("method, path, body, content_type, status, param, code", [
    ("GET", "/no/such/route", None, None, 404, None, "not_found"),
    ("POST", "/v1/nothing", {"prompt": "x"}, "application/json", 404, None, "not_found"),
    ("GET", "/v1/completions", None, None, 405, None, "method_not_allowed"),
    ("DELETE", "/v1/chat/completions", None, None, 405, None, "method_not_allowed"),
    ("POST", "/health", {}, "application/json", 405, None, "method_not_allowed"),
    ("POST", "/v1/completions", {"prompt": "x"}, "text/plain", 415, None, "unsupported_media_type"),
    ("POST", "/v1/chat/completions", b"a=b", "application/x-www-form-urlencoded", 415, None,
     "unsupported_media_type"),
    ("POST", "/v1/completions", b"{not json", "application/json", 400, None, "invalid_json"),
    ("POST", "/v1/completions", b"[1, 2]", "application/json", 400, None, "model_type"),
    ("POST", "/v1/completions", {"prompt": "x", "seed": 2**70}, "application/json", 400, "seed", "less_than_equal"),
    ("POST", "/v1/completions", {"prompt": "x", "top_k": 2**40}, "application/json", 400, "top_k", "less_than_equal"),
    ("POST", "/v1/completions", {"prompt": "x", "suffix": "y"}, "application/json", 400, "suffix", "unsupported_value"),
    ("POST", "/v1/completions", {"prompt": 12}, "application/json", 422, "prompt", "union_type"),
    ("POST", "/v1/completions", {"prompt": "x", "model": "gpt-5"}, "application/json", 404, "model",
     "model_not_found"),
    ("POST", "/v1/chat/completions", {**CHAT, "seed": 2**64}, "application/json", 400, "seed", "less_than_equal"),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "input_audio"}]}]},
     "application/json", 400, "messages[0].content[0].type", "unsupported_content"),
    ("POST", "/generate", {"sampling_params": {}}, "application/json", 422, "text", "missing"),
    ("POST", "/generate", {"input_ids": [1], "sampling_params": {"top_k": 2**40}}, "application/json", 400,
     "sampling_params.top_k", "less_than_equal"),
])
def test_every_error_is_an_openai_error_object(app, method, path, body, content_type, status, param, code):
    got, headers, raw = call(app, method, path, body, content_type)
    assert got == status, raw[:300]
    err = openai_error(got, headers, raw)
    assert (err["param"], err["code"]) == (param, code), err
    assert err["type"] == "invalid_request_error" and err["message"]
    if status == 405:
        assert headers["Allow"]  # which methods the route does take


def test_an_unexpected_exception_is_a_logged_500_without_the_traceback(app, caplog):
    with caplog.at_level(logging.ERROR, logger="pdspark.router.error_middleware"):
        for stream in (False, True):  # a stream that failed before its first chunk has sent nothing yet
            status, headers, raw = call(app, "POST", "/v1/completions", {"prompt": [FAIL_AT_ONCE], "stream": stream})
            assert status == 500
            err = openai_error(status, headers, raw)
            assert (err["type"], err["code"]) == ("server_error", "internal_error")
            assert b"Traceback" not in raw and b"RuntimeError" not in raw
    logged = [r for r in caplog.records if r.exc_info and "a bug before the first token" in str(r.exc_info[1])]
    assert len(logged) == 2


def test_a_stream_broken_by_a_bug_ends_with_an_error_event(app, caplog):
    with caplog.at_level(logging.ERROR, logger="pdspark.router.http_api"):
        status, _, raw = call(app, "POST", "/v1/completions", {"prompt": [FAIL_MID_STREAM], "stream": True})
    got = events(raw)
    assert status == 200 and got[0]["choices"][0]["text"] == "a"
    assert got[1]["error"]["code"] == "internal_error" and got[-1] == "[DONE]"
    assert any("a bug after the first token" in str(r.exc_info[1]) for r in caplog.records if r.exc_info)


def test_a_client_leaving_mid_stream_is_not_an_error(app, caplog):
    host, port = app.url.removeprefix("http://").split(":")
    body = json.dumps({"prompt": [HANG_AFTER_FIRST], "stream": True}).encode()
    app.dispatcher.hung_closed.clear()
    with caplog.at_level(logging.WARNING):
        with socket.create_connection((host, int(port)), timeout=scaled(30)) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
            received = b""
            while b"data:" not in received:
                received += sock.recv(4096)
        # The request is closed on the server (the dispatcher's stream with it) once the client has gone.
        assert app.dispatcher.hung_closed.wait(scaled(10))
    assert not [r for r in caplog.records if r.name.startswith("pdspark") and r.levelno >= logging.WARNING]


def test_a_body_over_the_limit_is_413_however_it_is_sent():
    small = RouterApp(max_body_bytes=1024)  # the smallest limit allowed
    try:
        status, headers, raw = call(small, "POST", "/v1/completions", {"prompt": "x" * 2000})
        err = openai_error(status, headers, raw)
        assert status == 413 and err["code"] == "request_too_large" and "1024" in err["message"]
        # Without a Content-Length (chunked), the limit holds while reading.
        chunks = iter([b'{"prompt": "', b"x" * 2000, b'"}'])
        req = urllib.request.Request(small.url + "/v1/completions", data=chunks, method="POST",
                                     headers={"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req, timeout=scaled(30))
        assert e.value.code == 413 and openai_error(413, dict(e.value.headers), e.value.read())
        # Just under the limit is served.
        status, _, _ = call(small, "POST", "/v1/completions", {"prompt": "x" * 900, "max_tokens": 1})
        assert status == 200
    finally:
        small.close()


# ---- streams and usage ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("options, every_chunk, last_chunk", [
    (None, False, False),
    ({"include_usage": True}, False, True),
    ({"continuous_usage_stats": True}, True, False),
    ({"include_usage": True, "continuous_usage_stats": True}, True, True),
])
def test_stream_usage_is_sent_as_asked(app, options, every_chunk, last_chunk):
    body = {**CHAT, "stream": True, "max_tokens": 3, **({"stream_options": options} if options else {})}
    status, _, raw = call(app, "POST", "/v1/chat/completions", body)
    got = events(raw)
    assert status == 200 and got[-1] == "[DONE]"
    chunks = [e for e in got[:-1] if e["choices"]]
    assert len(chunks) == 3
    if every_chunk:
        assert [c["usage"]["completion_tokens"] for c in chunks] == [1, 2, 3]
        assert all(c["usage"]["total_tokens"] == c["usage"]["prompt_tokens"] + i + 1 for i, c in enumerate(chunks))
    else:
        assert not any("usage" in c for c in chunks)
    usage_only = [e for e in got[:-1] if not e["choices"]]
    assert len(usage_only) == (1 if last_chunk else 0)
    if last_chunk:
        assert usage_only[0]["usage"]["completion_tokens"] == 3 and got[-2] is usage_only[0]


def test_guidellms_default_request_is_served(app):
    body = {"model": "tiny", "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True},
            "max_completion_tokens": 8, "stop": None, "ignore_eos": True,
            "messages": [{"role": "user", "content": [{"type": "text", "text": "the quick brown fox"}]}]}
    status, _, raw = call(app, "POST", "/v1/chat/completions", body)
    got = events(raw)
    assert status == 200 and got[-1] == "[DONE]"
    assert all("usage" in e for e in got[:-1]) and got[-2]["usage"]["completion_tokens"] == 3
    prompt_ids, params = app.dispatcher.requests[-1]
    assert (params.max_tokens, params.ignore_eos, params.stop_strings) == (8, True, ())


# ---- the openai SDK ----------------------------------------------------------------------------------------------
def test_the_openai_sdk_is_served_and_gets_its_errors(app):
    client = openai.OpenAI(base_url=app.url + "/v1", api_key="none", max_retries=0)
    chunks = list(client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
        max_completion_tokens=2, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "aa"
    assert chunks[-1].usage.completion_tokens == 2
    reply = client.completions.create(model="tiny", prompt="hi", max_tokens=3, seed=7, stop=["\n"])
    assert reply.choices[0].text == "aaa" and reply.usage.completion_tokens == 3
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt="hi", seed=2**70)
    assert e.value.param == "seed" and e.value.code == "less_than_equal"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], n=17)
    assert e.value.param == "n"
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="other", prompt="hi")
    assert e.value.param == "model"


# ---- /openapi.json -----------------------------------------------------------------------------------------------
def test_openapi_json_documents_exactly_the_public_routes(app):
    status, headers, raw = call(app, "GET", "/openapi.json")
    doc = json.loads(raw)
    assert status == 200 and headers["Content-Type"].startswith("application/json") and doc == openapi_document()
    served = {(r.method.lower(), r.resource.canonical) for r in app.app.router.routes()  # type: ignore[union-attr]
              if r.method != "HEAD" and r.resource is not None
              and r.resource.canonical not in ("/workers", "/prometheus/targets")}  # the admin's routes
    documented = {(method, path) for path, ops in doc["paths"].items() for method in ops}
    assert documented == served
    for path, ops in doc["paths"].items():
        if "post" in ops:
            ref = ops["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
            assert ref.removeprefix("#/components/schemas/") in doc["components"]["schemas"], path


def test_the_sampling_controls_reach_the_workers_as_sent(app):
    """OpenAI's `logit_bias` (token ids as strings), the penalties, min-p and `min_tokens`, and SGLang's
    `min_new_tokens` on `/generate`: what the worker's protobuf request carries."""
    body = {"prompt": [5, 6], "max_tokens": 4, "presence_penalty": 0.5, "frequency_penalty": -0.25,
            "repetition_penalty": 1.1, "min_p": 0.1, "min_tokens": 2, "logit_bias": {"9": -100, "3": 1.5},
            "banned_token_ids": [4]}
    status, _, raw = call(app, "POST", "/v1/completions", body)
    assert status == 200, raw
    params = app.dispatcher.requests[-1][1]
    assert (params.presence_penalty, params.frequency_penalty, params.repetition_penalty, params.min_p,
            params.min_tokens, params.logit_bias, params.banned_token_ids) == (0.5, -0.25, 1.1, 0.1, 2,
                                                                               {9: -100.0, 3: 1.5}, (4,))
    status, _, raw = call(app, "POST", "/generate", {"input_ids": [5], "sampling_params": {"max_new_tokens": 4,
                                                                                           "min_new_tokens": 3}})
    assert status == 200 and app.dispatcher.requests[-1][1].min_tokens == 3, raw


def test_n_choices_and_a_batch_of_prompts_fan_out_one_request_per_candidate(app):
    """Each (prompt, choice) is a request of its own with the choice's seed (`choice_seed`); the choices come back
    indexed `prompt * n + choice`, the usage counts each prompt once; streamed, every chunk names its choice."""
    from pdspark.router.openai.openai_protocol import choice_seed

    before = len(app.dispatcher.requests)
    status, _, raw = call(app, "POST", "/v1/completions", {"prompt": [[5, 6], [7, 8, 9]], "n": 2, "max_tokens": 3,
                                                            "seed": 40})
    body = json.loads(raw)
    assert status == 200 and [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    sent = app.dispatcher.requests[before:]
    assert sorted((ids, p.seed) for ids, p in sent) == sorted(
        (ids, choice_seed(40, j)) for ids in ([5, 6], [7, 8, 9]) for j in range(2))
    assert choice_seed(40, 0) == 40 and len({choice_seed(40, j) for j in range(16)}) == 16
    assert body["usage"]["prompt_tokens"] == 5 and body["usage"]["completion_tokens"] == 4 * 3
    status, _, raw = call(app, "POST", "/v1/completions", {"prompt": [5, 6], "best_of": 3, "n": 2, "max_tokens": 2})
    assert status == 200 and len(json.loads(raw)["choices"]) == 2
    assert all(p.logprobs == 0 for _, p in app.dispatcher.requests[-3:])  # (what ranks the candidates)
    status, _, raw = call(app, "POST", "/v1/chat/completions", {**CHAT, "n": 2, "max_tokens": 2, "stream": True,
                                                                 "stream_options": {"include_usage": True}})
    chunks = events(raw)
    assert status == 200 and chunks[-1] == "[DONE]" and chunks[-2]["usage"]["completion_tokens"] == 4
    by_choice: dict[int, list] = {}
    for c in chunks[:-2]:
        by_choice.setdefault(c["choices"][0]["index"], []).append(c["choices"][0]["delta"])
    assert sorted(by_choice) == [0, 1]
    assert all(deltas[0].get("role") == "assistant" and "".join(d["content"] for d in deltas) == "aa"
               for deltas in by_choice.values())


def test_one_failing_candidate_ends_the_whole_request_and_the_others_are_stopped(app, caplog):
    status, headers, raw = call(app, "POST", "/v1/completions", {"prompt": [[5], [FAIL_AT_ONCE]], "n": 2,
                                                                  "max_tokens": 3})
    assert status == 500 and openai_error(status, headers, raw)["type"] == "server_error"
    # Streamed: a 500 when the failure comes before any chunk, else the stream ends with the error event.
    status, headers, raw = call(app, "POST", "/v1/completions", {"prompt": [[5], [FAIL_AT_ONCE]], "n": 2,
                                                                  "max_tokens": 3, "stream": True})
    if status == 500:
        assert openai_error(status, headers, raw)["type"] == "server_error"
    else:
        assert status == 200 and events(raw)[-1]["error"]["type"] == "server_error"
    status, _, raw = call(app, "POST", "/v1/completions", {"prompt": [5], "n": 2, "max_tokens": 3})
    assert status == 200 and len(json.loads(raw)["choices"]) == 2  # (and the router goes on serving)


def test_echo_puts_the_prompt_before_the_completion_and_asks_the_workers_for_its_logprobs(app):
    status, _, raw = call(app, "POST", "/v1/completions", {"prompt": "hi", "echo": True, "max_tokens": 3})
    assert status == 200 and json.loads(raw)["choices"][0]["text"] == "hiaaa"
    assert app.dispatcher.requests[-1][1].prompt_logprobs is None  # no logprobs asked: the text only
    status, _, raw = call(app, "POST", "/v1/completions", {"prompt": [5, 6], "echo": True, "logprobs": 1,
                                                            "max_tokens": 1})
    logprobs = json.loads(raw)["choices"][0]["logprobs"]
    assert status == 200 and app.dispatcher.requests[-1][1].prompt_logprobs == 1
    # The two prompt tokens (the fake workers send no logprobs of their own tokens, nor of the prompt's).
    assert logprobs["token_logprobs"] == [None] and len(logprobs["tokens"]) == 2


SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.mark.parametrize("path, extra, want", [
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA,
                                                                                        "strict": True}}},
     ("json", json.dumps(SCHEMA, separators=(",", ":")))),
    ("/v1/chat/completions", {"response_format": {"type": "json_object"}}, ("json_object", "")),
    ("/v1/chat/completions", {"response_format": {"type": "text"}}, None),
    ("/v1/completions", {"structured_outputs": {"regex": "[0-9]+"}}, ("regex", "[0-9]+")),
    ("/v1/completions", {"structured_outputs": {"choice": ["x", "y"]}}, ("choice", '["x","y"]')),
    ("/v1/completions", {"structured_outputs": {"json": json.dumps(SCHEMA)}},
     ("json", json.dumps(SCHEMA, separators=(",", ":")))),
    ("/v1/completions", {"guided_grammar": 'root ::= "a"'}, ("grammar", 'root ::= "a"')),
    ("/generate", {"sampling_params": {"max_new_tokens": 2, "json_schema": json.dumps(SCHEMA)}},
     ("json", json.dumps(SCHEMA, separators=(",", ":")))),
    ("/generate", {"sampling_params": {"max_new_tokens": 2, "ebnf": 'root ::= "b"'}}, ("grammar", 'root ::= "b"')),
], ids=["json_schema", "json_object", "text", "regex", "choice", "json_text", "guided_grammar", "sglang_json",
        "sglang_ebnf"])
def test_every_spelling_of_an_output_constraint_reaches_the_workers(app, path, extra, want):
    body = ({"messages": [{"role": "user", "content": "hi"}]} if "chat" in path else
            {"text": "hi"} if path == "/generate" else {"prompt": "hi"})
    status, _, raw = call(app, "POST", path, {**body, "max_tokens": 2, **extra} if path != "/generate" else
                          {**body, **extra})
    assert status == 200, raw
    so = app.dispatcher.requests[-1][1].structured_outputs
    assert (so.kind, so.spec) == want if want else so is None


@pytest.mark.parametrize("extra, param", [
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "structured_outputs.regex"),
    ({"structured_outputs": {"regex": "a", "grammar": "root ::= \"a\""}}, "structured_outputs"),
    ({"structured_outputs": {}}, "structured_outputs"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "yaml"}}, "response_format.type"),
    ({"structured_outputs": {"json": "[1]"}}, "structured_outputs.json"),
    ({"structured_outputs": {"json": "{not json"}}, "structured_outputs.json"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ({"structured_outputs": {"regex": "REFUSE("}}, "structured_outputs.regex"),  # the worker's compile refuses it
])
def test_a_bad_output_constraint_is_a_400_naming_its_field(app, extra, param):
    status, _, raw = call(app, "POST", "/v1/completions", {"prompt": "hi", "max_tokens": 2, **extra})
    body = json.loads(raw)
    assert status in (400, 422) and body["error"]["param"] == param, body


TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


@pytest.fixture(scope="module")
def long_app():
    """A context long enough for the tools' section of the system prompt."""
    r = RouterApp(max_model_len=2048)
    yield r
    r.close()


def test_a_forced_tool_call_runs_under_the_call_grammar_and_auto_under_none(long_app):
    app = long_app
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "tools": TOOLS}
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        status, _, raw = call(app, "POST", "/v1/chat/completions", {**chat, "tool_choice": choice})
        so = app.dispatcher.requests[-1][1].structured_outputs
        assert status == 200 and so.kind == "structural_tag" and "get_weather" in so.spec, raw
    for choice in ("auto", "none"):
        status, _, raw = call(app, "POST", "/v1/chat/completions", {**chat, "tool_choice": choice})
        assert status == 200 and app.dispatcher.requests[-1][1].structured_outputs is None, raw


@pytest.mark.parametrize("extra, param", [
    ({"tool_choice": "required", "tools": None}, "tool_choice"),
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice.function.name"),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools[0].function.name"),
    ({"messages": [{"role": "user"}]}, "messages[0].content"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"type": "function", "function": {
        "name": "get_weather", "arguments": "{not json"}}]}]}, "messages[0].tool_calls[0].function.arguments"),
])
def test_a_bad_tool_request_is_refused_naming_its_field(long_app, extra, param):
    app = long_app
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "tools": TOOLS, **extra}
    status, _, raw = call(app, "POST", "/v1/chat/completions", {k: v for k, v in body.items() if v is not None})
    error = json.loads(raw)["error"]
    assert status in (400, 422) and error["param"] == param, error


def test_max_tokens_zero_with_echo_returns_the_prompt_alone(app):
    """OpenAI's scoring request: the prompt's text and logprobs, no completion (one token is generated for the
    prompt's logprobs and dropped); without `echo` it is refused."""
    status, _, raw = call(app, "POST", "/v1/completions", {"prompt": [5, 6], "echo": True, "logprobs": 1,
                                                            "max_tokens": 0})
    body = json.loads(raw)
    choice = body["choices"][0]
    assert status == 200 and choice["finish_reason"] == "length" and body["usage"]["completion_tokens"] == 0, body
    # (the fake workers send no prompt logprobs: the first position's null alone; the two prompt tokens)
    assert choice["logprobs"]["token_logprobs"] == [None] and len(choice["logprobs"]["tokens"]) == 2
    assert app.dispatcher.requests[-1][1].max_tokens == 1 and app.dispatcher.requests[-1][1].prompt_logprobs == 1
    status, _, raw = call(app, "POST", "/v1/completions", {"prompt": [5, 6], "max_tokens": 0})
    assert status == 400 and json.loads(raw)["error"]["param"] == "max_tokens"


def test_echo_streams_the_prompt_first_in_each_choices_first_chunk(app):
    status, _, raw = call(app, "POST", "/v1/completions", {"prompt": ["hi", "yo"], "echo": True, "max_tokens": 2,
                                                            "stream": True})
    got = events(raw)
    assert status == 200 and got[-1] == "[DONE]"
    texts: dict[int, str] = {}
    for c in got[:-1]:
        texts[c["choices"][0]["index"]] = texts.get(c["choices"][0]["index"], "") + c["choices"][0]["text"]
    assert texts == {0: "hiaa", 1: "yoaa"}
    status, _, raw = call(app, "POST", "/v1/completions", {"prompt": "hi", "echo": True, "max_tokens": 0,
                                                            "stream": True, "stream_options": {"include_usage": True}})
    got = events(raw)
    assert [c["choices"][0]["text"] for c in got[:-2]] == ["hi"] and got[-2]["usage"]["completion_tokens"] == 0


def test_live_answers_while_health_says_no_worker_is_healthy():
    """The liveness probe's route does not depend on the workers (a router whose workers load slowly must not be
    restarted in a loop); /health does."""
    r = RouterApp()
    try:
        r.core.registry.workers.clear()  # (no worker at all: what a router sees before its workers come)
        status, _, raw = call(r, "GET", "/live")
        assert status == 200 and json.loads(raw) == {"status": "alive"}
        status, _, raw = call(r, "GET", "/health")
        assert status == 503 and json.loads(raw)["status"] == "degraded"
    finally:
        r.close()
