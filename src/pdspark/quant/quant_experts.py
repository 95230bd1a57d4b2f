"""`QuantExperts`: a MoE layer's routed experts, quantized per expert and projection, stacked for compute.

One expert on its tokens: `g = int_mm(q(x), W13.T) * s_x * s_w13` (`[n, 2I]`, gate rows then up rows),
`a = act(g[:, :I], g[:, I:])`, re-quantized per token, `y = int_mm(q(a), W2.T) * s_a * s_w2`, times the routing
weight. The input is quantized once for all experts (per token: the same for every expert it goes to).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from pdspark.quant import kernels
from pdspark.quant.quant_linear import QuantLinear

Activation = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (gate [n, I], up [n, I]) -> [n, I]


class QuantExperts(nn.Module):
    w13: torch.Tensor
    w13_scale: torch.Tensor
    w2: torch.Tensor
    w2_scale: torch.Tensor

    def __init__(self, scheme: str, w13: torch.Tensor, w13_scale: torch.Tensor, w2: torch.Tensor,
                 w2_scale: torch.Tensor):
        super().__init__()
        self.scheme = scheme
        self.register_buffer("w13", w13)  # [E, 2I, D] int8: w1 (gate) rows, then w3 (up) rows
        self.register_buffer("w13_scale", w13_scale)  # [E, 2I] fp32
        self.register_buffer("w2", w2)  # [E, D, I] int8
        self.register_buffer("w2_scale", w2_scale)  # [E, D] fp32

    @classmethod
    def stack(cls, w1: list[QuantLinear], w3: list[QuantLinear], w2: list[QuantLinear]) -> QuantExperts:
        """Experts given one linear per expert and projection (all of one dynamic scheme)."""
        every = [*w1, *w3, *w2]
        assert every and all(q.dynamic and q.scheme == every[0].scheme for q in every), [q.scheme for q in every]
        return cls(
            every[0].scheme,
            torch.stack([torch.cat([a.weight, b.weight]) for a, b in zip(w1, w3)]),
            torch.stack([torch.cat([a.weight_scale, b.weight_scale]) for a, b in zip(w1, w3)]),
            torch.stack([q.weight for q in w2]),
            torch.stack([q.weight_scale for q in w2]),
        )

    @property
    def n_experts(self) -> int:
        return self.w13.shape[0]

    def expert(self, e: int, x_rows: kernels.Int8Rows, act: Activation) -> torch.Tensor:
        """Expert `e` on already quantized rows -> `[n, D]` fp32."""
        g = kernels.rescale(kernels.int_matmul(x_rows.values, self.w13[e]), x_rows.scale, self.w13_scale[e])
        inter = g.shape[1] // 2
        a = kernels.quantize_per_token(act(g[:, :inter], g[:, inter:]))
        return kernels.rescale(kernels.int_matmul(a.values, self.w2[e]), a.scale, self.w2_scale[e])

    def forward(self, x: torch.Tensor, ids: torch.Tensor, act: Activation) -> torch.Tensor:
        """`x [T, D]` and each token's experts `ids [T, k]` -> each (token, slot)'s expert output `[T, k, D]` fp32,
        unweighted (`MoE.combine` weighs them and sums them in slot order). A row's bits do not depend on the other
        rows it runs with (per-token quantization, exact integer matmuls, per-row rescales)."""
        rows = kernels.quantize_per_token(x)
        T, k = ids.shape
        slots = torch.zeros(T * k, x.shape[1], dtype=torch.float32, device=x.device)
        if T == 1:  # one decode token: its k experts in turn, no grouping
            for j, e in enumerate(ids[0].tolist()):
                slots[j] = self.expert(e, rows, act)[0]
            return slots.view(T, k, -1)
        flat = ids.flatten()
        order = torch.argsort(flat, stable=True)  # (token, slot) pairs grouped by expert
        counts = torch.bincount(flat, minlength=self.n_experts).tolist()
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            pairs = order[start : start + n]  # token * k + slot
            tok = pairs // k
            slots.index_copy_(0, pairs, self.expert(e, kernels.Int8Rows(rows.values[tok], rows.scale[tok]), act))
            start += n
        return slots.view(T, k, -1)

    def dequantized(self) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 `(w13 [E, 2I, D], w2 [E, D, I])` the experts stand for."""
        return self.w13.float() * self.w13_scale[..., None], self.w2.float() * self.w2_scale[..., None]

    def extra_repr(self) -> str:
        E, I2, D = self.w13.shape
        return f"{self.scheme}, experts={E}, hidden={D}, inter={I2 // 2}"
