"""`Sampler`: next tokens from logits, per request: greedy, temperature, top-k, top-p, seeded, with logprobs."""

from __future__ import annotations

import torch

from pdspark.engine.random_stream import RandomStream, exponentials, race
from pdspark.types import SamplingParams, TokenLogprobs


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature-scaled `[V]` logits with tokens outside top-k / top-p set to -inf."""
    logits = logits / params.temperature
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
    def sample(
        self, logits: torch.Tensor, params: list[SamplingParams], streams: list[RandomStream], positions: list[int]
    ) -> list[int]:
        """`logits [B, V]` fp32 -> one token id per row; row i's token goes to `positions[i]` of its request and
        is drawn by `streams[i]` (a pure function of the seed and that position, whatever else is in the batch)."""
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
