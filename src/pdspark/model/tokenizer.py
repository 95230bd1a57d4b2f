"""`Tokenizer`: the checkpoint's `tokenizer.json` (HF `tokenizers`), with its chat template when present."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer
from tokenizers.decoders import ByteLevel


class Tokenizer:
    def __init__(self, tokenizer: HFTokenizer, eos_token_ids: tuple[int, ...], chat_template: str | None):
        self._tok = tokenizer
        self.eos_token_ids = eos_token_ids
        self.chat_template = chat_template

    @classmethod
    def from_dir(cls, path: str | Path, eos_token_ids: tuple[int, ...] = ()) -> Tokenizer | None:
        """Load from a checkpoint directory; None when it ships no `tokenizer.json`."""
        path = Path(path)
        file = path / "tokenizer.json"
        if not file.is_file():
            return None
        template = None
        cfg_file = path / "tokenizer_config.json"
        if cfg_file.is_file():
            template = json.loads(cfg_file.read_text()).get("chat_template")
        return cls(HFTokenizer.from_file(str(file)), eos_token_ids, template)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text).ids

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
