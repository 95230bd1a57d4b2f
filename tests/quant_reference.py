"""Dequantize-in-float references for the quantized linears and experts of `pdspark.quant`."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pdspark.quant import kernels
from pdspark.quant.quant_experts import QuantExperts
from pdspark.quant.quant_linear import QuantLinear


def fake_quant_rows(x: torch.Tensor) -> torch.Tensor:
    """Per-token quantize-dequantize in float: what the int8 activations stand for."""
    rows = kernels.quantize_per_token(x)
    return rows.values.float() * rows.scale


def linear_reference(q: QuantLinear, x: torch.Tensor) -> torch.Tensor:
    """`q(x)` computed in float from dequantized activations and weights."""
    if q.dynamic:
        return F.linear(fake_quant_rows(x), q.dequantized_weight())
    x_deq = (kernels.quantize_static(x, q.input_scale, q.input_offset).float() - q.input_offset) * q.input_scale
    # quant_bias = round(bias / deq_scale) - offset * sum_k W[n, k]: add the zero-point part back, keep the bias
    folded_bias = (q.quant_bias.double() + q.input_offset.double() * q.weight.double().sum(dim=1)) * q.deq_scale
    return F.linear(x_deq, q.dequantized_weight()) + folded_bias.float()


def experts_reference(experts: QuantExperts, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                      act) -> torch.Tensor:
    """The routed experts one (token, expert) pair at a time, in float."""
    w13, w2 = experts.dequantized()
    inter = w13.shape[1] // 2
    out = torch.zeros(x.shape[0], w2.shape[1])
    for t in range(x.shape[0]):
        xt = fake_quant_rows(x[t : t + 1])
        for e, wt in zip(ids[t].tolist(), weights[t].tolist()):
            h = F.linear(xt, w13[e])
            out[t] += F.linear(fake_quant_rows(act(h[:, :inter], h[:, inter:])), w2[e])[0] * wt
    return out


def assert_fp32_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Equal up to fp32 rounding of a K-term sum (relative to the output's magnitude)."""
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5 * float(expected.abs().max()))
