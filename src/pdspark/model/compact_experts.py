"""`CompactExperts`: a MoE layer's routed experts kept as the released checkpoint stores them, MXFP4 (V4-Flash,
V4-Pro: half a byte a weight plus a ue8m0 byte per 32) or FP8 in 128x128 tiles (V4-Flash-Base), decoded a block of
rows at a time when an expert runs.

Only the experts this rank holds are kept (`[first, first + count)` of the layer's); a (token, slot) routed elsewhere
gets zeros, as `MoE._held_slots` gives for float experts (the exchange fills them in). One expert on its rows:
`act(x @ w1.T, x @ w3.T) @ w2.T`, each product through the compact kernels (`hardware.cpu.kernels.linear_mxfp4` /
`linear_fp8`), whose every output has the bits of the row-exact GEMM over the weights decoded at load.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from pdspark.hardware.cpu import kernels as cpu_kernels
from pdspark.model.fp8_linear import Fp8Linear
from pdspark.quant.release_formats import E2M1, FP8_BLOCK, dequant_mxfp4, scale_values

Activation = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (gate [n, I], up [n, I]) -> [n, I]
MXFP4, FP8 = "mxfp4", "fp8"
PROJECTIONS = ("w1", "w3", "w2")  # gate, up, down
STACKS = ("w13", "w2")  # how they are held: gate and up rows in one stack


class CompactExperts(nn.Module):
    w13: torch.Tensor
    w13_scale: torch.Tensor
    w2: torch.Tensor
    w2_scale: torch.Tensor
    _e2m1: torch.Tensor
    _e8m0: torch.Tensor

    def __init__(self, fmt: str, first: int, weights: dict[str, torch.Tensor], scales: dict[str, torch.Tensor]):
        """`weights[p]`, `scales[p]` for p in w13 (each expert's gate rows w1, then its up rows w3) and w2, stacked over
        the held experts: MXFP4 uint8 `[E, out, in/2]` and uint8 ue8m0 `[E, out, in/32]`; FP8 e4m3 `[E, out, in]` and
        fp32 `[E, tiles, ceil(in/128)]` (w13: w1's ceil(I/128) tile rows, then w3's). Gate and up rows share one stack
        so that the C decode step reads an expert's 2I rows as one matrix, as it reads float experts."""
        super().__init__()
        assert fmt in (MXFP4, FP8), fmt
        self.fmt, self.first = fmt, first
        for p in STACKS:
            self.register_buffer(p, weights[p])
            self.register_buffer(f"{p}_scale", scales[p])
        self.count = weights["w13"].shape[0]
        self.inter = weights["w13"].shape[1] // 2
        self.register_buffer("_e2m1", E2M1.clone(), persistent=False)  # [16] the code values
        self.register_buffer("_e8m0", scale_values(torch.arange(256, dtype=torch.uint8).view(torch.float8_e8m0fnu)),
                             persistent=False)  # [256] the scale bytes' values

    def weights(self, e: int, p: str) -> tuple[torch.Tensor, torch.Tensor]:
        """Held expert `e`'s projection `p` (w1, w3 or w2): its stored weight and scale (views)."""
        if p == "w2":
            return self.w2[e], self.w2_scale[e]
        I = self.inter
        tiles = -(-I // FP8_BLOCK) if self.fmt == FP8 else I  # the scale rows of one half
        half = slice(0, I) if p == "w1" else slice(I, 2 * I)
        return self.w13[e, half], self.w13_scale[e, slice(0, tiles) if p == "w1" else slice(tiles, 2 * tiles)]

    def project(self, e: int, p: str, x: torch.Tensor) -> torch.Tensor:
        """Held expert `e` (0-based within the shard), projection `p`, on rows `x [n, in]` -> `[n, out]` fp32."""
        w, s = self.weights(e, p)
        if self.fmt == FP8:
            return Fp8Linear(w, s)(x)
        if not torch.is_grad_enabled():
            out = cpu_kernels.linear_mxfp4(x, w, s, self._e2m1, self._e8m0)
            if out is not None:
                return out
        return F.linear(x.float(), dequant_mxfp4(w, s.view(torch.float8_e8m0fnu)))

    def expert(self, e: int, x: torch.Tensor, act: Activation) -> torch.Tensor:
        return self.project(e, "w2", act(self.project(e, "w1", x), self.project(e, "w3", x)))

    def forward(self, x: torch.Tensor, ids: torch.Tensor, act: Activation) -> torch.Tensor:
        """`x [T, D]` and each token's experts `ids [T, k]` -> each (token, slot)'s expert output `[T, k, D]` fp32,
        unweighted (`MoE.combine` weighs them); zeros for experts held elsewhere."""
        T, k = ids.shape
        x = x.float()
        slots = torch.zeros(T * k, x.shape[1], dtype=torch.float32, device=x.device)
        flat = ids.flatten() - self.first
        order = torch.argsort(flat, stable=True)  # (token, slot) pairs grouped by expert
        held = (flat >= 0) & (flat < self.count)
        counts = torch.bincount(flat[held], minlength=self.count).tolist()
        start = int((flat < 0).sum())  # pairs of experts before the shard sort first
        for e, n in enumerate(counts):
            if n == 0:
                continue
            pairs = order[start : start + n]  # token * k + slot
            slots.index_copy_(0, pairs, self.expert(e, x[pairs // k], act))
            start += n
        return slots.view(T, k, -1)

    def extra_repr(self) -> str:
        return f"{self.fmt}, experts=[{self.first}, {self.first + self.count}), inter={self.inter}"
