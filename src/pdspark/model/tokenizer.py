"""`Tokenizer`: the checkpoint's `tokenizer.json` (HF `tokenizers`), with its chat template when present."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as HFTokenizer
from tokenizers.decoders import ByteLevel

# Texts longer than this are encoded with `encode_batch_fast`, which releases the GIL while its Rust code runs;
# `encode` holds it throughout (about 1 us a character: seconds for a prompt of megabytes), so a thread tokenizing a
# long prompt would stall every other thread of the process (the router's event loop) however it is scheduled. The
# fast form keeps no character offsets, which also makes the encoding several times cheaper to free (that runs with
# the GIL held: about 0.2 s for the full form of 3 M tokens). All give the same ids; shorter texts take `encode`,
# which skips the batch's overhead.
RELEASE_GIL_CHARS = 2048

# The parts of a tokenizer under which every character of a text ends up in some token, and no token stands for
# more characters than its own vocabulary entry spells (`Tokenizer.max_token_chars`). Normalizers that only
# decompose or change case never make a text shorter; pre-tokenizers that split without removing keep every
# character (a `Split`/`Punctuation` keeps them unless its behavior is `Removed`; `Whitespace`, `WhitespaceSplit`,
# `BertPreTokenizer` and `CharDelimiterSplit` drop some, and so are not here).
_KEEPING_NORMALIZERS = frozenset({"Sequence", "Lowercase", "NFD", "NFKD", "Prepend"})
_KEEPING_PRE_TOKENIZERS = frozenset({"Sequence", "ByteLevel", "Split", "Punctuation", "Digits", "Metaspace",
                                     "UnicodeScripts"})


class Tokenizer:
    def __init__(self, tokenizer: HFTokenizer, eos_token_ids: tuple[int, ...], chat_template: str | None,
                 config: dict[str, Any] | None = None):
        """`config`: the checkpoint's `tokenizer_config.json` (its special tokens, class, flags)."""
        self._tok = tokenizer
        self.eos_token_ids = eos_token_ids
        self.chat_template = chat_template
        self.config = config or {}

    @classmethod
    def from_dir(cls, path: str | Path, eos_token_ids: tuple[int, ...] = ()) -> Tokenizer | None:
        """Load from a checkpoint directory; None when it ships no `tokenizer.json`."""
        path = Path(path)
        file = path / "tokenizer.json"
        if not file.is_file():
            return None
        config: dict[str, Any] = {}
        cfg_file = path / "tokenizer_config.json"
        if cfg_file.is_file():
            config = json.loads(cfg_file.read_text())
        return cls(HFTokenizer.from_file(str(file)), eos_token_ids, config.get("chat_template"), config)

    @property
    def backend(self) -> HFTokenizer:
        """The `tokenizers` object itself (what grammar libraries read the vocabulary from)."""
        return self._tok

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """`text`'s token ids; `add_special_tokens`: what the tokenizer's post-processor puts around them (a BOS)."""
        if len(text) > RELEASE_GIL_CHARS:
            # `encode_batch_fast` is there from tokenizers 0.20 on.
            encode_batch = getattr(self._tok, "encode_batch_fast", self._tok.encode_batch)
            return encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def id_to_token(self, token_id: int) -> str | None:
        """A token's vocabulary string (byte-level BPE spells bytes as characters), None outside the vocabulary."""
        return self._tok.id_to_token(token_id)

    @functools.cached_property
    def max_token_chars(self) -> int | None:
        """The most characters of text one token can stand for, or None where this tokenizer sets no such bound.

        With it, a text of `n` characters is at least `ceil(n / max_token_chars)` tokens: a prompt too long for the
        context is refused by its length alone, before the seconds a prompt of megabytes takes to tokenize. A
        token's vocabulary entry is at least as long as the text it covers (byte-level entries spell one character
        per byte, a character being one byte or more; a subword prefix or suffix only lengthens an entry), and an
        added token stands for its own content. That holds only while the tokenizer cannot make a text shorter
        before the model sees it, nor map a run of unknown characters of any length to one token: no truncation,
        normalizers and pre-tokenizers that keep every character, a BPE model that does not fuse unknown
        characters, and no added token that swallows the whitespace around it (`lstrip`/`rstrip`). Any other
        tokenizer gets None (the request-size limits still bound what it is given)."""
        spec = json.loads(self._tok.to_str())
        model = spec.get("model") or {}
        sound = (spec.get("truncation") is None
                 and _keeps_every_char(spec.get("normalizer"), _KEEPING_NORMALIZERS, "normalizers")
                 and _keeps_every_char(spec.get("pre_tokenizer"), _KEEPING_PRE_TOKENIZERS, "pretokenizers")
                 and model.get("type") == "BPE" and not (model.get("unk_token") and model.get("fuse_unk"))
                 and not any(t.get("lstrip") or t.get("rstrip") for t in spec.get("added_tokens") or ()))
        if not sound:
            return None
        return max(map(len, self._tok.get_vocab(with_added_tokens=True)), default=None)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    @property
    def decodes_bytewise(self) -> bool:
        """Whether decoding is the UTF-8 decoding (invalid bytes replaced) of the tokens' bytes laid end to end
        (a byte-level BPE, as DeepSeek's): then the text of `a + b`, where `a`'s bytes end on a whole character, is
        the text of `a` followed by that of `b`, and a growing output can be decoded a few tokens at a time."""
        return isinstance(self._tok.decoder, ByteLevel)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)


def _keeps_every_char(part: dict[str, Any] | None, keeping: frozenset[str], children: str) -> bool:
    """Whether a normalizer or pre-tokenizer (`tokenizer.json`'s spelling; None: absent) keeps every character."""
    if part is None:
        return True
    if part.get("type") not in keeping or part.get("behavior") == "Removed":
        return False
    return all(_keeps_every_char(child, keeping, children) for child in part.get(children) or ())
