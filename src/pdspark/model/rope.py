"""`RotaryTable`: interleaved partial RoPE on the trailing `rope_dim` channels, as DSV4 uses it.

Pairs are adjacent channels `(2i, 2i+1)` of the rope slice (DeepSeek's `view_as_complex`, not NeoX halves).
Tables are precomputed for every position up to `max_len` and stored at full rope width so that one rotation is
`x * cos + swap_pairs(x) * sin_signed` (`sin_signed = [-s, s]` per pair), the same products as the reference.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from pdspark.hardware.cpu import kernels as cpu_kernels
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


class RopeAt(NamedTuple):
    """Rotation factors gathered for one set of positions: `[T, 1, rope_dim]` (broadcast over heads)."""

    cos: torch.Tensor
    sin: torch.Tensor  # signed: -sin on even channels, +sin on odd ones

    def apply(self, x: torch.Tensor, inverse: bool = False) -> torch.Tensor:
        """Rotate the trailing rope channels of `x [T, D]` or `[T, H, D]`; `inverse` rotates by `-position`."""
        sign = -1.0 if inverse else 1.0
        if not torch.is_grad_enabled():
            fused = cpu_kernels.rope_rotate(x, self.cos, self.sin, sign)  # one C call (fp32 CPU only)
            if fused is not None:
                return fused
        r = self.cos.shape[-1]
        cos, sin = (self.cos, self.sin) if x.dim() == 3 else (self.cos[:, 0], self.sin[:, 0])
        rope = x[..., -r:]
        if x.dtype != torch.float32:
            rope = rope.float()
        swapped = rope.unflatten(-1, (r // 2, 2)).flip(-1).flatten(-2)  # (x1, x0) per pair
        if x.dtype == torch.float32 and not (torch.is_grad_enabled() and x.requires_grad):
            out = x.clone()  # write the rotated channels in place (out= does not support autograd)
            torch.addcmul(rope * cos, swapped, sin, value=sign, out=out[..., -r:])
            return out
        rotated = torch.addcmul(rope * cos, swapped, sin, value=sign)
        return torch.cat([x[..., :-r], rotated.to(x.dtype)], dim=-1)


class RotaryTable:
    """fp32 tables, whatever the model dtype; they move to the device of the positions on first use."""

    def __init__(self, rope: RopeConfig, rope_dim: int, max_len: int, device: torch.device | str = "cpu"):
        self.rope_dim = rope_dim
        inv_freq = inverse_frequencies(rope, rope_dim)
        freqs = torch.arange(max_len, dtype=torch.float)[:, None] * inv_freq[None, :]  # [max_len, r/2]
        cos = freqs.cos() * rope.attention_factor
        sin = freqs.sin() * rope.attention_factor
        # [max_len, r]: each pair's factor repeated; sin carries the rotation's sign pattern.
        self.cos = cos.repeat_interleave(2, dim=-1).to(device)
        self.sin = torch.stack([-sin, sin], dim=-1).flatten(-2).to(device)

    def at(self, positions: torch.Tensor) -> RopeAt:
        if self.cos.device != positions.device:
            self.cos, self.sin = self.cos.to(positions.device), self.sin.to(positions.device)
        return RopeAt(self.cos[positions][:, None, :], self.sin[positions][:, None, :])

    def apply(self, x: torch.Tensor, positions: torch.Tensor, inverse: bool = False) -> torch.Tensor:
        return self.at(positions).apply(x, inverse)
