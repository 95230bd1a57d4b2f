"""The C mHC kernel computes what the PyTorch reference computes (it is a speed path, not a different model)."""

from __future__ import annotations

import torch

from pdspark.hardware.cpu import kernels
from pdspark.model.hyper_connection import HyperConnection


def test_c_sinkhorn_matches_the_torch_reference():
    assert kernels.load() is not None, "the machine has a C compiler; the kernel must build"
    torch.manual_seed(0)
    for hc in (2, 4):
        mod = HyperConnection(hc, 32, 20, 1e-6, 1e-6)
        with torch.no_grad():
            mod.fn.normal_(0, 0.5)
            mod.base.normal_(0, 0.5)
            mod.scale.uniform_(0.5, 1.5)
        h = torch.randn(7, hc, 32)
        with torch.inference_mode():
            fast = mod.collapse(h)  # C Sinkhorn
        with torch.enable_grad():
            slow = mod.collapse(h)  # autograd-capable PyTorch path
        for a, b in zip(fast, slow):
            torch.testing.assert_close(a, b, atol=2e-6, rtol=0)
        # The last Sinkhorn round normalises columns: they sum to 1 (rows only approach it).
        torch.testing.assert_close(fast[2].sum(-2), torch.ones(7, hc), atol=1e-5, rtol=0)
