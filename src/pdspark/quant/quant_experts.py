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

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, act: Activation) -> torch.Tensor:
        """`x [T, D]`, each token's experts `ids [T, k]` and routing weights `[T, k]` -> `[T, D]` in x's dtype."""
        rows = kernels.quantize_per_token(x)
        if x.shape[0] == 1:  # one decode token: its k experts in turn, no grouping
            # In the grouped path's order (expert id, then slot: a stable sort), summed from zero in fp32 as its
            # `index_add_` does: fp32 addition is not associative, and a token's bits must not depend on whether it
            # ran alone or in a batch (slot order here gave other bits than the same token in a batch).
            acc = torch.zeros(1, x.shape[1], dtype=torch.float32, device=x.device)
            for e, w in sorted(zip(ids[0].tolist(), weights[0].float().tolist()), key=lambda pair: pair[0]):
                acc += self.expert(e, rows, act) * w
            return acc.to(x.dtype)
        k = ids.shape[1]
        flat = ids.flatten()
        order = torch.argsort(flat, stable=True)  # (token, slot) pairs grouped by expert
        counts = torch.bincount(flat, minlength=self.n_experts).tolist()
        token_of = order // k
        weight_of = weights.flatten()[order].float()
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            tok = token_of[start : start + n]
            y = self.expert(e, kernels.Int8Rows(rows.values[tok], rows.scale[tok]), act)
            out.index_add_(0, tok, y * weight_of[start : start + n, None])
            start += n
        return out.to(x.dtype)

    def dequantized(self) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 `(w13 [E, 2I, D], w2 [E, D, I])` the experts stand for."""
        return self.w13.float() * self.w13_scale[..., None], self.w2.float() * self.w2_scale[..., None]

    def extra_repr(self) -> str:
        E, I2, D = self.w13.shape
        return f"{self.scheme}, experts={E}, hidden={D}, inter={I2 // 2}"
