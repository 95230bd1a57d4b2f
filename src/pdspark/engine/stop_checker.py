"""`StopChecker`: decides, after each new token, whether a request is done and why; keeps its text current."""

from __future__ import annotations

from pdspark.engine.request import Request
from pdspark.model.tokenizer import Tokenizer
from pdspark.types import FinishReason


class StopChecker:
    def __init__(self, tokenizer: Tokenizer | None, eos_token_ids: tuple[int, ...], max_model_len: int):
        self.tokenizer = tokenizer
        self.eos_token_ids = set(eos_token_ids)
        self.max_model_len = max_model_len

    def check(self, req: Request) -> bool:
        """Update `req.text` and set `finish_reason`/`stop_reason` when the last token ends the request. A stop
        string ends it at the first place one occurs (the first listed of those starting there): the text ends
        before it (or, with `include_stop_str_in_output`, with it). (Its stream holds back the tail that may start one:
        `output_text.stream_text`.)"""
        token = req.output_token_ids[-1]
        p = req.params
        if self.tokenizer is not None:
            req.text = req.output_text.decode(self.tokenizer, req.output_token_ids)
            found = _first_stop_string(req.text, p.stop_strings)
            if found is not None:
                idx, s = found
                req.text = req.text[: idx + len(s) if p.include_stop_str_in_output else idx]
                return _finish(req, FinishReason.STOP, s)
        if token in p.stop_token_ids:
            return _finish(req, FinishReason.STOP, token)
        if not p.ignore_eos and token in self.eos_token_ids:
            return _finish(req, FinishReason.STOP, token)
        if len(req.output_token_ids) >= p.max_tokens or req.num_tokens >= self.max_model_len:
            return _finish(req, FinishReason.LENGTH, None)
        return False


def _finish(req: Request, reason: FinishReason, stop_reason: str | int | None) -> bool:
    req.finish_reason = reason
    req.stop_reason = stop_reason
    return True


def _first_stop_string(text: str, stop_strings: tuple[str, ...]) -> tuple[int, str] | None:
    """Where the stop string that occurs first in `text` starts, and which it is; None without one."""
    first: tuple[int, str] | None = None
    for s in stop_strings:
        # A new token can only complete a stop string that ends in the text's tail.
        idx = text.find(s, max(0, len(text) - len(s) - 64))
        if idx != -1 and (first is None or idx < first[0]):
            first = (idx, s)
    return first
