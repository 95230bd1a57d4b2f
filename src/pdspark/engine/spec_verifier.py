"""Acceptance of a verified draft: greedy prefix match, or chain rejection sampling (lossless for sampling).

The verify window is `[anchor, d_1 .. d_g]`; target row j (0-based) predicts the token after window row j.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from pdspark.engine.drafter import DraftProposal
from pdspark.engine.sampler import filter_logits
from pdspark.types import SamplingParams


class Acceptance(NamedTuple):
    tokens: list[int]  # accepted drafts then the bonus token (1 .. g + 1 tokens)
    num_accepted: int  # drafts accepted (len(tokens) - 1)


def accept(
    target_logits: torch.Tensor,
    proposal: DraftProposal,
    params: SamplingParams,
    generator: torch.Generator | None,
    default_generator: torch.Generator,
) -> Acceptance:
    """`target_logits [g + 1, V]` fp32 for the window rows."""
    drafts = proposal.tokens
    if params.greedy:
        target = target_logits.argmax(dim=-1).tolist()
        k = 0
        while k < len(drafts) and drafts[k] == target[k]:
            k += 1
        return Acceptance(drafts[:k] + [target[k]], k)
    gen = generator or default_generator
    assert proposal.probs is not None
    for k, d in enumerate(drafts):
        p = filter_logits(target_logits[k], params).softmax(-1)
        q = proposal.probs[k]
        # Accept d with probability min(1, p(d) / q(d)).
        if float(torch.rand((), generator=gen)) * float(q[d]) < float(p[d]):
            continue
        residual = (p - q).clamp(min=0)
        if float(residual.sum()) <= 0:  # p == q up to rounding: any draw from p is exact
            residual = p
        bonus = int(torch.multinomial(residual / residual.sum(), 1, generator=gen))
        return Acceptance(drafts[:k] + [bonus], k)
    p = filter_logits(target_logits[len(drafts)], params).softmax(-1)
    return Acceptance(drafts + [int(torch.multinomial(p, 1, generator=gen))], len(drafts))
