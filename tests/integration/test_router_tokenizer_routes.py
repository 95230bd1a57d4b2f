"""The router's tokenizer routes in vLLM's shapes (`POST /tokenize`, `POST /detokenize`, `GET /tokenizer_info`), over
a real socket with the shipped model's tokenizer: the ids its completions use, the chat route's rendering, text back
from ids, the tokenizer's configuration, errors naming the field, and API keys required as for generation."""

from __future__ import annotations

import json

import pytest
from test_router_http import call, openai_error

from pdspark.assets import resolve_model
from pdspark.model.tokenizer import Tokenizer
from pdspark.router.openai.chat_template import ChatTemplate
from router_app import RouterApp

TEXT = "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n"


@pytest.fixture(scope="module")
def app():
    r = RouterApp()
    yield r
    r.close()


@pytest.fixture(scope="module")
def tokenizer():
    tok = Tokenizer.from_dir(resolve_model("dsv4-tiny"))
    assert tok is not None
    return tok


def test_tokenize_gives_the_ids_completions_use_and_detokenize_gives_the_text_back(app, tokenizer):
    status, _, raw = call(app, "POST", "/tokenize", {"prompt": TEXT, "add_special_tokens": False,
                                                      "return_token_strs": True})
    body = json.loads(raw)
    assert status == 200 and body["tokens"] == tokenizer.encode(TEXT, add_special_tokens=False)
    assert body["count"] == len(body["tokens"]) > 0 and body["max_model_len"] == 256
    assert body["token_strs"] == [tokenizer.id_to_token(t) for t in body["tokens"]]
    default = json.loads(call(app, "POST", "/tokenize", {"prompt": TEXT})[2])
    assert default["tokens"] == tokenizer.encode(TEXT) and default["token_strs"] is None  # (what completions send)
    status, _, raw = call(app, "POST", "/detokenize", {"tokens": body["tokens"]})
    assert status == 200 and json.loads(raw) == {"prompt": TEXT}


def test_chat_messages_tokenize_as_the_chat_route_renders_them(app, tokenizer):
    messages = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": TEXT}]
    body = json.loads(call(app, "POST", "/tokenize", {"messages": messages})[2])
    rendered = ChatTemplate(tokenizer.chat_template).render(messages)
    assert body["tokens"] == tokenizer.encode(rendered, add_special_tokens=False)
    no_prompt = json.loads(call(app, "POST", "/tokenize", {"messages": messages, "add_generation_prompt": False})[2])
    assert no_prompt["count"] < body["count"]


def test_tokenizer_info_gives_the_special_tokens_and_the_chat_template(app, tokenizer):
    status, _, raw = call(app, "GET", "/tokenizer_info")
    info = json.loads(raw)
    assert status == 200
    assert (info["eos_token"], info["bos_token"], info["pad_token"]) == ("<|eos|>", "<|bos|>", "<|pad|>")
    assert info["chat_template"] == tokenizer.chat_template and info["model_max_length"] == 256
    assert info["vocab_size"] == app.vocab_size and info["tokenizer_class"] == "PreTrainedTokenizerFast"


@pytest.mark.parametrize("path, body, status, param", [
    ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, 400, "prompt"),
    ("/tokenize", {}, 400, "prompt"),
    ("/tokenize", {"prompt": "a", "model": "other"}, 404, "model"),
    ("/tokenize", {"prompt": 5}, 422, "prompt"),
    ("/detokenize", {"tokens": [1, 10**6]}, 400, "tokens"),
    ("/detokenize", {"tokens": [-1]}, 400, "tokens[0]"),
    ("/detokenize", {}, 422, "tokens"),
])
def test_bad_input_is_an_error_naming_the_field(app, path, body, status, param):
    got_status, headers, raw = call(app, "POST", path, body)
    assert got_status == status and openai_error(got_status, headers, raw)["param"] == param


def test_a_keyed_router_asks_for_a_key_as_for_generation():
    keyed = RouterApp(api_key=("k-0123456789abcdef",))
    try:
        for method, path, body in (("POST", "/tokenize", {"prompt": "a"}), ("POST", "/detokenize", {"tokens": [5]}),
                                   ("GET", "/tokenizer_info", None)):
            status, headers, raw = call(keyed, method, path, body)
            assert status == 401, path
            openai_error(status, headers, raw)
    finally:
        keyed.close()
