"""`RandomStream`: a request's randomness as a pure function of (seed, absolute position, purpose).

NOTE: counter-based, not stateful. A draw never depends on how many draws came before it, so the same seed gives the
same tokens alone or batched, after chunked prefill or a preemption, and on either side of a prefill/decode split
(the prefill worker draws token 1 at position `len(prompt)`, the decode worker goes on from the next position;
nothing is shipped between them). Positions are those of the token being produced: `len(all_token_ids)` when it
is appended.

NOTE: speculative decoding draws nothing of its own. The token at position t is always the inverse-CDF pick of the
target's p_t by position t's SAMPLE draw, as in plain sampling; the draft proposes its pick of q_t by the same draw,
and a draft is kept when the two picks agree (see `spec_verifier`). So no token depends on where a verify step
started or how many drafts it had: batching, draft counts, and a stream restarted at any position on another worker
(a plain prefill-sampled token, then verify steps) all give plain sampling's tokens. Purposes 2-5 (draft, accept,
residual, bonus of chain rejection sampling) are retired; SAMPLE keeps value 1, so plain seeded tokens are
unchanged.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

_MASK = (1 << 64) - 1
# Odd 64-bit constants with well-spread bits (SplitMix64's golden-ratio increment and two well-known hash
# multipliers). Multiplying by an odd constant is a bijection mod 2^64, so distinct positions give distinct keys.
_GOLDEN = 0x9E3779B97F4A7C15
_POSITION_KEY = 0xD1B54A32D192ED03
_PURPOSE_KEY = 0xC2B2AE3D27D4EB4F


class Purpose(enum.IntEnum):
    """What a draw at a position is for; each is an independent stream."""

    SAMPLE = 1  # the token at the position (plain steps and verify windows alike; the draft's proposal too)


def _mix(z: int) -> int:
    """A bijective 64-bit mix with full avalanche: the xor-shift / multiply rounds of the SplitMix64 finaliser
    (Stafford's "Mix13" shifts and multipliers)."""
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return z ^ (z >> 31)


def uniform(seed: int, position: int, purpose: Purpose) -> float:
    """A uniform draw in [0, 1) with 53 random bits; any Python int is a seed (taken modulo 2^64)."""
    h = _mix((seed + _GOLDEN) & _MASK)
    h = _mix(h ^ ((position + 1) * _POSITION_KEY & _MASK))
    h = _mix(h ^ (int(purpose) * _PURPOSE_KEY & _MASK))
    return (h >> 11) * 2.0**-53


def inverse_cdf(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Token ids `[B]` drawn from `weights [B, V]` (non-negative, need not sum to 1) by `u [B]` (float64, [0, 1)).

    The token is the first whose cumulative weight exceeds `u * total`, so a token of weight zero (whose cumulative
    weight equals its predecessor's) is never picked. When rounding puts `u * total` at the total itself, the last
    token with weight is picked rather than one past the end or a zero-weight tail.
    """
    w = weights.to(torch.float64)
    cdf = w.cumsum(-1)  # [B, V]
    target = (u.to(torch.float64) * cdf[:, -1]).unsqueeze(-1)  # [B, 1]
    picked = torch.searchsorted(cdf, target, right=True).squeeze(-1)  # [B], V when target >= total
    V = w.shape[-1]
    last_live = V - 1 - (w > 0).flip(-1).to(torch.uint8).argmax(-1)  # [B]
    return torch.minimum(picked, last_live)


@dataclass(frozen=True)
class RandomStream:
    """One request's random source; `seed` is its effective seed (the client's, or one the engine drew)."""

    seed: int

    def uniform(self, position: int, purpose: Purpose) -> float:
        return uniform(self.seed, position, purpose)

    def choice(self, weights: torch.Tensor, position: int, purpose: Purpose) -> int:
        """One token id from `weights [V]` by inverse CDF."""
        u = torch.tensor([self.uniform(position, purpose)], dtype=torch.float64)
        return int(inverse_cdf(weights[None], u)[0])
