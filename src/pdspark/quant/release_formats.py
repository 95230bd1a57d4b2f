"""DeepSeek-V4's released weight formats: FP8 block weights and MXFP4 routed experts, decoded to float and encoded
from float (the second for fixtures).

- **FP8 block** (`X.weight` F8_E4M3 `[out, in]` + `X.scale` `[ceil(out/128), ceil(in/128)]`): one scale per 128x128
  tile, a *multiplier*: `W[r, c] = q[r, c] * S[r // 128, c // 128]`. The scale is ue8m0 (`float8_e8m0fnu`: the value
  is 2^(byte - 127)) in V4-Flash/Pro, float32 in V4-Flash-Base's experts.
- **MXFP4** (routed experts: `X.weight` I8 `[out, in/2]` + `X.scale` ue8m0 `[out, in/32]`): two e2m1 codes per byte
  along the input dim, the low nibble the even element; one scale per 32 inputs of a row:
  `W[r, c] = E2M1[nibble(r, c)] * S[r, c // 32]`.

Every decoded value is exact in float32 (and in bfloat16: e4m3 and e2m1 carry at most 3 mantissa bits, the scales
are powers of two), so a dequantized copy holds the very numbers the packed weight stands for.
"""

from __future__ import annotations

import torch

FP8_BLOCK = 128  # rows and columns of an FP8 weight's scale tile
FP4_GROUP = 32  # inputs of an MXFP4 weight's scale
# The e2m1 code table: bit 3 is the sign.
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
_E4M3_MAX = 448.0
_E2M1_MAX = 6.0


def scale_values(scale: torch.Tensor) -> torch.Tensor:
    """A scale tensor as float32 multipliers: ue8m0 bytes decoded (2^(b - 127)), float32 as it is."""
    if scale.dtype == torch.float8_e8m0fnu:
        return torch.exp2(scale.view(torch.uint8).to(torch.float32) - 127.0)
    return scale.to(torch.float32)


def fp8_scale_shape(out: int, inputs: int) -> tuple[int, int]:
    return -(-out // FP8_BLOCK), -(-inputs // FP8_BLOCK)


def mxfp4_scale_shape(out: int, inputs: int) -> tuple[int, int]:
    return out, inputs // FP4_GROUP


def dequant_fp8_blocks(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """`q [out, in]` (float8_e4m3fn) and its tile scales -> the float32 weight `[out, in]`. A partial last tile
    (a dim not a multiple of 128) takes its tile's scale."""
    out, inputs = q.shape
    s = scale_values(scale)
    # [out/128, in/128] -> [out, in]: every element takes its tile's scale (cropped where the last tile is partial).
    expanded = s.repeat_interleave(FP8_BLOCK, 0)[:out].repeat_interleave(FP8_BLOCK, 1)[:, :inputs]
    return q.to(torch.float32) * expanded


def dequant_mxfp4(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """`packed [out, in/2]` (int8 or uint8: two e2m1 codes a byte, low nibble first) and its per-32 scales ->
    the float32 weight `[out, in]`."""
    u8 = packed.view(torch.uint8)
    codes = torch.stack([u8 & 0x0F, u8 >> 4], dim=-1).flatten(-2)  # [out, in]: element 2k (low), 2k + 1 (high)
    values = E2M1[codes.long()]
    return values * scale_values(scale).repeat_interleave(FP4_GROUP, 1)


def quant_fp8_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A float weight `[out, in]` -> (float8_e4m3fn `[out, in]`, ue8m0 tile scales), as the release encodes it: per
    tile `e = ceil(log2(max(amax, 1e-4) / 448))`, `q = W / 2^e`."""
    out, inputs = w.shape
    rows, cols = fp8_scale_shape(out, inputs)
    w = w.to(torch.float32)
    # [rows*128, cols*128] (zeros pad a partial last tile, which leaves its amax alone) -> [rows, cols] tile amax
    padded = torch.nn.functional.pad(w.abs(), (0, cols * FP8_BLOCK - inputs, 0, rows * FP8_BLOCK - out))
    amax = padded.view(rows, FP8_BLOCK, cols, FP8_BLOCK).amax(dim=(1, 3)).clamp_min(1e-4)
    exps = torch.ceil(torch.log2(amax / _E4M3_MAX)).to(torch.int32)
    expanded = torch.exp2(exps.to(torch.float32)).repeat_interleave(FP8_BLOCK, 0)[:out]
    q = (w / expanded.repeat_interleave(FP8_BLOCK, 1)[:, :inputs]).to(torch.float8_e4m3fn)
    return q, _e8m0(exps)


def quant_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A float weight `[out, in]` (`in` a multiple of 32) -> (int8 `[out, in/2]` packed e2m1 codes, ue8m0
    `[out, in/32]` scales): per 32 inputs `e = ceil(log2(amax / 6))`, each value the nearest code of `W / 2^e`."""
    out, inputs = w.shape
    if inputs % FP4_GROUP:
        raise ValueError(f"an MXFP4 weight's input dim is {inputs}; allowed: a multiple of {FP4_GROUP}")
    groups = w.to(torch.float32).reshape(out, inputs // FP4_GROUP, FP4_GROUP)
    amax = groups.abs().amax(-1).clamp_min(1e-30)
    exps = torch.ceil(torch.log2(amax / _E2M1_MAX)).to(torch.int32)
    scaled = (groups / torch.exp2(exps.to(torch.float32))[..., None]).reshape(out, inputs)
    codes = (scaled[..., None] - E2M1).abs().argmin(-1).to(torch.uint8)  # the nearest table entry
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return packed.view(torch.int8), _e8m0(exps)


def _e8m0(exps: torch.Tensor) -> torch.Tensor:
    """Exponents -> ue8m0 scale bytes (written as bytes and viewed: `.to(float8_e8m0fnu)` would round values)."""
    return (exps + 127).clamp(0, 254).to(torch.uint8).view(torch.float8_e8m0fnu)
