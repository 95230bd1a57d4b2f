"""The C kernels compute what the PyTorch reference computes (they are a speed path, not a different model)."""

from __future__ import annotations

import torch

from pdspark.hardware.cpu import kernels
from pdspark.model.hyper_connection import HyperConnection


def test_c_sinkhorn_matches_the_torch_reference():
    assert kernels.load() is not None, "the machine has a C compiler; the kernel must build"
    torch.manual_seed(0)
    for hc, T in ((2, 7), (4, 7), (4, 100)):  # 100 tokens: mixes by BLAS, the rest in C
        mod = HyperConnection(hc, 32, 20, 1e-6, 1e-6)
        with torch.no_grad():
            mod.fn.normal_(0, 0.5)
            mod.base.normal_(0, 0.5)
            mod.scale.uniform_(0.5, 1.5)
        mod.freeze()
        h = torch.randn(T, hc, 32)
        with torch.inference_mode():
            fast = mod.collapse(h)  # C kernel
        with torch.enable_grad():
            slow = mod.collapse(h)  # autograd-capable PyTorch path
        for a, b in zip(fast, slow):
            torch.testing.assert_close(a, b.detach(), atol=2e-6, rtol=1e-6)
        # The last Sinkhorn round normalises columns: they sum to 1 (rows only approach it).
        torch.testing.assert_close(fast[2].sum(-2), torch.ones(T, hc), atol=1e-5, rtol=0)


def test_c_collapse_and_expand_match_the_torch_reference():
    torch.manual_seed(1)
    for hc, D, T in ((4, 192, 1), (4, 192, 33), (2, 40, 5)):
        mod = HyperConnection(hc, D, 20, 1e-6, 1e-6)
        with torch.no_grad():
            mod.fn.normal_(0, 0.05)
            mod.base.normal_(0, 0.5)
            mod.scale.uniform_(0.5, 1.5)
        h = torch.randn(T, hc, D) * 3
        with torch.enable_grad():
            ref_x, ref_post, ref_comb = mod.collapse(h)  # autograd-capable PyTorch path
            y = torch.randn(T, D)
            ref_h = HyperConnection.expand(y, h, ref_post.detach(), ref_comb.detach())
        mod.freeze()
        with torch.inference_mode():
            x, post, comb = mod.collapse(h)  # one C call
            out = HyperConnection.expand(y, h, post, comb)
        assert x.shape == (T, D) and post.shape == (T, hc) and comb.shape == (T, hc, hc)
        torch.testing.assert_close(x, ref_x.detach(), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(post, ref_post.detach(), atol=2e-6, rtol=0)
        torch.testing.assert_close(comb, ref_comb.detach(), atol=2e-6, rtol=0)
        torch.testing.assert_close(out, ref_h.detach(), atol=1e-5, rtol=1e-5)


def test_c_expand_falls_back_for_non_contiguous_or_other_dtypes():
    y, res = torch.randn(3, 8), torch.randn(3, 2, 8)
    post, comb = torch.rand(3, 2), torch.rand(3, 2, 2)
    assert kernels.hc_expand(y.double(), res.double(), post.double(), comb.double()) is None
    assert kernels.hc_expand(y, res.transpose(0, 1), post, comb) is None
    assert kernels.hc_expand(y, res, post, comb) is not None


def test_c_rope_matches_the_torch_reference_both_ways():
    from pdspark.model.model_config import RopeConfig
    from pdspark.model.rope import RotaryTable

    table = RotaryTable(RopeConfig(theta=10000.0), 16, 64)
    positions = torch.tensor([0, 5, 63])
    at = table.at(positions)
    for x in (torch.randn(3, 4, 64), torch.randn(3, 64)):
        for inverse in (False, True):
            with torch.inference_mode():
                fast = at.apply(x, inverse)  # C
            with torch.enable_grad():
                slow = at.apply(x.requires_grad_(), inverse)  # PyTorch
            torch.testing.assert_close(fast, slow.detach(), atol=1e-6, rtol=1e-6)  # FMA vs not: 1 ulp
        with torch.inference_mode():
            torch.testing.assert_close(at.apply(at.apply(x), inverse=True), x, atol=1e-5, rtol=0)


def test_c_rms_norm_reads_column_slices():
    from pdspark.model.norm import rms_norm

    wide = torch.randn(5, 40)
    w = torch.rand(16) + 0.5
    for part in (wide[:, 8:24], wide[:, :16], wide.view(5, 2, 20)[:, 1, 4:]):
        with torch.inference_mode():
            fast = kernels.rms_norm(part, w, 1e-6)
        assert fast is not None and fast.is_contiguous()
        ref = torch.nn.functional.rms_norm(part.contiguous(), (16,), w, 1e-6)
        torch.testing.assert_close(fast, ref, atol=1e-6, rtol=1e-6)
        with torch.inference_mode():
            torch.testing.assert_close(rms_norm(part, None, 1e-6), ref / w, atol=1e-5, rtol=1e-5)


def test_index_scores_are_the_same_bits_in_c_and_torch_whatever_the_batch():
    from pdspark.model.indexer import index_scores

    torch.manual_seed(2)
    for H, D, T, V in ((2, 16, 37, 21), (4, 32, 5, 8), (64, 128, 3, 17)):
        q, w = torch.randn(T, H, D), torch.rand(T, H)
        scale = D**-0.5
        for keys in (torch.randn(V, D), torch.randn(T, V, D)):  # shared by the queries (prefill), or each its own
            assert kernels.index_scores(q, w, keys, scale) is not None
            with torch.inference_mode():
                fast = index_scores(q, w, keys, scale)  # C
            with torch.enable_grad():
                slow = index_scores(q, w, keys, scale)  # PyTorch
            assert torch.equal(fast, slow)
            # The last query alone, against fewer entries, gets the very same bits as inside the batch.
            own = keys[-1, : V - 3] if keys.dim() == 3 else keys[: V - 3]
            with torch.inference_mode():
                alone = index_scores(q[-1:], w[-1:], own, scale)
            assert torch.equal(alone[0], fast[-1, : V - 3])
            exact = keys.double() if keys.dim() == 3 else keys.double().expand(T, V, D)
            dots = torch.einsum("thd,tvd->thv", q.double(), exact)
            ref = (dots.clamp_min(0) * scale * w.double()[:, :, None]).sum(1)
            torch.testing.assert_close(fast.double(), ref, atol=1e-5, rtol=1e-5)
