"""Acceptance of a verified draft: the drafts that match the target's own tokens (greedy and sampling alike).

The verify window is `[anchor, d_1 .. d_g]`; target row j (0-based) predicts the token after window row j, at
absolute position `num_tokens + j`. The target's token for each row is what plain decoding would produce there
(argmax, or the inverse-CDF pick of the filtered p by that position's SAMPLE draw: the engine draws every row with
the one `Sampler`). d_k is kept while it equals row k - 1's token; the first row whose token differs, or the row
after d_g when all match, gives the last committed token.

NOTE: coupled ("common random numbers") verification, not chain rejection sampling. The drafter picks d_k from its
q by the same draw the target uses at that position, so when q is close to p the two inverse-CDF picks agree. Every
committed token is the plain seeded sample, hence lossless, and equal token for token to non-speculative sampling
whatever the step grouping: draft counts, batching and a stream migrated to another worker mid-generation give the
same tokens. The cost: a draft is accepted with the probability that the coupled picks coincide (the overlap of
the token's intervals in the two CDFs), at most rejection sampling's optimum sum(min(p, q)), and lower when p and q
differ on tokens earlier in vocabulary order, which shifts every later token's interval.
"""

from __future__ import annotations

from typing import NamedTuple


class Acceptance(NamedTuple):
    tokens: list[int]  # accepted drafts then the target's token after them (1 .. g + 1 tokens)
    num_accepted: int  # drafts accepted (len(tokens) - 1)


def accept(drafts: list[int], target: list[int]) -> Acceptance:
    """`target`: the target's token for each window row (`len(drafts) + 1` of them)."""
    assert len(target) == len(drafts) + 1, (len(drafts), len(target))
    k = 0
    while k < len(drafts) and drafts[k] == target[k]:
        k += 1
    return Acceptance(target[: k + 1], k)
