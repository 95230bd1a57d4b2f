"""The runtime math of ModelSlim's W8A8 / W8A8_DYNAMIC / W4A8_DYNAMIC schemes, in pure torch (the CPU reference).

Formulas are those of the Ascend kernels the checkpoints are made for (`npu_dynamic_quant`, `npu_quantize`,
`npu_quant_matmul`): int8 activations times int8 weights accumulate exactly in int32 (`torch._int_mm`, which runs on
CPU at any M, K, N, M=1 included); the float scales are applied to the int32 result.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

INT8_MAX = 127


class Int8Rows(NamedTuple):
    """Per-token symmetric int8 quantization of `x [M, K]`: `x ~= values * scale`."""

    values: torch.Tensor  # [M, K] int8
    scale: torch.Tensor  # [M, 1] fp32


def quantize_per_token(x: torch.Tensor) -> Int8Rows:
    """Dynamic per-token quantization: `s = rowmax(|x|) / 127`, `x_q = round(x / s)` (fp32 math)."""
    x = x.float()
    amax = x.abs().amax(dim=-1, keepdim=True)  # [M, 1]
    # An all-zero row quantizes to zeros with any scale; 1.0 avoids 0/0.
    scale = torch.where(amax > 0, amax / INT8_MAX, torch.ones_like(amax))
    values = torch.round(x / scale).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return Int8Rows(values, scale)


def quantize_static(x: torch.Tensor, input_scale: torch.Tensor, input_offset: torch.Tensor) -> torch.Tensor:
    """Static per-tensor asymmetric quantization: `clamp(round(x / input_scale + input_offset), -128, 127)`.

    `input_scale` and `input_offset` are one-element fp32 tensors (the offset holds an integer value)."""
    q = torch.round(x.float() / input_scale + input_offset)
    return q.clamp_(-128, 127).to(torch.int8)


def int_matmul(x_q: torch.Tensor, w_q: torch.Tensor) -> torch.Tensor:
    """`x_q [M, K] int8 @ w_q[N, K].T` -> `[M, N]` int32, exact."""
    if x_q.shape[0] == 0:
        return torch.zeros(0, w_q.shape[0], dtype=torch.int32, device=x_q.device)
    return torch._int_mm(x_q, w_q.t())


def dynamic_linear(x: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """W8A8_DYNAMIC: `(x_q @ w_q.T) * s_x[m] * w_scale[n]` in fp32. `w_scale [N]`; returns `[M, N]` fp32."""
    rows = quantize_per_token(x)
    return rescale(int_matmul(rows.values, w_q), rows.scale, w_scale)


def rescale(acc: torch.Tensor, row_scale: torch.Tensor, col_scale: torch.Tensor) -> torch.Tensor:
    """Per-token x per-channel dequantization of an int32 product: `acc [M, N] * row_scale [M, 1] * col_scale [N]`."""
    return acc.float() * row_scale * col_scale


def static_linear(x: torch.Tensor, w_q: torch.Tensor, input_scale: torch.Tensor, input_offset: torch.Tensor,
                  quant_bias: torch.Tensor, deq_scale: torch.Tensor) -> torch.Tensor:
    """Static W8A8: `(x_q @ w_q.T + quant_bias) * deq_scale` in fp32 (`quant_bias [N]` int32 has the zero point
    folded in, see `fold_zero_point`; `deq_scale [N]` fp32 = input_scale * weight_scale)."""
    acc = int_matmul(quantize_static(x, input_scale, input_offset), w_q)
    return (acc + quant_bias).float() * deq_scale


def fold_zero_point(bias: torch.Tensor | None, w_q: torch.Tensor, input_offset: torch.Tensor,
                    deq_scale: torch.Tensor) -> torch.Tensor:
    """The int32 `quant_bias [N]` of a static W8A8 linear: the float bias in units of `deq_scale`, minus the
    activation zero point's contribution `input_offset * sum_k w_q[n, k]` (exact in integers: the offset is one)."""
    zero_point = input_offset.round().to(torch.int64) * w_q.to(torch.int64).sum(dim=1)  # [N]
    b = torch.zeros_like(zero_point) if bias is None else torch.round(bias.float() / deq_scale).to(torch.int64)
    return (b - zero_point).to(torch.int32)


def decode_deq_scale(deq_scale: torch.Tensor) -> torch.Tensor:
    """`deq_scale` as fp32: ModelSlim writes it as fp32 (bf16 source models) or as int64 holding the fp32 bit
    pattern in its low 32 bits (other sources)."""
    if deq_scale.dtype == torch.int64:
        return (deq_scale & 0xFFFFFFFF).to(torch.int32).view(torch.float32)
    if not deq_scale.is_floating_point():
        raise ValueError(f"deq_scale has dtype {deq_scale.dtype}; expected float32 or int64 (an fp32 bit pattern)")
    return deq_scale.float()


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """W4A8 weights `[N/2, K]` int8, pairs along the output dimension (row 2j in the low nibble, 2j+1 in the high
    nibble, two's complement) -> `[N, K]` int8 in [-8, 7]."""
    if packed.dtype != torch.int8:
        raise ValueError(f"packed int4 weight has dtype {packed.dtype}; expected int8")
    low = torch.bitwise_left_shift(packed, 4) >> 4  # arithmetic shift: sign-extends the low nibble
    high = packed >> 4
    return torch.stack([low, high], dim=1).reshape(2 * packed.shape[0], packed.shape[1])


def pack_int4(w: torch.Tensor) -> torch.Tensor:
    """The inverse of `unpack_int4` (`[N, K]` int8 in [-8, 7] -> `[N/2, K]`); for tests and tools."""
    assert w.shape[0] % 2 == 0 and int(w.min()) >= -8 and int(w.max()) <= 7
    pairs = w.reshape(-1, 2, w.shape[1]).to(torch.int16)
    return ((pairs[:, 0] & 0xF) | ((pairs[:, 1] & 0xF) << 4)).to(torch.uint8).view(torch.int8)
