"""Public request/response types of the engine: `SamplingParams`, `StructuredOutputs`, `FinishReason`,
`RequestOutput`, `TokenLogprobs`."""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass, field
from typing import Any

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


# The constraint kinds of `StructuredOutputs`, as vLLM's `StructuredOutputsParams` names them.
STRUCTURED_KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")
MAX_STRUCTURED_CHARS = 1 << 20  # a schema, regex or grammar of more than a MiB is refused before compiling


@dataclass(frozen=True)
class StructuredOutputs:
    """A constraint on the output text (`engine/grammar.py` turns it into a token mask at every sampled position).

    `kind` is one of `STRUCTURED_KINDS` and `spec` its text: `json` a JSON schema (JSON text), `json_object` any JSON
    object (`spec` empty), `regex` a regular expression, `choice` a JSON array of the allowed strings, `grammar` an
    EBNF grammar (xgrammar's dialect: GBNF, `root ::= ...`), `structural_tag` xgrammar's structural tag JSON (what
    tool calls are constrained with). One canonical text per constraint: it is the wire form and the compile
    cache's key. Build with `StructuredOutputs.of(json=schema)` and the like."""

    kind: str
    spec: str = ""

    def __post_init__(self) -> None:
        _check(self.kind in STRUCTURED_KINDS, "structured_outputs", self.kind, f"one of {', '.join(STRUCTURED_KINDS)}")
        field = f"structured_outputs.{self.kind}"
        _check(isinstance(self.spec, str) and len(self.spec) <= MAX_STRUCTURED_CHARS, field,
               self.spec[:64] if isinstance(self.spec, str) else self.spec,
               f"a string of at most {MAX_STRUCTURED_CHARS} characters")
        if self.kind == "choice":
            choices = _json_or_none(self.spec)
            _check(isinstance(choices, list) and bool(choices) and all(isinstance(c, str) and c for c in choices),
                   "structured_outputs.choice", self.spec[:64], "a non-empty JSON array of non-empty strings")
        if self.kind in ("json", "structural_tag"):
            _check(isinstance(_json_or_none(self.spec), dict), f"structured_outputs.{self.kind}", self.spec[:64],
                   "a JSON object")

    @classmethod
    def of(cls, *, json: dict | str | None = None, json_object: bool = False, regex: str | None = None,
           choice: list[str] | tuple[str, ...] | None = None, grammar: str | None = None,
           structural_tag: dict | str | None = None) -> StructuredOutputs:
        """Exactly one constraint, spelled as vLLM's `StructuredOutputsParams` spells it."""
        given = {k: v for k, v in (("json", json), ("regex", regex), ("choice", choice), ("grammar", grammar),
                                   ("structural_tag", structural_tag)) if v is not None}
        if json_object:
            given["json_object"] = ""
        _check(len(given) == 1, "structured_outputs", sorted(given), f"exactly one of {', '.join(STRUCTURED_KINDS)}")
        kind, value = next(iter(given.items()))
        if kind == "choice" or not isinstance(value, str):
            value = _dumps(list(value) if kind == "choice" else value)
        return cls(kind, value)


def _json_or_none(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


def _dumps(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


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
    include_stop_str_in_output: bool = False  # the text keeps the stop string that ended it (vLLM's option)
    # Return this many most likely tokens (with their logprobs) at each step, besides the sampled one.
    logprobs: int | None = None
    # The prompt's tokens' logprobs (each given the tokens before it) and this many most likely tokens at each
    # position; the first position has none. The prompt is computed whole (no prefix-cache hit skips a position).
    prompt_logprobs: int | None = None
    # The controls OpenAI, vLLM and SGLang clients send (`engine/logits_controls.py`), applied to every sampled
    # position's logits before the temperature and filters, greedy included.
    presence_penalty: float = 0.0  # minus this for every token the output holds (OpenAI's; vLLM's: output tokens)
    frequency_penalty: float = 0.0  # minus this times each token's count in the output
    repetition_penalty: float = 1.0  # tokens in the prompt or output: positive logits / this, negative ones * this
    min_p: float = 0.0  # drop tokens whose probability is under this times the most likely one's
    min_tokens: int = 0  # EOS and the stop token ids are banned until this many tokens are out
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit (-100 bans, +100 forces)
    banned_token_ids: tuple[int, ...] | list[int] = ()  # never sampled
    # Set by a prefill worker, not by clients: the prompt's last tokens that are a migrated stream's earlier output
    # (the penalties and `min_tokens` count them as output, as the uninterrupted stream did).
    prompt_output_tokens: int = 0
    # The output must match this (JSON schema, regex, choice, grammar): every sampled token is masked to those that
    # keep it matchable, DSpark's verify rows included (`engine/grammar.py`).
    structured_outputs: StructuredOutputs | None = None

    def __post_init__(self) -> None:
        _check(self.temperature >= 0, "temperature", self.temperature, ">= 0")
        _check(self.top_k is None or (isinstance(self.top_k, int) and self.top_k >= 1), "top_k", self.top_k,
               "None (off) or >= 1")
        _check(0 < self.top_p <= 1, "top_p", self.top_p, "in (0, 1]")
        _check(isinstance(self.max_tokens, int) and self.max_tokens >= 1, "max_tokens", self.max_tokens, ">= 1")
        _check(self.logprobs is None or 0 <= self.logprobs <= 20, "logprobs", self.logprobs, "None or 0..20")
        _check(self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= 20, "prompt_logprobs",
               self.prompt_logprobs, "None or 0..20")
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop)
        _check(all(isinstance(s, str) and s for s in stops), "stop", self.stop, "non-empty strings")
        _check(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids), "stop_token_ids",
               self.stop_token_ids, "non-negative token ids")
        _check(-2 <= self.presence_penalty <= 2, "presence_penalty", self.presence_penalty, "in [-2, 2]")
        _check(-2 <= self.frequency_penalty <= 2, "frequency_penalty", self.frequency_penalty, "in [-2, 2]")
        _check(0 < self.repetition_penalty <= 2, "repetition_penalty", self.repetition_penalty, "in (0, 2]")
        _check(0 <= self.min_p <= 1, "min_p", self.min_p, "in [0, 1]")
        _check(isinstance(self.min_tokens, int) and 0 <= self.min_tokens <= self.max_tokens, "min_tokens",
               self.min_tokens, f"0..max_tokens ({self.max_tokens})")
        _check(self.logit_bias is None or all(isinstance(t, int) and t >= 0 and -100 <= b <= 100
                                              for t, b in self.logit_bias.items()),
               "logit_bias", self.logit_bias, "token ids >= 0 mapped to biases in [-100, 100]")
        _check(all(isinstance(t, int) and t >= 0 for t in self.banned_token_ids), "banned_token_ids",
               self.banned_token_ids, "non-negative token ids")
        _check(isinstance(self.prompt_output_tokens, int) and self.prompt_output_tokens >= 0, "prompt_output_tokens",
               self.prompt_output_tokens, ">= 0")

    @property
    def has_controls(self) -> bool:
        """Any control of `logits_controls` away from its neutral value (which leaves the logits as they are)."""
        return self.needs_history or bool(self.logit_bias or self.banned_token_ids)

    @property
    def needs_history(self) -> bool:
        """The controls read the tokens before each position (penalties, `min_tokens`, the grammar)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.min_tokens or self.structured_outputs is not None)

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
    # With `prompt_logprobs`: one entry per prompt token (None for the first), filled as the prompt is computed.
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    # Speculative decoding counters (0 when speculation is off).
    spec_verify_steps: int = 0
    spec_accepted_tokens: int = 0
