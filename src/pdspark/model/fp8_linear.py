"""`Fp8Linear`: a linear whose weight stays as DeepSeek-V4's released checkpoint stores it, FP8 e4m3 with one scale
per 128x128 tile, decoded a block of rows at a time when it runs (a byte per weight resident, no float copy).

On the CPU the C kernel (`hardware.cpu.kernels.linear_fp8`) decodes each block into fp32 rows and multiplies them with
the row-exact GEMM, so every output has the bits the weight decoded at load gives through `row_exact_linear`. Where it
does not apply (other devices, no compiler) the weight is decoded with torch and multiplied by BLAS: the hook where a
device's FP8 GEMM plugs in is `Fp8Linear.forward`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pdspark.hardware.cpu import kernels as cpu_kernels
from pdspark.quant.release_formats import FP8_BLOCK, fp8_scale_shape, scale_values


class Fp8Linear(nn.Module):
    weight: torch.Tensor
    scale: torch.Tensor

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor, row0: int = 0):
        """`weight [N, K]` float8_e4m3fn; `scale`: the tile scales (ue8m0 or fp32, kept as fp32 multipliers: one per
        16,384 weights) of the matrix whose rows `[row0, row0 + N)` this weight is (0: the whole matrix)."""
        super().__init__()
        assert weight.dtype is torch.float8_e4m3fn and weight.dim() == 2, (weight.dtype, weight.shape)
        self.register_buffer("weight", weight)  # [N, K] e4m3
        self.register_buffer("scale", scale_values(scale))  # [ceil(rows / 128), ceil(K / 128)] fp32
        self.row0 = row0
        rows, cols = fp8_scale_shape(row0 + weight.shape[0], weight.shape[1])
        assert self.scale.shape[0] >= rows and self.scale.shape[1] == cols, (row0, weight.shape, scale.shape)

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    @property
    def in_features(self) -> int:
        return self.weight.shape[1]

    def rows(self, start: int, stop: int) -> Fp8Linear:
        """Output rows `[start, stop)` as a linear of their own (views, no copy): a group of a grouped projection."""
        return Fp8Linear(self.weight[start:stop], self.scale, self.row0 + start)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """`x [..., K]` -> `[..., N]` fp32."""
        if not torch.is_grad_enabled():
            out = cpu_kernels.linear_fp8(x, self.weight, self.scale, self.row0)
            if out is not None:
                return out
        return F.linear(x.float(), self.dequantized_weight())

    def dequantized_weight(self) -> torch.Tensor:
        """The fp32 weight `[N, K]` this linear stands for."""
        N, K = self.weight.shape
        r0 = self.row0
        tiles = self.scale[r0 // FP8_BLOCK : -(-(r0 + N) // FP8_BLOCK)]
        # Every element takes its tile's scale; the rows start `r0 % 128` into their first tile.
        expanded = tiles.repeat_interleave(FP8_BLOCK, 0)[r0 % FP8_BLOCK : r0 % FP8_BLOCK + N]
        return self.weight.to(torch.float32) * expanded.repeat_interleave(FP8_BLOCK, 1)[:, :K]

    def extra_repr(self) -> str:
        return f"fp8 e4m3 128x128, in={self.in_features}, out={self.out_features}"
