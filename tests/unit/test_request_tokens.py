"""`Request.tokens_between`: a slice of prompt + output without building the whole list (a decode step's token)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from pdspark.engine.request import Request
from pdspark.types import SamplingParams


@given(prompt=st.lists(st.integers(0, 99), min_size=1, max_size=12),
       output=st.lists(st.integers(0, 99), max_size=12), data=st.data())
def test_tokens_between_is_the_slice_of_all_tokens(prompt, output, data):
    req = Request("r", prompt, SamplingParams())
    req.output_token_ids = list(output)
    n = len(prompt) + len(output)
    start = data.draw(st.integers(0, n))
    end = data.draw(st.integers(start, n))
    assert req.tokens_between(start, end) == req.all_token_ids[start:end]
