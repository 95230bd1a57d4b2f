"""`RandomStream`: a request's randomness as a pure function of (seed, absolute position, purpose).

NOTE: counter-based, not stateful. A draw never depends on how many draws came before it, so the same seed gives the
same tokens alone or batched, after chunked prefill or a preemption, and on either side of a prefill/decode split
(the prefill worker draws token 1 at position `len(prompt)`, the decode worker goes on from the next position;
nothing is shipped between them). Positions are those of the token being produced: `len(all_token_ids)` when it
is appended.

NOTE: Gumbel-max ("exponential race") sampling. The draw of a position is a vector E of V independent Exp(1) noises,
one per token; the token is `argmax_i p_i / E_i` (`race`), i.e. argmax log p_i + G_i with Gumbel G_i = -log E_i.
E_i / p_i is Exp(p_i), and the first of independent exponential clocks to ring is i with probability p_i / sum(p):
an exact sample of p. Speculative decoding draws nothing of its own: the draft proposes `argmax_i q_i / E_i` with the
same E, and a draft is kept when it equals the target's token (see `spec_verifier`). So the token at a position never
depends on where a verify step started or how many drafts it had. Why this coupling: P(draft == target) at draft
position 1 on dsv4-tiny with its trained draft (T=1.0 / T=0.7) is 0.658 / 0.706, against 0.716 / 0.743 for
rejection sampling's optimum sum(min(p, q)) (whose committed token depends on the draft, so it cannot equal plain
sampling's) and 0.275 / 0.522 for the inverse-CDF pick by one uniform (a token's CDF interval moves with every
difference between p and q earlier in vocabulary order).

NOTE: a row's noise comes from numpy's PCG64, its 128-bit state set from a 64-bit mix of (seed, position, purpose):
53-bit uniforms u (`Generator.random`), then E = -log(1 - u) in float64 (1 - u is exact). Measured per row on this
2-core CPU at V = 129,280 (DeepSeek-V4): ~1.0-1.4 ms (about half PCG64, half the log), the race ~0.3-0.6 ms more;
at V = 4,096 (dsv4-tiny) ~0.04 ms batched. The alternatives measured: a vectorised SplitMix-style hash of (key,
token id) ~3.3 ms in numpy and ~18 ms in torch int64; `torch.Generator().manual_seed(key)` + `exponential_` ~3 ms,
and the CPU generator keeps only the low 32 bits of a seed (positions of a long stream would share noise vectors by
the birthday bound). Only rows that sample draw noise; greedy rows take the argmax.

NOTE: determinism holds per numpy version (the PCG64 stream and `Generator.random` are stable by numpy's policy,
not promised forever) and per float64 log kernel (a 1-ulp difference, e.g. AVX2 against AVX-512, changes a token
only where two scores agree to ~1e-16). The noise is drawn on the host CPU whatever the worker's device, so a CPU
and a CUDA worker draw the same E; what differs between unlike workers is p itself (logits from other kernels and
dtypes), as it always did. A GPU port would rather draw E on the device (a host-side row is 1 MB of float64 to copy
at V = 129,280), with Philox: different noise, so seeded streams must then not move between CPU and GPU workers.
Nothing enforces that today: the transfer `CompatDescriptor` pins the model and the cache dtypes (`kv_dtype`,
`state_dtype`), not the device, the library versions or the sampler, and it is checked only between the two
workers of a pair, while a migrated stream moves to another pair.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

_MASK = (1 << 64) - 1
# Odd 64-bit constants with well-spread bits (SplitMix64's golden-ratio increment and two well-known hash
# multipliers). Multiplying by an odd constant is a bijection mod 2^64, so distinct positions give distinct keys.
_GOLDEN = 0x9E3779B97F4A7C15
_POSITION_KEY = 0xD1B54A32D192ED03
_PURPOSE_KEY = 0xC2B2AE3D27D4EB4F
_PCG_INC = 0xDA3E39CB94B95BDB_5851F42D4C957F2D  # PCG64's stream increment: any odd 128-bit constant, kept fixed
_MIN_NOISE = 2.0**-60  # below the smallest nonzero -log(1 - u) (~2^-53): stands in for u = 0


class Purpose(enum.IntEnum):
    """What a draw at a position is for; each is an independent stream."""

    SAMPLE = 1  # the token at the position (plain steps and verify windows alike; the draft's proposal too)


def _mix(z: int) -> int:
    """A bijective 64-bit mix with full avalanche: the xor-shift / multiply rounds of the SplitMix64 finaliser
    (Stafford's "Mix13" shifts and multipliers)."""
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return z ^ (z >> 31)


def draw_key(seed: int, position: int, purpose: Purpose) -> int:
    """The 128-bit PCG64 state of one draw; any Python int is a seed (taken modulo 2^64). For one seed and purpose,
    distinct positions give distinct keys (each step is a bijection)."""
    h = _mix((seed + _GOLDEN) & _MASK)
    h = _mix(h ^ ((position + 1) * _POSITION_KEY & _MASK))
    h = _mix(h ^ (int(purpose) * _PURPOSE_KEY & _MASK))
    return h << 64 | _mix((h + _GOLDEN) & _MASK)


def exponentials(keys: Sequence[int], vocab_size: int) -> torch.Tensor:
    """`[len(keys), vocab_size]` float64 Exp(1) noise in [2^-60, 36.8]; row r is a function of `keys[r]` (a
    `draw_key`) alone."""
    u = np.empty((len(keys), vocab_size))  # [R, V]
    if not keys:
        return torch.from_numpy(u)
    bits = np.random.PCG64(0)  # its seeding is overwritten row by row
    gen = np.random.Generator(bits)
    for r, key in enumerate(keys):
        bits.state = {"bit_generator": "PCG64", "state": {"state": key, "inc": _PCG_INC},
                      "has_uint32": 0, "uinteger": 0}
        gen.random(out=u[r])  # (next_uint64 >> 11) * 2^-53: [0, 1) in steps of 2^-53
    return exponential_from_uniform(torch.from_numpy(u))


def exponential_from_uniform(u: torch.Tensor) -> torch.Tensor:
    """-log(1 - u) of float64 uniforms `u` in [0, 1) with 53 bits, in place. 1 - u is exact, so E is in [2^-53, 36.8],
    except u = 0, which gives 2^-60 rather than 0 (or -0.0): E > 0 keeps `race` free of 0/0 and of -inf scores."""
    return u.neg_().add_(1.0).log_().neg_().clamp_(min=_MIN_NOISE)


def race(weights: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """Token ids `[R]`: row r's `argmax_i weights_i / noise_i` for float32 probabilities `weights [R, V]`
    (non-negative, need not sum to 1) and `noise [R, V]` from `exponentials`. In float64 a live token's score is
    > 0 (a weight >= 1.4e-45 over noise <= 36.8 does not underflow) and a zero-weight token's exactly 0, so the
    latter never wins; ties go to the lower token id."""
    score = weights.to(torch.float64, copy=True).div_(noise.to(weights.device))  # [R, V]
    return score.argmax(-1)


@dataclass(frozen=True)
class RandomStream:
    """One request's random source; `seed` is its effective seed (the client's, or one the engine drew)."""

    seed: int

    def key(self, position: int, purpose: Purpose = Purpose.SAMPLE) -> int:
        return draw_key(self.seed, position, purpose)

    def choice(self, weights: torch.Tensor, position: int, purpose: Purpose = Purpose.SAMPLE) -> int:
        """One token id from `weights [V]` by the race of `position`'s noise."""
        noise = exponentials([self.key(position, purpose)], weights.shape[-1])
        return int(race(weights[None], noise)[0])
