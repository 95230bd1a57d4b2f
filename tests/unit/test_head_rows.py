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


@pytest.mark.skipif(kernels.load() is None, reason="C kernels off here: the C head cannot exist")
@pytest.mark.parametrize("rows", [6, 48, 64])
def test_the_models_logits_of_every_c_step_size_are_each_rows_alone(rows):
    """`DSV4Model.logits` takes the C head for every row count the C decode step runs (a batch-8 verify is 48 rows):
    a verify row's logits are then a plain decode step's bit for bit at every batch (BLAS gives a row other bits by
    the rows beside it)."""
    from pdspark import LLM
    from pdspark.llm import resolve_model

    model = LLM(resolve_model("dsv4-tiny"), max_model_len=128, enable_prefix_cache=False).engine.runner.model
    g = torch.Generator().manual_seed(rows)
    h = torch.randn(rows, model.cfg.hc_mult, model.cfg.hidden_size, generator=g)
    with torch.inference_mode():
        together = model.logits(h)
        alone = torch.cat([model.logits(h[i : i + 1]) for i in range(rows)])
    assert torch.equal(together, alone)
