"""`Sampler`: next tokens from logits, per request: greedy, temperature, top-k, top-p, seeded, with logprobs."""

from __future__ import annotations

import torch

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
    def __init__(self, seed: int = 0):
        self.generator = torch.Generator().manual_seed(seed)

    def sample(
        self, logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]
    ) -> list[int]:
        """`logits [B, V]` fp32 -> one token id per row."""
        tokens = logits.argmax(dim=-1).tolist()
        for i, p in enumerate(params):
            if p.greedy:
                continue
            probs = filter_logits(logits[i], p).softmax(-1)
            tokens[i] = int(torch.multinomial(probs, 1, generator=generators[i] or self.generator))
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
