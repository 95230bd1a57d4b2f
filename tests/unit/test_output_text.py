"""`OutputText` decodes a growing output a few tokens at a time and must give exactly the text a whole decode gives,
after every token: for outputs that split multi-byte characters across tokens, contain invalid UTF-8, special and
added tokens, and genuine U+FFFD characters."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdspark.assets import resolve_model
from pdspark.engine.output_text import OutputText
from pdspark.model.tokenizer import Tokenizer

TOKENIZER = Tokenizer.from_dir(resolve_model("dsv4-tiny"))
# Tokens that split characters: the byte-level alphabet's single bytes (0x80-0xff are UTF-8 fragments).
SINGLE_BYTES = [i for i in range(TOKENIZER.vocab_size) if TOKENIZER.decode([i]) == "\ufffd"]
TEXTS = ["héllo wörld → ∑ 中文字符 😀🚀", "def f(x):\n    return x ** 2  # ✓", "\ufffd genuine replacement \ufffd"]


def steps(ids: list[int]) -> list[str]:
    """The text after each token, decoded incrementally."""
    text, out = OutputText(), []
    for n in range(1, len(ids) + 1):
        out.append(text.decode(TOKENIZER, ids[:n]))
    return out


def test_the_shipped_tokenizer_is_bytewise():
    assert TOKENIZER.decodes_bytewise
    assert SINGLE_BYTES, "no token decodes to a lone UTF-8 fragment: the test would not split characters"


@pytest.mark.parametrize("text", TEXTS)
def test_text_with_multibyte_characters_equals_the_whole_decode_after_every_token(text):
    ids = TOKENIZER.encode(text)
    assert steps(ids) == [TOKENIZER.decode(ids[:n]) for n in range(1, len(ids) + 1)]
    assert steps(ids)[-1] == text


@settings(max_examples=200, derandomize=True, database=None, deadline=None)
@given(st.lists(st.one_of(st.integers(0, TOKENIZER.vocab_size - 1), st.sampled_from(SINGLE_BYTES)), max_size=40))
def test_any_token_sequence_equals_the_whole_decode_after_every_token(ids):
    assert steps(ids) == [TOKENIZER.decode(ids[:n]) for n in range(1, len(ids) + 1)]
