"""`Sampler`: next tokens from logits, per request: the controls (`logits_controls`) and the grammar's mask
(`grammar`), then greedy, or temperature, min-p, top-k, top-p, seeded; with logprobs."""

from __future__ import annotations

from typing import NamedTuple

import torch

from pdspark.engine.grammar import GrammarCursor
from pdspark.engine.logits_controls import apply_controls
from pdspark.engine.random_stream import RandomStream, exponentials, race
from pdspark.types import SamplingParams, TokenLogprobs


class History(NamedTuple):
    """The tokens before a sampled position: the prompt's `prompt_len`, then the output so far, of which the tokens
    before `committed` are committed (the rest a verify window's drafts); the request's grammar cursor when its
    output is constrained."""

    tokens: list[int]
    prompt_len: int
    grammar: GrammarCursor | None = None
    committed: int = 0


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature-scaled `[V]` logits with tokens under min-p or outside top-k / top-p set to -inf."""
    logits = logits / params.temperature
    if params.min_p > 0:
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < params.min_p * probs.max(), float("-inf"))
    if params.top_k is not None and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        # Drop a token when the tokens ranked above it already reach top_p; the first token always stays.
        drop = (probs.cumsum(-1) - probs) >= params.top_p
        logits = logits.scatter(0, order[drop], float("-inf"))
    return logits


class Sampler:
    def __init__(self, eos_ids: tuple[int, ...] = ()):
        """`eos_ids`: the model's end tokens (what `min_tokens` holds back)."""
        self.eos_ids = eos_ids

    def sample(
        self, logits: torch.Tensor, params: list[SamplingParams], streams: list[RandomStream], positions: list[int],
        histories: list[History | None] | None = None,
    ) -> list[int]:
        """`logits [B, V]` fp32 -> one token id per row; row i's token goes to `positions[i]` of its request and
        is drawn by `streams[i]` (a pure function of the seed and that position, whatever else is in the batch).
        `histories[i]`: the tokens before row i's position, for a request with controls that read them."""
        controlled = [i for i, p in enumerate(params) if p.has_controls]
        if controlled:
            logits = logits.clone()
            for i in controlled:
                h = histories[i] if histories is not None else None
                row = apply_controls(logits[i], params[i], h.tokens if h else [], h.prompt_len if h else 0,
                                     self.eos_ids)  # (a new tensor: `logits[i]` stays the uncontrolled row)
                if h is not None and h.grammar is not None:  # (last: a bias cannot lift a token it masks)
                    self._constrain(row[None], logits[i], h)
                logits[i] = row
        tokens = logits.argmax(dim=-1).tolist()
        rows = [i for i, p in enumerate(params) if not p.greedy]
        if not rows:
            return tokens
        probs = torch.stack([filter_logits(logits[i], params[i]).softmax(-1) for i in rows])  # [R, V]
        noise = exponentials([streams[i].key(positions[i]) for i in rows], probs.shape[-1])  # [R, V]
        for i, token in zip(rows, race(probs, noise).tolist()):
            tokens[i] = token
        return tokens

    @staticmethod
    def _constrain(row: torch.Tensor, raw: torch.Tensor, h: History) -> None:
        """The grammar's mask on `row [1, V]` (the controlled logits). Where the controls ban every token the grammar
        allows (`min_tokens` holding back the EOS that alone may end a complete output, a bias of -100 on the only
        allowed token), the grammar wins: the mask applies to the logits before the controls."""
        assert h.grammar is not None
        output, committed = h.tokens[h.prompt_len :], h.committed - h.prompt_len
        h.grammar.constrain(row, output, committed)
        if not torch.isfinite(row).any():
            row.copy_(raw)
            h.grammar.constrain(row, output, committed)

    @staticmethod
    def logprobs(logits: torch.Tensor, tokens: list[int], n: int) -> list[TokenLogprobs]:
        """Logprobs of the model's own distribution (before sampling filters) for the chosen tokens."""
        lp = torch.log_softmax(logits.float(), dim=-1)
        out = []
        for i, t in enumerate(tokens):
            top = {}
            if n:
                vals, ids = torch.topk(lp[i], n)
                top = dict(zip(ids.tolist(), vals.tolist()))
            out.append(TokenLogprobs(t, float(lp[i, t]), top))
        return out
