"""The C head (`kernels.lm_head`) of a verify step's rows: its rows share each read of the head, and each row's
logits are bit for bit that row's alone, so a verify row scores its token exactly as a plain decode step would."""

from __future__ import annotations

import pytest
import torch

from pdspark.hardware.cpu import kernels


@pytest.mark.skipif(kernels.load() is None, reason="C kernels off here: the C head cannot exist")
def test_head_rows_equal_one_row_calls_bit_for_bit():
    g = torch.Generator().manual_seed(4)
    hc, D, V = 4, 48, 103  # V not a multiple of 4: the GEMM's tail rows too
    fn, base = 0.1 * torch.randn(hc, hc * D, generator=g), torch.randn(hc, generator=g)
    scale, norm_w, head = torch.ones(1), torch.rand(D, generator=g) + 0.5, torch.randn(V, D, generator=g)
    h = torch.randn(8, hc, D, generator=g)
    rows = kernels.lm_head(h, fn, scale, base, 1e-6, 1e-6, norm_w, 1e-6, head)
    one_by_one = [kernels.lm_head(h[i : i + 1].contiguous(), fn, scale, base, 1e-6, 1e-6, norm_w, 1e-6, head)
                  for i in range(8)]
    assert rows is not None and rows.shape == (8, V)
    assert torch.equal(rows, torch.cat(one_by_one))  # type: ignore[arg-type]
