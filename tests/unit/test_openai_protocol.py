"""OpenAI request parsing: sampling values become explicit `SamplingParams`, bad ones a 400 naming the field."""

from __future__ import annotations

import pytest

from pdspark.router import openai_protocol as oai
from pdspark.router.openai_protocol import ApiError


def parse(**body):
    return oai.parse({"prompt": [5, 6, 7], **body}, chat=False, served_model="m", tokenizer=None,
                     chat_template=None, max_model_len=64, vocab_size=256)


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
