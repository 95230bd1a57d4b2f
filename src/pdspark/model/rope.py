"""`RotaryTable`: interleaved partial RoPE on the trailing `rope_dim` channels, as DSV4 uses it.

Pairs are adjacent channels `(2i, 2i+1)` of the rope slice (DeepSeek's `view_as_complex`, not NeoX halves).
Tables are precomputed for every position up to `max_len`; the products match computing them on the fly.
"""

from __future__ import annotations

import torch

from pdspark.model.model_config import RopeConfig, yarn_ramp_bounds


def inverse_frequencies(rope: RopeConfig, rope_dim: int) -> torch.Tensor:
    """`[rope_dim // 2]` fp32 inverse frequencies (plain or YaRN-blended)."""
    exponents = torch.arange(0, rope_dim, 2, dtype=torch.float) / rope_dim
    pos_freqs = rope.theta**exponents
    extrapolated = 1.0 / pos_freqs
    if rope.rope_type == "default":
        return extrapolated
    interpolated = 1.0 / (rope.factor * pos_freqs)
    low, high = yarn_ramp_bounds(rope, rope_dim)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = ((torch.arange(rope_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # share of the extrapolated (unscaled) frequency per pair
    return interpolated * (1 - keep) + extrapolated * keep


class RotaryTable:
    def __init__(self, rope: RopeConfig, rope_dim: int, max_len: int, device: torch.device | str = "cpu"):
        self.rope_dim = rope_dim
        inv_freq = inverse_frequencies(rope, rope_dim)
        positions = torch.arange(max_len, dtype=torch.float)
        freqs = positions[:, None] * inv_freq[None, :]  # [max_len, rope_dim // 2]
        self.cos = (freqs.cos() * rope.attention_factor).to(device)
        self.sin = (freqs.sin() * rope.attention_factor).to(device)

    def apply(self, x: torch.Tensor, positions: torch.Tensor, inverse: bool = False) -> torch.Tensor:
        """Rotate the trailing `rope_dim` channels of `x` at `positions`.

        Args:
            x: `[T, D]` or `[T, H, D]`.
            positions: `[T]` absolute positions.
            inverse: rotate by `-position` (DSV4 un-rotates the attention output).
        Returns:
            A new tensor of `x`'s shape and dtype; the leading `D - rope_dim` channels are unchanged.
        """
        cos = self.cos[positions]  # [T, r/2]
        sin = self.sin[positions]
        if inverse:
            sin = -sin
        if x.dim() == 3:
            cos, sin = cos[:, None, :], sin[:, None, :]
        r = self.rope_dim
        nope, rope = x[..., :-r], x[..., -r:].float()
        pairs = rope.unflatten(-1, (r // 2, 2))
        even, odd = pairs[..., 0], pairs[..., 1]
        rotated = torch.stack((even * cos - odd * sin, odd * cos + even * sin), dim=-1).flatten(-2)
        return torch.cat([nope, rotated.to(x.dtype)], dim=-1)
