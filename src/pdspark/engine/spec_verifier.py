"""Acceptance of a verified draft: greedy prefix match, or chain rejection sampling (lossless for sampling).

The verify window is `[anchor, d_1 .. d_g]`; target row j (0-based) predicts the token after window row j. Draft
d_k sits at absolute position `first_position + k - 1`; its accept test and the residual resample after its
rejection are that position's ACCEPT and RESIDUAL draws, and the bonus after d_g is position
`first_position + g`'s BONUS draw. Each is an independent draw, so the committed tokens follow the target's
distribution exactly.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from pdspark.engine.drafter import DraftProposal
from pdspark.engine.random_stream import Purpose, RandomStream
from pdspark.engine.sampler import filter_logits
from pdspark.types import SamplingParams


class Acceptance(NamedTuple):
    tokens: list[int]  # accepted drafts then the bonus token (1 .. g + 1 tokens)
    num_accepted: int  # drafts accepted (len(tokens) - 1)


def accept(
    target_logits: torch.Tensor,
    proposal: DraftProposal,
    params: SamplingParams,
    stream: RandomStream,
    first_position: int,
) -> Acceptance:
    """`target_logits [g + 1, V]` fp32 for the window rows; `first_position` is d_1's (the anchor's + 1)."""
    drafts = proposal.tokens
    if params.greedy:
        target = target_logits.argmax(dim=-1).tolist()
        k = 0
        while k < len(drafts) and drafts[k] == target[k]:
            k += 1
        return Acceptance(drafts[:k] + [target[k]], k)
    assert proposal.probs is not None
    for k, d in enumerate(drafts):
        position = first_position + k
        p = filter_logits(target_logits[k], params).softmax(-1)
        q = proposal.probs[k]
        # Accept d with probability min(1, p(d) / q(d)).
        if stream.uniform(position, Purpose.ACCEPT) * float(q[d]) < float(p[d]):
            continue
        residual = (p - q).clamp(min=0)  # inverse_cdf takes unnormalised weights
        if float(residual.sum()) <= 0:  # p == q up to rounding: any draw from p is exact
            residual = p
        return Acceptance(drafts[:k] + [stream.choice(residual, position, Purpose.RESIDUAL)], k)
    p = filter_logits(target_logits[len(drafts)], params).softmax(-1)
    bonus = stream.choice(p, first_position + len(drafts), Purpose.BONUS)
    return Acceptance(drafts + [bonus], len(drafts))
