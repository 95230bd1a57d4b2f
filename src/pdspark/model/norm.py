"""RMS normalisation as DSV4 computes it: in fp32, weights kept in fp32, one cast back at the end."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pdspark.hardware.cpu import kernels as cpu_kernels


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """Normalise the last dim of `x`; `weight=None` is the unweighted variant (q heads, mHC input)."""
    if not torch.is_grad_enabled() and x.numel():
        fused = cpu_kernels.rms_norm(x, weight, eps)  # one C call instead of ~6 tiny ops (fp32 CPU only)
        if fused is not None:
            return fused
    if weight is None:
        if x.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), None, eps)  # one op: x * rsqrt(mean(x^2) + eps)
        return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)  # one op, same fp32 arithmetic
    return F.rms_norm(x.float(), (x.shape[-1],), weight.float(), eps).to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)
