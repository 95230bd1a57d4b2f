"""`OutputText`: a request's output text, decoded a few tokens at a time instead of whole at every step.

Decoding the whole output at every step costs O(n) per token (0.03 ms at 128 tokens, 0.8 ms at 4,000 with
dsv4-tiny's tokenizer: half a batch-1 decode step), O(n^2) per request. With a byte-level tokenizer
(`Tokenizer.decodes_bytewise`) the text of the output is the text of its settled tokens, whose bytes end on a whole
character, followed by the text of the tokens after them; a step decodes only those, and settles them once their
text no longer ends in U+FFFD (a character whose bytes are still incomplete: the next token may complete it; a
genuine U+FFFD in the output only keeps its tokens unsettled one step longer). Other tokenizers decode whole.

`stream_text`: what of that text a stream may send while the request runs (the decode worker's `Generate` chunks).
"""

from __future__ import annotations

from collections.abc import Sequence

from pdspark.model.tokenizer import Tokenizer


class OutputText:
    __slots__ = ("settled_tokens", "settled_text")

    def __init__(self) -> None:
        self.settled_tokens = 0  # output tokens [0, settled_tokens) decode to `settled_text`, ending on a character
        self.settled_text = ""

    def decode(self, tokenizer: Tokenizer, output_token_ids: list[int]) -> str:
        """The text of `output_token_ids` (which only ever grow), as `tokenizer.decode` gives it."""
        if not tokenizer.decodes_bytewise:
            return tokenizer.decode(output_token_ids)
        tail = tokenizer.decode(output_token_ids[self.settled_tokens:])
        text = self.settled_text + tail
        if not tail.endswith("\ufffd"):  # (an empty tail: skipped special tokens, settled as well)
            self.settled_tokens, self.settled_text = len(output_token_ids), text
        return text


def stream_text(text: str, finished: bool, stop_strings: Sequence[str] = ()) -> str:
    """What a request's stream has sent of its text once the request's output text is `text` (as the engine keeps
    it: cut before the stop string that ended the request). Once the request finished, all of it. While it runs,
    two tails that the next tokens may change are held back: an incomplete UTF-8 sequence (decoded as U+FFFD; the
    next tokens complete it) and the longest tail that starts one of `stop_strings` (the next tokens may complete
    the stop string, which the final text leaves out); a held tail that can no longer start one is sent as soon as
    the text grows past it, and a finish for any other reason (length, EOS) sends what is still held.

    A function of the text alone, so a stream continued elsewhere (migrated after the tokens that gave `text`)
    knows what was sent. As a request's text grows, what it gives only grows, up to the final text: a stream's
    pieces put together are exactly the request's text, with no part of a matched stop string ever sent.
    """
    if finished:
        return text
    text = text.rstrip("\ufffd")
    return text[:len(text) - held_back(text, stop_strings)]


def held_back(text: str, stop_strings: Sequence[str]) -> int:
    """The length of the longest tail of `text` that is a proper prefix of one of `stop_strings`."""
    held = 0
    for s in stop_strings:
        # Tails shorter than `s` that start with its first character and are longer than the one held are the
        # candidates; the earliest that starts `s` is the longest.
        end = len(text) - held
        start = text.find(s[0], max(0, len(text) - len(s) + 1), end) if s else -1
        while start != -1:
            if s.startswith(text[start:]):
                held = len(text) - start
                break
            start = text.find(s[0], start + 1, end)
    return held
