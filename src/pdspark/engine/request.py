"""`Request`: one generation's state inside the engine.

Token accounting: `all_token_ids = prompt + output`; the engine computes positions `[num_computed_tokens,
num_tokens)`; when a step reaches `num_tokens`, the last row's logits sample the next token. Prefill, chunked
prefill, decode and recompute after preemption are all this one rule.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from pdspark.cache.kv_cache import ReqPages
from pdspark.engine.grammar import GrammarCursor
from pdspark.engine.output_text import OutputText
from pdspark.types import FinishReason, SamplingParams, TokenLogprobs


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Request:
    req_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    prompt: str | None = None
    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    pages: ReqPages | None = None
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    text: str | None = None
    output_text: OutputText = field(default_factory=OutputText, repr=False)  # decodes `text` incrementally
    logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # (with `params.prompt_logprobs`) position by position
    num_preemptions: int = 0
    # Prefill role: keep the pages after finishing until the engine's owner releases them (after the transfer).
    hold_pages: bool = False
    spec_verify_steps: int = 0
    spec_accepted_tokens: int = 0  # drafts accepted over all verify steps
    # The effective sampling seed (`RandomStream(seed)` makes every draw): the client's `params.seed`, or one the
    # engine drew for a request without one.
    seed: int = 0
    # With `params.structured_outputs`: the matcher that follows the output (`engine/grammar.py`).
    grammar: GrammarCursor | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.params.logprobs is not None:
            self.logprobs = []
        if self.params.prompt_logprobs is not None:
            self.prompt_logprobs = [None]  # (the first prompt token has no context)

    @property
    def slot(self) -> int:
        """The request's page-table row. Only a request holding pages has one: every request a step computes does
        (the scheduler gives pages before it schedules a chunk)."""
        assert self.pages is not None, f"request {self.req_id} holds no pages"
        return self.pages.slot

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def tokens_between(self, start: int, end: int) -> list[int]:
        """`all_token_ids[start:end]` without building the whole list: a decode step takes one token of a context
        that may be 100k long, and the list's copy was an O(context) cost of every step."""
        p = len(self.prompt_token_ids)
        if end <= p:
            return self.prompt_token_ids[start:end]
        if start >= p:
            return self.output_token_ids[start - p : end - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - p]

    @property
    def controlled_output(self) -> list[int]:
        """The tokens the sampling controls and the grammar count as output: those generated here, after a migrated
        stream's earlier output (the prompt's last `params.prompt_output_tokens`)."""
        return self.all_token_ids[len(self.prompt_token_ids) - self.params.prompt_output_tokens :]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_pending_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def finished(self) -> bool:
        return self.status == RequestStatus.FINISHED
