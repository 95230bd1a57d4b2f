"""`row_exact_linear`: the float matmul of a model run in batch-invariant mode (`DSV4Model.prepare_inference`).

A quantized checkpoint's reference path multiplies its integer projections exactly, but its float matmuls (mHC
mixes, router gate, compressor and indexer projections, the grouped output projection, the head, a long chunk's
attention scores and values) would go through BLAS, whose bits for a row change with the number of rows in the call
on some CPUs (measured: MKL with AVX-512). Then a request's tokens would depend on what it was batched or chunked
with. In this mode the modules' `mm` is this row-exact kernel instead (slower than BLAS; the quantized path is the
correctness reference, not the fast one).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pdspark.hardware.cpu import kernels as cpu_kernels


def row_exact_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """`F.linear(x, w)` with every output row's bits independent of the other rows (BLAS where the C kernel does
    not apply: non-fp32 or non-CPU tensors). A bf16 weight (compact models) reads as the fp32 it widens to."""
    out = cpu_kernels.linear_rows(x, w)
    if out is not None:
        return out
    return F.linear(x, w if w.dtype == x.dtype else w.to(x.dtype))


def use_row_exact(root: torch.nn.Module, fused: type) -> None:
    """Every float matmul of `root`'s module path through `row_exact_linear`: each module whose class has an `mm`,
    and each `fused` (`FusedLinear`) it holds."""
    for module in root.modules():
        if hasattr(type(module), "mm"):
            module.mm = row_exact_linear  # type: ignore[assignment]  # (a submodule slot to mypy)
        for value in vars(module).values():
            if isinstance(value, fused):
                value.mm = row_exact_linear  # type: ignore[attr-defined]  # (a `FusedLinear`)
