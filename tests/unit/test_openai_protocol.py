"""OpenAI request parsing: what OpenAI clients, the openai SDK and guidellm send is accepted and becomes explicit
`SamplingParams`; a bad value is a 400 (a wrong type a 422) whose `param` names the field as the client wrote it."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdspark.router.openai import openai_protocol as oai
from pdspark.router.openai.api_error import ErrorResponse
from pdspark.router.openai.chat_completion_request import ChatCompletionRequest
from pdspark.router.openai.chat_template import ChatTemplate
from pdspark.router.openai.completion_request import CompletionRequest
from pdspark.router.openai.generate_request import GenerateRequest
from pdspark.router.openai.openai_protocol import ApiError
from pdspark.router.openai.sampling_fields import MAX_PROMPT_CHARS, MAX_SEED

MAX_MODEL_LEN = 64


class ByteTokenizer:
    """One token per UTF-8 byte (vocabulary 256): prompt lengths are predictable."""

    def encode(self, text: str) -> list[int]:
        return list(text.encode())


SERVED = oai.ServedModel("m", MAX_MODEL_LEN, 256, ByteTokenizer(), ChatTemplate(None))  # type: ignore[arg-type]


def parse(**body):
    return oai.parse({"prompt": [5, 6, 7], **body}, chat=False, served_model="m", tokenizer=None,
                     chat_template=None, max_model_len=MAX_MODEL_LEN, vocab_size=256)


def chat(body: dict | bytes) -> oai.ParsedRequest:
    return oai.parse(body, chat=True, served_model="m", tokenizer=SERVED.tokenizer, chat_template=SERVED.chat_template,
                     max_model_len=MAX_MODEL_LEN, vocab_size=256)


def completion(body: dict | bytes) -> oai.ParsedRequest:
    return oai.parse(body, chat=False, served_model="m", tokenizer=SERVED.tokenizer, chat_template=None,
                     max_model_len=MAX_MODEL_LEN, vocab_size=256)


def refused(fn, body) -> ApiError:
    with pytest.raises(ApiError) as e:
        fn(body)
    ErrorResponse.model_validate(e.value.body())  # always OpenAI's error object
    return e.value


def test_absent_sampling_values_are_openais_defaults():
    params = parse().params
    assert (params.temperature, params.top_p, params.top_k, params.max_tokens) == (1.0, 1.0, None, 16)


@pytest.mark.parametrize("top_k, expected", [(None, None), (-1, None), (1, 1), (40, 40)])
def test_top_k_off_is_none(top_k, expected):
    # -1 is how vLLM/SGLang clients turn the filter off; the API type has one spelling for it: None.
    assert parse(top_k=top_k).params.top_k == expected


@pytest.mark.parametrize("body, param", [
    ({"top_k": 0}, "top_k"),
    ({"top_k": -2}, "top_k"),
    ({"top_p": 0}, "top_p"),
    ({"temperature": -1}, "temperature"),
])
def test_bad_sampling_values_name_their_field(body, param):
    with pytest.raises(ApiError) as e:
        parse(**body)
    assert e.value.status == 400 and e.value.param == param and f"`{param}`" in e.value.message


# ---- what clients send -------------------------------------------------------------------------------------------
# guidellm 0.8's default request (`/v1/chat/completions`), byte for byte as it builds it.
GUIDELLM_CHAT = {
    "model": "m",
    "stream": True,
    "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    "max_completion_tokens": 8,
    "stop": None,
    "ignore_eos": True,
    "messages": [{"role": "user", "content": [{"type": "text", "text": "the quick brown fox"}]}],
}
GUIDELLM_COMPLETIONS = {
    "model": "m", "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    "max_tokens": 20, "stop": None, "ignore_eos": True, "prompt": "the quick brown fox",
}


def test_guidellms_default_chat_request_is_served_as_sent():
    parsed = chat(json.dumps(GUIDELLM_CHAT).encode())
    assert parsed.stream and parsed.include_usage and parsed.continuous_usage
    p = parsed.params
    assert (p.max_tokens, p.ignore_eos, p.stop_strings) == (8, True, ())
    # A single text part is the same prompt as that text sent as a string.
    as_string = {**GUIDELLM_CHAT, "messages": [{"role": "user", "content": "the quick brown fox"}]}
    assert parsed.prompt_ids == chat(as_string).prompt_ids


def test_guidellms_completions_request_is_served_as_sent():
    parsed = completion(GUIDELLM_COMPLETIONS)
    assert parsed.prompt_ids == list(b"the quick brown fox")
    assert (parsed.params.max_tokens, parsed.params.ignore_eos, parsed.continuous_usage) == (20, True, True)


def test_text_parts_are_joined_by_newlines():
    parts = [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]
    joined = chat({"messages": [{"role": "user", "content": parts}]})
    assert joined.prompt_ids == chat({"messages": [{"role": "user", "content": "one\ntwo"}]}).prompt_ids


@pytest.mark.parametrize("prompt", ["hi there", list(b"hi there"), ["hi there"], [list(b"hi there")]])
def test_every_spelling_of_one_prompt_gives_the_same_tokens(prompt):
    assert completion({"prompt": prompt}).prompt_ids == list(b"hi there")


def test_openai_sdk_fields_become_sampling_params():
    body = {"model": "m", "messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}],
            "max_tokens": 9, "max_completion_tokens": 7, "temperature": 0.5, "top_p": 0.9, "seed": MAX_SEED,
            "stop": "\n\n", "logprobs": True, "top_logprobs": 3, "n": 1, "user": "someone", "top_k": 5,
            "stop_token_ids": [1, 2], "presence_penalty": 0, "frequency_penalty": 0.0, "min_p": 0,
            "repetition_penalty": 1, "logit_bias": {}, "stream": False, "stream_options": None}
    parsed = chat(body)
    p = parsed.params
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.seed) == (7, 0.5, 0.9, 5, MAX_SEED)
    assert (p.stop_strings, p.stop_token_ids, p.logprobs, parsed.logprobs) == (("\n\n",), (1, 2), 3, 3)
    assert not parsed.stream and not parsed.include_usage and not parsed.continuous_usage


def test_unknown_fields_are_ignored():
    plain = completion({"prompt": "x", "max_tokens": 3})
    extra = completion({"prompt": "x", "max_tokens": 3, "service_tier": "auto", "tools": [], "foo": {"bar": [1]}})
    assert plain == extra


def test_chat_logprobs_off_ignores_top_logprobs():
    assert chat({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 5}).params.logprobs is None


def test_the_default_token_budget_fits_the_room_the_prompt_leaves():
    assert completion({"prompt": [1] * (MAX_MODEL_LEN - 4)}).params.max_tokens == 4


# ---- what is refused, and how --------------------------------------------------------------------------------------
CHAT_OK = {"messages": [{"role": "user", "content": "x"}]}


@pytest.mark.parametrize("fn, body, status, param, code", [
    # The values that reached the wire and came back as plain-text 500s.
    (completion, {"prompt": "x", "seed": 2**70}, 400, "seed", "less_than_equal"),
    (completion, {"prompt": "x", "top_k": 2**40}, 400, "top_k", "less_than_equal"),
    (completion, {"prompt": "x", "seed": -1}, 400, "seed", "greater_than_equal"),
    (completion, {"prompt": "x", "top_k": 0}, 400, "top_k", "top_k_zero"),
    (completion, {"prompt": "x", "temperature": 2.01}, 400, "temperature", "less_than_equal"),
    (completion, {"prompt": "x", "top_p": 1.5}, 400, "top_p", "less_than_equal"),
    (completion, {"prompt": "x", "top_p": 5e-324}, 400, "top_p", "greater_than_equal"),
    (completion, {"prompt": "x", "max_tokens": -1}, 400, "max_tokens", "greater_than_equal"),
    (completion, {"prompt": "x", "max_tokens": 0}, 400, "max_tokens", None),  # (0 needs `echo`)
    (completion, {"prompt": "x", "max_tokens": MAX_MODEL_LEN}, 400, "max_tokens", "context_length_exceeded"),
    (completion, {"prompt": "x", "logprobs": 21}, 400, "logprobs", "less_than_equal"),
    (completion, {"prompt": "x", "n": 17}, 400, "n", "less_than_equal"),
    (completion, {"prompt": "x", "n": 3, "best_of": 2}, 400, "best_of", None),
    (completion, {"prompt": "x", "best_of": 3, "stream": True}, 400, "best_of", None),
    (completion, {"prompt": ["x"] * 64, "n": 3}, 400, "n", None),  # 192 generations: over the bound
    (completion, {"prompt": "x", "echo": 0}, 422, "echo", "bool_type"),  # 0 is not false (schemathesis found it)
    (completion, {"prompt": "x", "presence_penalty": 2.5}, 400, "presence_penalty", "less_than_equal"),
    (completion, {"prompt": "x", "frequency_penalty": -3}, 400, "frequency_penalty", "greater_than_equal"),
    (completion, {"prompt": "x", "repetition_penalty": 0}, 400, "repetition_penalty", "greater_than"),
    (completion, {"prompt": "x", "min_p": 1.5}, 400, "min_p", "less_than_equal"),
    (completion, {"prompt": "x", "logit_bias": {"50256": -100}}, 400, "logit_bias", None),  # outside the vocabulary
    (completion, {"prompt": "x", "logit_bias": {"a": 1}}, 400, "logit_bias", None),
    (completion, {"prompt": "x", "logit_bias": {"5": 101}}, 400, "logit_bias.5", "less_than_equal"),
    (completion, {"prompt": "x", "min_tokens": 20, "max_tokens": 4}, 400, "min_tokens", None),
    (completion, {"prompt": "x", "banned_token_ids": [300]}, 400, "banned_token_ids", None),
    (completion, {"prompt": "x", "stop": [str(i) for i in range(17)]}, 400, "stop", "too_long"),
    (completion, {"prompt": "x", "stop": ""}, 400, "stop", "string_too_short"),
    (completion, {"prompt": "x", "stop": ["a", 1]}, 422, "stop[1]", "string_type"),
    (completion, {"prompt": "x", "stop_token_ids": [300]}, 400, "stop_token_ids", None),
    (completion, {"prompt": "x", "model": "other"}, 404, "model", "model_not_found"),
    (completion, {"prompt": ["a"] * 65}, 400, "prompt", "batch_too_large"),
    (completion, {"prompt": [1, 999]}, 400, "prompt", None),
    (completion, {"prompt": [1, -1]}, 400, "prompt[1]", "greater_than_equal"),
    (completion, {"prompt": [1, "a"]}, 422, "prompt[1]", "int_type"),
    (completion, {"prompt": 12}, 422, "prompt", "union_type"),
    (completion, {"prompt": []}, 400, "prompt", "too_short"),
    (completion, {"prompt": "x" * (MAX_PROMPT_CHARS + 1)}, 400, "prompt", "string_too_long"),
    (completion, {"prompt": [1] * MAX_MODEL_LEN}, 400, "prompt", "context_length_exceeded"),
    (completion, {}, 422, "prompt", "missing"),
    (completion, {"prompt": "x", "temperature": "1"}, 422, "temperature", "float_type"),
    (completion, {"prompt": "x", "max_tokens": 5.5}, 422, "max_tokens", "int_type"),
    (completion, {"prompt": "x", "ignore_eos": 1}, 422, "ignore_eos", "bool_type"),
    (completion, {"prompt": "x", "stream_options": {"include_usage": "yes"}}, 422, "stream_options.include_usage",
     "bool_type"),
    (chat, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, 400,
     "messages[0].content[0].type", "unsupported_content"),
    (chat, {"messages": [{"role": "user", "content": [{"type": "text"}]}]}, 422, "messages[0].content[0].text",
     "missing"),
    (chat, {"messages": [{"role": "user", "content": None}]}, 422, "messages[0].content", "missing"),
    (chat, {"messages": [{"role": "user"}]}, 422, "messages[0].content", "missing"),
    (chat, {"messages": [{"role": "user", "content": "x", "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": "{}"}}]}]}, 400, "messages[0].tool_calls",
     "tool_calls_role"),
    (chat, {"messages": [{"role": "user", "content": []}]}, 400, "messages[0].content", "too_short"),
    (chat, {"messages": [{"role": "function", "content": "x"}]}, 400, "messages[0].role", "literal_error"),
    (chat, {"messages": []}, 400, "messages", "too_short"),
    (chat, {"messages": "hello"}, 422, "messages", "list_type"),
    (chat, {**CHAT_OK, "max_completion_tokens": 0}, 400, "max_completion_tokens", "greater_than_equal"),
    (chat, {**CHAT_OK, "max_completion_tokens": 100}, 400, "max_completion_tokens", "context_length_exceeded"),
    (chat, {**CHAT_OK, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs", "less_than_equal"),
    (chat, {**CHAT_OK, "logprobs": 1}, 422, "logprobs", "bool_type"),
])
def test_refused_requests_name_the_field(fn, body, status, param, code):
    e = refused(fn, body)
    assert (e.status, e.param, e.code) == (status, param, code), e.message
    assert f"`{param}`" in e.message and e.type == "invalid_request_error"


class UncalledTokenizer(ByteTokenizer):
    """A tokenizer a text must not reach."""

    def encode(self, text: str) -> list[int]:
        raise AssertionError(f"a text of {len(text)} characters was tokenized")


@pytest.mark.parametrize("route, body, param", [
    ("completions", {"prompt": "x" * 4 * MAX_MODEL_LEN}, "prompt"),
    ("completions", {"prompt": ["x" * 4 * MAX_MODEL_LEN]}, "prompt"),
    ("chat", {"messages": [{"role": "user", "content": "x" * 4 * MAX_MODEL_LEN}]}, "messages"),
    ("generate", {"text": "x" * 4 * MAX_MODEL_LEN}, "text"),
])
def test_a_text_too_long_for_the_context_is_refused_by_its_length_untokenized(route, body, param):
    # At most 4 characters a token: 4 * MAX_MODEL_LEN characters are at least MAX_MODEL_LEN tokens, no room left.
    served = oai.ServedModel("m", MAX_MODEL_LEN, 256, UncalledTokenizer(), ChatTemplate(None),  # type: ignore[arg-type]
                             max_token_chars=4)
    with pytest.raises(ApiError) as e:
        if route == "completions":
            oai.parse_completion(oai.validate(CompletionRequest, body), served)
        elif route == "chat":
            oai.parse_chat(oai.validate(ChatCompletionRequest, body), served)
        else:
            oai.parse_generate(oai.validate(GenerateRequest, body), served)
    assert (e.value.status, e.value.param, e.value.code) == (400, param, "context_length_exceeded")
    assert f"(`{param}`) has" in e.value.message and "characters" in e.value.message, e.value.message
    assert f"maximum context length is {MAX_MODEL_LEN} tokens" in e.value.message
    ErrorResponse.model_validate(e.value.body())


def test_the_length_check_alone_names_the_field_and_leaves_token_ids_alone():
    served = oai.ServedModel("m", MAX_MODEL_LEN, 256, UncalledTokenizer(), None, max_token_chars=4)  # type: ignore[arg-type]
    with pytest.raises(ApiError) as e:
        oai.check_text_fits("x" * 4 * MAX_MODEL_LEN, served, "text")
    assert (e.value.param, e.value.code) == ("text", "context_length_exceeded") and "`text`" in e.value.message
    for fits in ("x" * (4 * MAX_MODEL_LEN - 4), [1] * 10 * MAX_MODEL_LEN, None):
        oai.check_text_fits(fits, served, "text")


def test_a_text_whose_length_may_fit_is_tokenized_and_judged_by_its_tokens():
    served = oai.ServedModel("m", MAX_MODEL_LEN, 256, ByteTokenizer(), ChatTemplate(None),  # type: ignore[arg-type]
                             max_token_chars=4)
    # One character short of the bound: tokenized (one token a byte here), then refused by its tokens.
    text = "x" * (4 * MAX_MODEL_LEN - 4)
    with pytest.raises(ApiError) as e:
        oai.parse_completion(oai.validate(CompletionRequest, {"prompt": text}), served)
    assert e.value.code == "context_length_exceeded" and f"has {len(text)}, which" in e.value.message
    # Without a bound from the tokenizer, only the tokens count.
    unbounded = oai.ServedModel("m", MAX_MODEL_LEN, 256, ByteTokenizer(), ChatTemplate(None))  # type: ignore[arg-type]
    assert oai.parse_completion(oai.validate(CompletionRequest, {"prompt": "x" * 8}), unbounded).prompt_ids


@pytest.mark.parametrize("raw, message", [
    (b"{not json", "malformed JSON"),
    (b"", "malformed JSON"),
    (b'{"prompt": "x", "temperature": NaN}', "finite"),
    (b'{"prompt": "x", "temperature": 1e999}', "finite"),
    (b'{"prompt": "a\\ud800"}', "malformed JSON"),  # a lone surrogate cannot reach the tokenizer
    (b"[" * 5000, "malformed JSON"),  # nesting is bounded by the parser
    (b'["prompt"]', "JSON object"),
    (b"null", "JSON object"),
])
def test_bodies_that_are_not_a_request_object_are_400(raw, message):
    e = refused(completion, raw)
    assert e.status == 400 and message in e.message


def test_all_problems_are_counted_and_the_first_is_named():
    e = refused(completion, {"prompt": "x", "temperature": 9, "top_p": 9, "seed": -1})
    assert e.param == "temperature" and "2 more problems" in e.message


# ---- bounds ----------------------------------------------------------------------------------------------------------
BOUNDS = {  # field: (smallest, largest) accepted
    "temperature": (0, 2),
    "top_p": (1e-6, 1),
    "top_k": (-1, 2**31 - 1),  # and not 0
    "seed": (0, 2**63 - 1),
    "logprobs": (0, 20),
    "max_tokens": (1, MAX_MODEL_LEN - 1),  # the prompt is one token
}
NUMBERS = st.one_of(st.integers(-(2**70), 2**70), st.floats(allow_nan=False, allow_infinity=False),
                    st.sampled_from([-1, 0, 1, 2, 20, 21, 2**31 - 1, 2**31, 2**63 - 1, 2**63, MAX_MODEL_LEN]))


@pytest.mark.parametrize("field", sorted(BOUNDS))
def test_a_number_is_accepted_exactly_within_its_bounds(field):
    low, high = BOUNDS[field]
    integer = field in ("top_k", "seed", "logprobs", "max_tokens")

    @settings(max_examples=150, derandomize=True, database=None, deadline=None)
    @given(value=NUMBERS)
    def check(value):
        within = low <= value <= high and (not integer or isinstance(value, int)) and not (field == "top_k" and
                                                                                         value == 0)
        try:
            oai.parse({"prompt": [5], field: value}, chat=False, served_model="m", tokenizer=None,
                      chat_template=None, max_model_len=MAX_MODEL_LEN, vocab_size=256)
        except ApiError as e:
            assert not within, f"{field}={value!r} refused: {e.message}"
            assert e.param == field and e.status in (400, 422)
        else:
            assert within, f"{field}={value!r} accepted"

    check()


# ---- /generate -----------------------------------------------------------------------------------------------------
def generate(body: dict) -> oai.ParsedRequest:
    return oai.parse_generate(oai.validate(GenerateRequest, body), SERVED)


def test_generate_reads_sglangs_sampling_params():
    parsed = generate({"input_ids": [1, 2, 3], "stream": True, "sampling_params": {
        "max_new_tokens": 5, "temperature": 0, "ignore_eos": True, "stop": ["x"], "min_new_tokens": 0}})
    p = parsed.params
    assert parsed.prompt_ids == [1, 2, 3] and parsed.stream
    assert (p.max_tokens, p.temperature, p.ignore_eos, p.stop_strings) == (5, 0.0, True, ("x",))
    assert generate({"text": "ab"}).prompt_ids == [97, 98]


@pytest.mark.parametrize("body, status, param", [
    ({}, 422, "text"),
    ({"text": "a", "input_ids": [1]}, 400, "input_ids"),
    ({"input_ids": [1], "sampling_params": {"max_new_tokens": 1000}}, 400, "sampling_params.max_new_tokens"),
    ({"input_ids": [1], "sampling_params": {"top_k": 2**40}}, 400, "sampling_params.top_k"),
    ({"input_ids": [1], "sampling_params": {"stop_token_ids": [999]}}, 400, "sampling_params.stop_token_ids"),
    ({"input_ids": [1], "rid": "x" * 1000}, 400, "rid"),
    ({"input_ids": [256]}, 400, "input_ids"),
    ({"text": ["a", "b"]}, 422, "text"),
])
def test_generate_refusals_name_the_field(body, status, param):
    e = refused(generate, body)
    assert (e.status, e.param) == (status, param), e.message
