"""Public request/response types of the engine: `SamplingParams`, `FinishReason`, `RequestOutput`,
`TokenLogprobs`."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from pdspark.errors import InvalidRequestError


class FinishReason(str, enum.Enum):  # noqa: UP042 (a `StrEnum` would change what `str()` of a member says)
    """Why a request stopped generating; the same value from the engine to the HTTP body and the SDK. The value is
    OpenAI's `finish_reason` string ("abort" is vLLM's extension for a request the server stopped). The `str` base
    lets a reason compare equal to, and serialise as, that string."""

    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or max_model_len
    ABORT = "abort"  # aborted: by the caller, or by the engine (a failed step, a request that can never start)

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token. `temperature=0` is greedy; `top_k=None` and `top_p=1` disable those filters."""

    temperature: float = 1.0
    top_k: int | None = None
    top_p: float = 1.0
    seed: int | None = None
    max_tokens: int = 16
    stop: tuple[str, ...] | list[str] | str = ()
    stop_token_ids: tuple[int, ...] | list[int] = ()
    ignore_eos: bool = False
    # Return this many most likely tokens (with their logprobs) at each step, besides the sampled one.
    logprobs: int | None = None

    def __post_init__(self) -> None:
        _check(self.temperature >= 0, "temperature", self.temperature, ">= 0")
        _check(self.top_k is None or (isinstance(self.top_k, int) and self.top_k >= 1), "top_k", self.top_k,
               "None (off) or >= 1")
        _check(0 < self.top_p <= 1, "top_p", self.top_p, "in (0, 1]")
        _check(isinstance(self.max_tokens, int) and self.max_tokens >= 1, "max_tokens", self.max_tokens, ">= 1")
        _check(self.logprobs is None or 0 <= self.logprobs <= 20, "logprobs", self.logprobs, "None or 0..20")
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop)
        _check(all(isinstance(s, str) and s for s in stops), "stop", self.stop, "non-empty strings")
        _check(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids), "stop_token_ids",
               self.stop_token_ids, "non-negative token ids")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def stop_strings(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)


def _check(ok: bool, name: str, value: object, allowed: str) -> None:
    if not ok:
        raise InvalidRequestError(f"invalid `{name}` = {value!r}; allowed: {allowed}", field=name)


@dataclass(frozen=True)
class TokenLogprobs:
    """One generated token's logprob and the `n` most likely alternatives (token id -> logprob)."""

    token_id: int
    logprob: float
    top: dict[int, float]


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str | None = None
    finished: bool = False
    finish_reason: FinishReason | None = None
    # The stop string or stop token that ended the request, when that is what ended it.
    stop_reason: str | int | None = None
    num_cached_tokens: int = 0
    logprobs: list[TokenLogprobs] | None = None
    # Speculative decoding counters (0 when speculation is off).
    spec_verify_steps: int = 0
    spec_accepted_tokens: int = 0
