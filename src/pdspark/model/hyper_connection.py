"""Manifold-constrained hyper-connections (mHC): `hc_mult` residual streams per token.

A sublayer reads one collapsed stream (`pre`-weighted sum) and writes back through `post` (expand) and `comb`
(a Sinkhorn-normalised, doubly stochastic `[hc, hc]` mix of the residual streams).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from pdspark.hardware.cpu import kernels as cpu_kernels
from pdspark.model.norm import RMSNorm, rms_norm

# Up to this many tokens, the whole collapse runs as one C call (decode steps are bound by per-op overhead);
# longer chunks compute the mixes with a BLAS matmul, which is faster there, and the rest in C.
_C_COLLAPSE_MAX_TOKENS = 64


class Collapsed(NamedTuple):
    """The streams collapsed into one sublayer input, and the weights that write its output back."""

    x: torch.Tensor  # [T, D] the sublayer's input (the `pre`-weighted sum of the streams, normalised when asked)
    post: torch.Tensor  # [T, hc] fp32: how much of the output each stream receives
    comb: torch.Tensor  # [T, hc, hc] fp32: the doubly stochastic mix of the residual streams


class HyperConnection(nn.Module):
    mm = staticmethod(F.linear)  # the float matmul (`DSV4Model.prepare_inference`: batch-invariant mode)

    def __init__(self, hc_mult: int, hidden_size: int, sinkhorn_iters: int, hc_eps: float, norm_eps: float):
        super().__init__()
        self.hc = hc_mult
        self.sinkhorn_iters = sinkhorn_iters
        self.hc_eps = hc_eps
        self.norm_eps = norm_eps
        mix = (2 + hc_mult) * hc_mult
        self.fn = nn.Parameter(torch.zeros(mix, hc_mult * hidden_size))  # [(2+hc)*hc, hc*D]
        self.base = nn.Parameter(torch.zeros(mix))
        self.scale = nn.Parameter(torch.ones(3))
        self._frozen: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def freeze(self) -> None:
        """Inference only: keep contiguous fp32 copies of the mix parameters for the C collapse (call once the
        weights are final)."""
        fn, scale, base = (p.detach().float().contiguous() for p in (self.fn, self.scale, self.base))
        self._frozen = (fn, scale, base)

    def collapse(self, h: torch.Tensor, norm: RMSNorm | None = None) -> Collapsed:
        """The sublayer input of the streams `h [T, hc, D]` and the weights to expand its output with; with `norm`,
        the input comes back through that RMSNorm (in the same C call for a few tokens)."""
        if self._frozen is not None and h.dtype == torch.float32 and not torch.is_grad_enabled():
            fn, scale, base = self._frozen
            if h.shape[0] <= _C_COLLAPSE_MAX_TOKENS:
                x_norm = None if norm is None else (norm.weight, norm.eps)
                fused = cpu_kernels.hc_collapse(h, fn, scale, base, self.sinkhorn_iters, self.hc_eps, self.norm_eps,
                                                x_norm)
                if fused is not None:
                    return Collapsed(*fused)
            else:
                mixes = self.mm(rms_norm(h.flatten(1), None, self.norm_eps), fn)  # [T, (2+hc)*hc]
                fused = cpu_kernels.hc_collapse_mixed(h, mixes, scale, base, self.sinkhorn_iters, self.hc_eps)
                if fused is not None:
                    x, post, comb = fused
                    return Collapsed(x if norm is None else norm(x), post, comb)
        flat = rms_norm(h.flatten(1).float(), None, self.norm_eps)
        pre, post, comb = self.split_sinkhorn(self.mm(flat, self.fn.float()))
        x = (pre.unsqueeze(-1) * h).sum(dim=1).to(h.dtype)
        return Collapsed(x if norm is None else norm(x), post, comb)

    def split_sinkhorn(self, mixes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """PyTorch reference of the mHC weights: `mixes [T, (2+hc)*hc]` -> pre, post, comb."""
        hc = self.hc
        pre_w, post_w, comb_w = mixes.split([hc, hc, hc * hc], dim=-1)
        pre_b, post_b, comb_b = self.base.split([hc, hc, hc * hc])
        pre_s, post_s, comb_s = self.scale.unbind(0)
        pre = torch.sigmoid(pre_w * pre_s + pre_b) + self.hc_eps
        post = 2 * torch.sigmoid(post_w * post_s + post_b)
        comb = torch.softmax(comb_w.unflatten(-1, (hc, hc)) * comb_s + comb_b.view(hc, hc), dim=-1) + self.hc_eps
        comb = comb / (comb.sum(dim=-2, keepdim=True) + self.hc_eps)
        for _ in range(self.sinkhorn_iters - 1):
            comb = comb / (comb.sum(dim=-1, keepdim=True) + self.hc_eps)
            comb = comb / (comb.sum(dim=-2, keepdim=True) + self.hc_eps)
        return pre, post, comb

    @staticmethod
    def expand(y: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
        """`h'[i] = post[i] * y + sum_j comb[j, i] * residual[j]`; `y [T, D]`, `residual [T, hc, D]`."""
        if not torch.is_grad_enabled():
            fused = cpu_kernels.hc_expand(y, residual, post, comb)
            if fused is not None:
                return fused
        dtype = residual.dtype
        return post.to(dtype).unsqueeze(-1) * y.unsqueeze(-2) + torch.matmul(comb.to(dtype).transpose(-1, -2), residual)


class HyperHead(nn.Module):
    """Final collapse of the streams (no Sinkhorn): `y = sum_i (sigmoid(mix_i) + eps) * h_i`."""

    mm = staticmethod(F.linear)  # the float matmul (`DSV4Model.prepare_inference`: batch-invariant mode)

    def __init__(self, hc_mult: int, hidden_size: int, hc_eps: float, norm_eps: float):
        super().__init__()
        self.hc_eps = hc_eps
        self.norm_eps = norm_eps
        self.fn = nn.Parameter(torch.zeros(hc_mult, hc_mult * hidden_size))
        self.base = nn.Parameter(torch.zeros(hc_mult))
        self.scale = nn.Parameter(torch.ones(1))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        flat = rms_norm(h.flatten(1).float(), None, self.norm_eps)
        mixes = self.mm(flat, self.fn.float())
        pre = torch.sigmoid(mixes * self.scale.float() + self.base.float()) + self.hc_eps
        return (pre.unsqueeze(-1) * h).sum(dim=1).to(h.dtype)
