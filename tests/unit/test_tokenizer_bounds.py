"""`Tokenizer.max_token_chars`: a bound on the characters one token stands for, given only where it is sound (a text
of n characters is then at least n / bound tokens, which is how the router refuses a prompt too long for the context
untokenized); and a long text's ids are those of a short one's path."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from pdspark.assets import resolve_model
from pdspark.model.tokenizer import RELEASE_GIL_CHARS, Tokenizer

TINY = Tokenizer.from_dir(resolve_model("dsv4-tiny"))
assert TINY is not None


def test_the_shipped_tokenizer_is_bounded_by_its_longest_entry():
    assert TINY.max_token_chars == max(map(len, TINY._tok.get_vocab(with_added_tokens=True))) == 45


@settings(max_examples=200, derandomize=True, database=None, deadline=None)
@given(text=st.text(st.characters(codec="utf-8"), max_size=400)
       | st.builds(lambda c, n: c * n, st.sampled_from([" ", "\n", "\n ", "-", "<|end|>", "é", "日本"]),
                   st.integers(1, 300)))
def test_no_text_is_fewer_tokens_than_its_length_over_the_bound(text):
    assert TINY.max_token_chars is not None
    assert len(TINY.encode(text)) >= math.ceil(len(text) / TINY.max_token_chars)


def _bpe(**model) -> HFTokenizer:
    tok = HFTokenizer(models.BPE(vocab={"a": 0, "b": 1, "[UNK]": 2}, merges=[], **model))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel()
    return tok


def _with(**parts) -> HFTokenizer:
    tok = _bpe()
    for name, value in parts.items():
        setattr(tok, name, value)
    return tok


def _truncating() -> HFTokenizer:
    tok = _bpe()
    tok.enable_truncation(8)
    return tok


def _stripping_added_token() -> HFTokenizer:
    tok = _bpe()
    tok.add_special_tokens([AddedToken("<x>", lstrip=True)])
    return tok


@pytest.mark.parametrize("make, bounded", [
    (_bpe, True),
    (lambda: _with(normalizer=normalizers.Sequence([normalizers.NFD(), normalizers.Lowercase()])), True),
    (lambda: _with(pre_tokenizer=pre_tokenizers.Sequence([pre_tokenizers.Digits(), pre_tokenizers.ByteLevel()])),
     True),
    # Each of these can make a text fewer tokens than its length over any bound from the vocabulary.
    (lambda: _with(normalizer=normalizers.Strip()), False),  # drops characters
    (lambda: _with(normalizer=normalizers.Sequence([normalizers.NFC()])), False),  # composes characters
    (lambda: _with(pre_tokenizer=pre_tokenizers.WhitespaceSplit()), False),  # drops whitespace
    (lambda: _with(pre_tokenizer=pre_tokenizers.Split(" ", "removed")), False),
    (lambda: _bpe(unk_token="[UNK]", fuse_unk=True), False),  # a run of unknown characters is one token
    (lambda: HFTokenizer(models.WordPiece({"a": 0, "[UNK]": 1}, unk_token="[UNK]")), False),  # a word, one token
    (_truncating, False),
    (_stripping_added_token, False),  # the token takes the whitespace before it
])
def test_a_bound_is_given_only_where_it_is_sound(make, bounded):
    tokenizer = Tokenizer(make(), (), None)
    assert (tokenizer.max_token_chars is not None) == bounded


def test_a_long_text_has_the_ids_of_the_one_call_path():
    text = "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n" * 60
    assert len(text) > RELEASE_GIL_CHARS
    assert TINY.encode(text) == TINY._tok.encode(text).ids
