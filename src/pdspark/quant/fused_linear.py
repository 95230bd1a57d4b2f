"""`FusedLinear`: several linears that read the same input, run as few matmuls as their kinds allow."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from pdspark.quant.quant_linear import QuantLinear


class FusedLinear:
    """Float weights are stacked into one matmul; dynamic quantized linears of one scheme into one int8 matmul
    (they share the input's per-token scales); any other linear module (a static quantized one, a compact FP8 one)
    runs alone. With float weights only this is exactly one `F.linear` and a split. Built once the weights are final.
    `stack` False: float weights run one by one too (stacking copies them: a compact model keeps one copy)."""

    def __init__(self, weights: Sequence[torch.Tensor | nn.Module], stack: bool = True):
        self.sizes = [w.shape[0] if isinstance(w, torch.Tensor) else int(w.out_features)  # type: ignore[arg-type]
                      for w in weights]  # (a linear module's `out_features` is an int property)
        # Each group: (positions in `weights`, the fused weight or linear).
        self.groups: list[tuple[list[int], torch.Tensor | nn.Module]] = []
        floats = [(i, w.detach()) for i, w in enumerate(weights) if isinstance(w, torch.Tensor)]
        if floats and stack:
            self.groups.append(([i for i, _ in floats], torch.cat([w for _, w in floats])))
        else:
            self.groups += [([i], w) for i, w in floats]
        by_scheme: dict[str, list[int]] = {}
        for i, w in enumerate(weights):
            if isinstance(w, QuantLinear) and w.dynamic:
                by_scheme.setdefault(w.scheme, []).append(i)
            elif isinstance(w, nn.Module):
                self.groups.append(([i], w))
        for idx in by_scheme.values():
            self.groups.append((idx, QuantLinear.concat([weights[i] for i in idx])))  # type: ignore[misc]

    mm = staticmethod(F.linear)  # the float matmul (set by the model: batch-invariant mode)

    def __call__(self, x: torch.Tensor) -> list[torch.Tensor]:
        """`x [T, K]` -> one `[T, N_i]` output per weight, in the order given."""
        if len(self.groups) == 1 and isinstance(self.groups[0][1], torch.Tensor):
            return list(self.mm(x, self.groups[0][1]).split(self.sizes, dim=-1))
        out: list[torch.Tensor | None] = [None] * len(self.sizes)
        for idx, w in self.groups:
            y = self.mm(x, w) if isinstance(w, torch.Tensor) else w(x)
            for i, part in zip(idx, y.split([self.sizes[i] for i in idx], dim=-1)):
                out[i] = part
        return out  # type: ignore[return-value]  # every position belongs to one group
