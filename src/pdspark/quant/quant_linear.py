"""`QuantLinear`: one ModelSlim-quantized linear (W8A8 static, W8A8_DYNAMIC, W4A8_DYNAMIC) in place of a weight.

W4A8 weights are unpacked to int8 at load (values in [-8, 7]) and then run as W8A8_DYNAMIC: a CPU has no int4
GEMM, and the math is the same. `scale_bias` (W4A8) is a constant of the Ascend int8 x int4 kernel and is not needed
here; the zero `weight_offset` of symmetric weights is checked and dropped.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pdspark.errors import CheckpointError
from pdspark.quant import kernels
from pdspark.quant.scheme import DYNAMIC_SCHEMES, W4A8_DYNAMIC, W8A8

_DYNAMIC_TENSORS = {"weight", "weight_scale", "weight_offset"}
_STATIC_TENSORS = {"weight", "input_scale", "input_offset", "quant_bias", "deq_scale"}
_IGNORED = {"scale_bias"}


class QuantLinear(nn.Module):
    """`y = x @ W.T` with int8 weights `[N, K]`: dynamic schemes keep `weight_scale [N]`; the static one keeps its
    calibrated `input_scale`/`input_offset` ([1] each), the int32 `quant_bias [N]` and fp32 `deq_scale [N]`."""

    weight: torch.Tensor
    weight_scale: torch.Tensor
    input_scale: torch.Tensor
    input_offset: torch.Tensor
    quant_bias: torch.Tensor
    deq_scale: torch.Tensor

    def __init__(self, scheme: str, weight: torch.Tensor, **scales: torch.Tensor):
        super().__init__()
        assert weight.dtype == torch.int8 and weight.dim() == 2, (weight.dtype, weight.shape)
        self.scheme = scheme
        self.register_buffer("weight", weight)  # [N, K] int8
        for name, t in scales.items():
            self.register_buffer(name, t)

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    @property
    def in_features(self) -> int:
        return self.weight.shape[1]

    @property
    def dynamic(self) -> bool:
        return self.scheme in DYNAMIC_SCHEMES

    @classmethod
    def from_tensors(cls, prefix: str, scheme: str, tensors: dict[str, torch.Tensor]) -> QuantLinear:
        """Build from a checkpoint's tensors `prefix.<suffix>` (keyed by suffix), checking names, dtypes and shapes.

        Args:
            prefix: the linear's checkpoint name, for errors (`layers.0.attn.wq_a`).
            scheme: its scheme from the description file.
            tensors: `{"weight": ..., "weight_scale": ..., ...}`.
        """
        want = _STATIC_TENSORS if scheme == W8A8 else _DYNAMIC_TENSORS
        if scheme not in (W8A8, *DYNAMIC_SCHEMES):
            raise CheckpointError(f"{prefix}: scheme {scheme!r} is not a quantized linear scheme")
        missing = want - tensors.keys()
        unexpected = tensors.keys() - want - _IGNORED
        if missing or unexpected:
            raise CheckpointError(f"{prefix} ({scheme}): missing tensors {sorted(missing)}, unexpected "
                                  f"{sorted(unexpected)}")
        weight = tensors["weight"]
        if weight.dtype != torch.int8 or weight.dim() != 2:
            raise CheckpointError(f"{prefix}.weight ({scheme}) is {weight.dtype} {tuple(weight.shape)}; expected a "
                                  "2-D int8 tensor")
        if scheme == W4A8_DYNAMIC:
            weight = kernels.unpack_int4(weight)
        n = weight.shape[0]
        if scheme == W8A8:
            deq = kernels.decode_deq_scale(tensors["deq_scale"]).reshape(-1)
            in_scale = tensors["input_scale"].float().reshape(-1)
            in_offset = tensors["input_offset"].float().reshape(-1)
            bias = tensors["quant_bias"].reshape(-1)
            _check(prefix, "deq_scale", deq, n)
            _check(prefix, "quant_bias", bias, n)
            _check(prefix, "input_scale", in_scale, 1)
            _check(prefix, "input_offset", in_offset, 1)
            if bias.dtype != torch.int32:
                raise CheckpointError(f"{prefix}.quant_bias is {bias.dtype}; expected int32")
            return cls(scheme, weight, input_scale=in_scale, input_offset=in_offset, quant_bias=bias, deq_scale=deq)
        scale = tensors["weight_scale"].float().reshape(-1)
        _check(prefix, "weight_scale", scale, n)
        if bool(tensors["weight_offset"].any()):
            raise CheckpointError(f"{prefix}.weight_offset is not zero: asymmetric weights are not supported")
        return cls(scheme, weight, weight_scale=scale)

    @classmethod
    def concat(cls, linears: list[QuantLinear]) -> QuantLinear:
        """Dynamic linears on the same input as one (rows stacked): per-token activation scales are shared, so the
        result equals each alone."""
        assert linears and all(q.dynamic for q in linears), [q.scheme for q in linears]
        return cls(linears[0].scheme, torch.cat([q.weight for q in linears]),
                   weight_scale=torch.cat([q.weight_scale for q in linears]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """`x [..., K]` -> `[..., N]` in x's dtype."""
        x2 = x.reshape(-1, x.shape[-1])
        if self.dynamic:
            y = kernels.dynamic_linear(x2, self.weight, self.weight_scale)
        else:
            y = kernels.static_linear(x2, self.weight, self.input_scale, self.input_offset, self.quant_bias,
                                      self.deq_scale)
        return y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)

    def dequantized_weight(self) -> torch.Tensor:
        """The fp32 weight `[N, K]` this linear stands for (weight x per-channel scale)."""
        scale = self.weight_scale if self.dynamic else self.deq_scale / self.input_scale
        return self.weight.float() * scale[:, None]

    def extra_repr(self) -> str:
        return f"{self.scheme}, in={self.in_features}, out={self.out_features}"


def linear(x: torch.Tensor, w: torch.Tensor | nn.Module, mm=F.linear) -> torch.Tensor:
    """`x @ w.T` for a float weight (through `mm`) or a linear module (a quantized one, a compact FP8 one)."""
    return mm(x, w) if isinstance(w, torch.Tensor) else w(x)


def _check(prefix: str, name: str, t: torch.Tensor, numel: int) -> None:
    if t.numel() != numel:
        raise CheckpointError(f"{prefix}.{name} has {t.numel()} values; expected {numel}")
