"""The C kernels compute what the PyTorch reference computes (they are a speed path, not a different model)."""

from __future__ import annotations

import logging
import multiprocessing
import re
import threading
import types
from pathlib import Path

import pytest
import torch

from pdspark.hardware.cpu import kernel_abi, kernels
from pdspark.model.hyper_connection import HyperConnection
from pdspark.quant import release_formats
from pdspark.testing.time_scale import scaled


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


def test_c_decode_attention_reads_the_pools_in_place():
    from pdspark.model.attention import sink_attention

    torch.manual_seed(3)
    T, H, d, W, V = 3, 4, 64, 16, 10
    swa, comp = torch.randn(50, 3, d)[:, 1], torch.randn(30, 2, d)[:, 0]  # per-layer views of page-major pools
    q, sink = torch.randn(T, H, d), torch.randn(H)
    win_rows, comp_rows = torch.randint(0, 50, (T, W)), torch.randint(0, 30, (T, V))
    win_ok, comp_ok = torch.rand(T, W) > 0.3, torch.rand(T, V) > 0.5
    fast = kernels.sink_attend(q, swa, win_rows, win_ok, comp, comp_rows, comp_ok, sink, 0.125)
    ref = sink_attention(q, torch.cat([swa[win_rows], comp[comp_rows]], 1), torch.cat([win_ok, comp_ok], 1), sink,
                         0.125)
    torch.testing.assert_close(fast, ref, atol=2e-6, rtol=1e-5)
    fast = kernels.sink_attend(q, swa, win_rows, win_ok, None, None, None, sink, 0.125)
    torch.testing.assert_close(fast, sink_attention(q, swa[win_rows], win_ok, sink, 0.125), atol=2e-6, rtol=1e-5)


def test_c_decode_moe_matches_the_pair_loop():
    from pdspark.assets import resolve_model
    from pdspark.model.model_config import ModelConfig
    from pdspark.model.moe import MoE

    cfg = ModelConfig.from_dir(resolve_model("dsv4-tiny"))
    torch.manual_seed(4)
    for is_hash, scoring in ((True, "sqrtsoftplus"), (False, "sqrtsoftplus"), (False, "sigmoid")):
        moe = MoE(cfg, is_hash)
        with torch.no_grad():
            for p in moe.parameters():
                p.normal_(0, 0.1)
            if is_hash:
                moe.get_buffer("tid2eid").copy_(torch.randint(0, cfg.n_routed_experts, (cfg.vocab_size, 2)))
        moe.scoring_func = scoring
        x, ids = torch.randn(1, cfg.hidden_size) * 3, torch.tensor([17])
        with torch.inference_mode():
            ref = moe(x, ids)  # unfused: the PyTorch router and pair loop
            moe.fuse()
            fast = moe(x, ids)  # one matmul + one C call
        assert moe.c_decode is not None
        torch.testing.assert_close(fast, ref, atol=1e-5, rtol=1e-5)


def test_c_compressor_matches_the_torch_steps():
    from pdspark.model.batch import CompressPlan
    from pdspark.model.compressor import Compressor
    from pdspark.model.model_config import RopeConfig
    from pdspark.model.rope import RotaryTable

    torch.manual_seed(5)
    rope = RotaryTable(RopeConfig(theta=10000.0), 8, 64)
    for overlap in (True, False):
        comp = Compressor(24, 16, 4, overlap, 1e-6, rope)
        with torch.no_grad():
            comp.ape.normal_()
            comp.norm.weight.uniform_(0.5, 1.5)
        w, span = comp.width, (8 if overlap else 4)
        T, G = 6, 2
        positions = torch.arange(10, 16)
        plan = CompressPlan(
            out_rows=torch.tensor([3, 1]), positions=torch.tensor([8, 12]),
            use_cur=torch.rand(G, span) > 0.5, cur_rows=torch.randint(0, T, (G, span)),
            hist_rows=torch.randint(0, 9, (G, span)), write_tokens=torch.tensor([0, 4, 5]),
            write_rows=torch.tensor([2, 7, 0]))
        state, pool = torch.randn(9, 3, 2 * w)[:, 2], torch.zeros(5, 2, 16)[:, 1]  # page-major pools' layer views
        projected = torch.randn(T, 3 * 2 * w)[:, 2 * w : 4 * w]  # a column slice of a fused projection
        ref_state, ref_pool = state.clone(), pool.clone()
        with torch.enable_grad():
            comp.run(projected.clone(), positions, plan, ref_state, ref_pool)  # PyTorch
        with torch.inference_mode():
            assert comp._run_in_c(projected, positions, plan, state, pool)  # what `run` calls without autograd
        torch.testing.assert_close(pool, ref_pool, atol=1e-5, rtol=1e-5)
        assert torch.equal(state, ref_state)
        assert pool[[0, 2, 4]].abs().sum() == 0  # only the closing groups' rows are written


def test_c_index_pick_is_the_torch_top_k_under_the_tie_rule():
    from pdspark.model.indexer import index_scores, select_topk

    torch.manual_seed(6)
    H, D, T, V, k = 4, 32, 5, 40, 8
    pool = torch.randn(60, 2, D)[:, 1]  # a page-major pool's layer view
    pool[:20] = -pool[:20].abs()  # many keys score exactly 0 after the ReLU: ties the rule must break
    q, w = torch.rand(T, H, D), torch.rand(T, H)
    rows = torch.randint(0, 60, (T, V))
    valid = torch.rand(T, V) > 0.2
    valid[0, k:] = False  # one token with at most k entries: all of its valid ones
    picked = kernels.index_pick(q, w, pool, rows, valid, D**-0.5, k)
    scores = index_scores(q, w, pool[rows].contiguous(), D**-0.5)
    top = select_topk(scores, valid, k)
    assert torch.equal(picked, torch.zeros_like(valid).scatter_(1, top.columns, top.valid))
    assert (scores == 0).sum() > 2 * k  # the ties were there
    # The same mask from the scores alone (a prefill's picks), -inf where no entry is, as `Indexer.scores` fills.
    scores[~valid] = float("-inf")
    assert torch.equal(kernels.topk_mask(scores, valid, k), picked)


@pytest.mark.parametrize("kernel_threads", [1, 2, 4], indirect=True)
def test_c_index_pick_over_many_entries_is_the_torch_top_k_whatever_the_threads(kernel_threads):
    """From 2,048 entries a thread a token's scores are split by entries over the kernel threads: each score is still
    computed whole by one thread, so the picks are the tie rule's over the PyTorch scores, at 1, 2 and 4 threads,
    with an odd count of entries (blocks of 32 and a tail) and ties."""
    from pdspark.model.indexer import index_scores, select_topk

    torch.manual_seed(8)
    H, D, T, V, k = 4, 32, 2, 5003, 64
    pool = -torch.randn(V + 100, 3, D)[:, 2].abs()  # a page-major pool's layer view; keys scoring 0 after the ReLU
    pool[::97] = pool[::97].abs()  # but ~50 entries: the top k reaches into the ties the rule must break
    q, w = torch.rand(T, H, D), torch.rand(T, H)
    rows = torch.stack([torch.randperm(V + 100)[:V] for _ in range(T)])
    valid = torch.rand(T, V) > 0.1
    picked = kernels.index_pick(q, w, pool, rows, valid, D**-0.5, k)
    scores = index_scores(q, w, pool[rows].contiguous(), D**-0.5)
    top = select_topk(scores, valid, k)
    assert torch.equal(picked, torch.zeros_like(valid).scatter_(1, top.columns, top.valid))
    assert picked.sum(1).tolist() == [k, k]
    assert ((scores > 0) & valid).sum(1).max() < k  # the ties were picked from


@pytest.mark.parametrize("kernel_threads", [1, 2, 4], indirect=True)
def test_c_index_pick_of_a_prefill_segment_is_the_per_token_pick_with_its_shared_rows(kernel_threads):
    """A prefill segment's queries share their candidate rows and pick together (`index_pick_shared`: groups of 16
    queries split over the kernel threads, each query's picks compacted to rows in C): each query's rows are
    `index_pick`'s mask with the rows repeated per query, as `picked_rows` compacts it, under a causal visible count
    (fewer than k visible for the first queries), with ties."""
    torch.manual_seed(9)
    H, D, T, V, k = 4, 32, 37, 3001, 48
    pool = -torch.randn(V + 50, 3, D)[:, 1].abs()  # keys scoring 0 after the ReLU: ties ...
    pool[::61] = pool[::61].abs()  # ... and ~50 that do not
    q, w = torch.rand(T, H, D), torch.rand(T, H)
    rows = torch.randperm(V + 50)[:V].contiguous()
    visible = torch.linspace(k // 2, V, T).long()  # causal: each query sees the entries before its position
    valid = torch.arange(V)[None, :] < visible[:, None]
    picked_rows, picked_valid = kernels.index_pick_shared(q, w, pool, rows, valid, D**-0.5, k)
    repeated = rows.expand(T, V).contiguous()
    one_by_one = kernels.index_pick(q, w, pool, repeated, valid, D**-0.5, k)
    assert one_by_one.sum(1).tolist() == visible.clamp(max=k).tolist()
    expected_rows, expected_valid = kernels.picked_rows(repeated, one_by_one, k)
    assert torch.equal(picked_valid, expected_valid)
    assert torch.equal(picked_rows, expected_rows)  # entry order, padding row 0 after


def test_attending_to_the_picked_entries_gives_the_masks_bits():
    """A decode token attends to its `k` picked CSA entries (`picked_entries`: entry order, invalid padding) instead
    of a mask over all visible ones: the C attention gives the very same bits, at any number of visible entries."""
    from pdspark.model.batch import CompressedIndex
    from pdspark.model.indexer import picked_entries

    torch.manual_seed(11)
    T, H, d, W, k = 3, 4, 64, 16, 8
    for V in (9, 40, 400):
        swa, comp = torch.randn(50, d), torch.randn(V + 5, d)
        q, sink = torch.randn(T, H, d), torch.randn(H)
        win_rows, win_ok = torch.randint(0, 50, (T, W)), torch.rand(T, W) > 0.3
        rows = torch.randint(0, V + 5, (T, V))
        picked = torch.zeros(T, V, dtype=torch.bool)
        for t, n in enumerate((k, k, 3)):  # the last token has fewer picks than k: padding
            picked[t, torch.randperm(V)[:n]] = True
        mask = kernels.sink_attend(q, swa, win_rows, win_ok, comp, rows, picked, sink, 0.125)
        few = picked_entries(CompressedIndex(rows, picked, V), picked, k)
        assert few.rows.shape == (T, k) and few.valid.sum(1).tolist() == [k, k, 3]
        assert torch.equal(few.rows[few.valid], rows[picked])  # the picked rows, in entry order
        with pytest.MonkeyPatch.context() as mp:  # the PyTorch compaction: the same rows
            mp.setattr(kernels, "picked_rows", lambda *a: None)
            torch_few = picked_entries(CompressedIndex(rows, picked, V), picked, k)
        assert torch.equal(torch_few.rows[torch_few.valid], few.rows[few.valid])
        assert torch.equal(torch_few.valid, few.valid)
        gathered = kernels.sink_attend(q, swa, win_rows, win_ok, comp, few.rows, few.valid, sink, 0.125)
        assert torch.equal(gathered, mask)


def test_c_attention_projections_match_the_torch_steps():
    from pdspark.model.model_config import RopeConfig
    from pdspark.model.norm import rms_norm
    from pdspark.model.rope import RotaryTable

    torch.manual_seed(7)
    T, H, d, G, L, Dm = 3, 4, 32, 2, 16, 24
    at = RotaryTable(RopeConfig(theta=10000.0), 8, 64).at(torch.tensor([1, 9, 40]))
    w = torch.rand(d) + 0.5
    # Query heads: per-head norm, then rotation -> [T, H, d] (the same bits as the two separate C calls).
    y = torch.randn(T, H * d)
    with torch.inference_mode():
        assert torch.equal(kernels.norm_rope(y, H, None, 1e-6, at.cos, at.sin),
                           at.apply(rms_norm(y.view(T, H, d), None, 1e-6)))
        # The raw latent: weighted norm and rotation of a column slice, written to pool rows.
        wide = torch.randn(T, 3 * d)
        pool, ref_pool = torch.zeros(10, 2, d)[:, 0], torch.zeros(10, d)
        slots = torch.tensor([7, 2, 5])
        kernels.norm_rope(wide[:, d : 2 * d], 1, w, 1e-6, at.cos, at.sin, pool, slots)
        ref_pool[slots] = at.apply(rms_norm(wide[:, d : 2 * d], w, 1e-6))
        assert torch.equal(pool, ref_pool)
        # Output projection: un-rotate, grouped wo_a, wo_b.
        o, wo_a, wo_b = torch.randn(T, H, d), torch.randn(G * L, H * d // G), torch.randn(Dm, G * L)
        fast = kernels.attn_out(o, at.cos, at.sin, wo_a, G, wo_b)
        un = at.apply(o, inverse=True).reshape(T, G, -1)
        ref = torch.einsum("tgc,glc->tgl", un, wo_a.view(G, L, -1)).reshape(T, -1) @ wo_b.t()
    torch.testing.assert_close(fast, ref, atol=1e-4, rtol=1e-5)


def test_c_collapse_applies_the_sublayer_norm_in_the_same_call():
    from pdspark.model.norm import RMSNorm

    torch.manual_seed(8)
    mod, norm = HyperConnection(4, 48, 20, 1e-6, 1e-6), RMSNorm(48, 1e-6)
    with torch.no_grad():
        mod.fn.normal_(0, 0.05)
        norm.weight.uniform_(0.5, 1.5)
    mod.freeze()
    h = torch.randn(2, 4, 48)
    with torch.inference_mode():
        x, post, comb = mod.collapse(h)
        xn, post_n, comb_n = mod.collapse(h, norm)
        assert torch.equal(xn, norm(x)) and torch.equal(post, post_n) and torch.equal(comb, comb_n)


def test_c_lm_head_matches_the_torch_steps():
    from pdspark.model.hyper_connection import HyperHead
    from pdspark.model.norm import RMSNorm

    torch.manual_seed(9)
    head_hc, norm, head = HyperHead(4, 48, 1e-6, 1e-6), RMSNorm(48, 1e-6), torch.randn(100, 48)
    with torch.no_grad():
        head_hc.fn.normal_(0, 0.1)
        head_hc.base.normal_()
        norm.weight.uniform_(0.5, 1.5)
    h = torch.randn(3, 4, 48)
    with torch.inference_mode():
        fast = kernels.lm_head(h, head_hc.fn, head_hc.scale, head_hc.base, 1e-6, 1e-6, norm.weight, 1e-6, head)
        ref = torch.nn.functional.linear(norm(head_hc(h)), head)
    torch.testing.assert_close(fast, ref, atol=2e-5, rtol=1e-5)


@pytest.fixture
def kernel_threads(request):
    """`kernels.set_threads(request.param)` for the test (the GEMMs and the experts shared with the helper thread at
    2), back to 1 after it."""
    kernels.set_threads(request.param)
    yield request.param
    kernels.set_threads(1)


@pytest.mark.parametrize("kernel_threads", [1, 2, 4], indirect=True)
def test_row_shared_moe_and_output_projection_are_the_per_row_bits(kernel_threads):
    """A verify step's rows read each routed expert once for all rows that picked it (`moe_decode_rows`; with 2
    threads the experts split in two ranges, one per thread) and each projection weight once for all rows
    (`attn_out_rows`): the per-row kernels' bits, row for row."""
    from pdspark.assets import resolve_model
    from pdspark.model.model_config import ModelConfig, RopeConfig
    from pdspark.model.rope import RotaryTable

    cfg = ModelConfig.from_dir(resolve_model("dsv4-tiny"))
    torch.manual_seed(5)
    T, D, E, I, k = 6, cfg.hidden_size, cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.num_experts_per_tok
    w13, w2, w2s = torch.randn(E, 2 * I, D) * 0.1, torch.randn(E, D, I) * 0.1, torch.randn(D, I) * 0.1
    x, lgu = torch.randn(T, D), torch.randn(T, E + 2 * I) * 2
    ids = torch.randint(0, cfg.vocab_size, (T,))
    tid2eid = torch.stack([torch.randperm(E)[:k] for _ in range(cfg.vocab_size)])
    bias = torch.randn(E) * 0.1
    for table, b, sqrtsp in ((tid2eid, None, True), (None, bias, True), (None, bias, False)):
        args = (ids, table, b, w13, w2, w2s, k, sqrtsp, 1.5, 10.0)
        per_row = kernels.moe_decode(x, lgu, *args)
        assert per_row is not None
        assert torch.equal(kernels.moe_decode_rows(x, lgu, *args), per_row)
    H, d, G, L = cfg.num_attention_heads, cfg.head_dim, cfg.o_groups, cfg.o_lora_rank
    at = RotaryTable(RopeConfig(theta=10000.0), cfg.rope_dim, 256).at(torch.arange(100, 100 + T))
    o, wo_a, wo_b = torch.randn(T, H, d), torch.randn(G * L, H * d // G), torch.randn(D, G * L)
    per_row = kernels.attn_out(o, at.cos, at.sin, wo_a, G, wo_b)
    assert per_row is not None
    assert torch.equal(kernels.attn_out_rows(o, at.cos, at.sin, wo_a, G, wo_b), per_row)


@pytest.mark.parametrize("kernel_threads", [1, 2, 4], indirect=True)
def test_row_shared_moe_takes_an_expert_repeated_in_a_tokens_slots(kernel_threads):
    """A hash table that names one expert in several slots of a row (transformers initialises tid2eid to zeros, so
    a checkpoint saved without real values routes every slot to expert 0) makes an expert gather up to T*k rows,
    not T. That overflowed the gathered-rows scratch (a SIGSEGV in a batch of two prompts); now every row gets the
    per-row kernel's bits, whatever the table repeats."""
    torch.manual_seed(6)
    T, D, E, I, k = 8, 48, 4, 40, 3
    w13, w2, w2s = torch.randn(E, 2 * I, D) * 0.1, torch.randn(E, D, I) * 0.1, torch.randn(D, I) * 0.1
    x, lgu = torch.randn(T, D), torch.randn(T, E + 2 * I) * 2
    ids = torch.arange(T)
    for table in (torch.zeros(T, k, dtype=torch.int64), torch.randint(0, 2, (T, k))):
        args = (ids, table, None, w13, w2, w2s, k, True, 1.5, 10.0)
        per_row = kernels.moe_decode(x, lgu, *args)
        assert per_row is not None
        assert torch.equal(kernels.moe_decode_rows(x, lgu, *args), per_row)


@pytest.mark.parametrize("rows", [1, 3])
def test_a_bf16_head_gives_the_fp32_heads_bits(rows):
    """Weights that are bf16 numbers read as bf16 bits (half the bytes) give the fp32 kernel's logits bit for bit;
    odd sizes cover the kernels' tails (a vocabulary not a multiple of 4 rows, a width not a multiple of 16)."""
    from pdspark.model.hyper_connection import HyperHead
    from pdspark.model.norm import RMSNorm

    torch.manual_seed(10)
    head_hc, norm = HyperHead(4, 52, 1e-6, 1e-6), RMSNorm(52, 1e-6)
    head = torch.randn(103, 52).bfloat16().float()  # bf16 numbers, held as fp32
    half = kernels.bf16_copy(head)
    assert half is not None and half.dtype is torch.bfloat16
    h = torch.randn(rows, 4, 52)
    with torch.inference_mode():
        args = (h, head_hc.fn, head_hc.scale, head_hc.base, 1e-6, 1e-6, norm.weight, 1e-6, head)
        assert torch.equal(kernels.lm_head(*args, half), kernels.lm_head(*args))


def test_weights_that_are_not_bf16_numbers_get_no_bf16_copy():
    w = torch.randn(8, 16).bfloat16().float()
    assert kernels.bf16_copy(w) is not None
    w[3, 5] += 1e-4  # no longer a bf16 number
    assert kernels.bf16_copy(w) is None
    assert kernels.bf16_copy(torch.zeros(4, dtype=torch.float64)) is None


def test_row_exact_linear_gives_each_row_the_same_bits_whatever_rows_share_the_call():
    """BLAS need not (MKL with AVX-512 does not): a quantized checkpoint's reference path relies on this."""
    torch.manual_seed(11)
    w, x = torch.randn(70, 52), torch.randn(150, 52)
    with torch.inference_mode():
        ref = kernels.linear_rows(x[:1], w)
        assert ref is not None
        for rows in (2, 3, 7, 50, 150):
            assert torch.equal(kernels.linear_rows(x[:rows], w)[:1], ref), rows
        # Every row, wherever it falls (tiles of 8, 4, 3, 2 and 1 input rows; the portable kernel's pairs), as it
        # comes alone; fp32 weights and bf16 ones (widened in the kernel).
        for weights in (w, w.bfloat16()):
            alone = torch.cat([kernels.linear_rows(x[t:t + 1], weights) for t in range(150)])
            for rows in (2, 5, 6, 7, 8, 9, 12, 15, 16, 17, 50, 150):
                assert torch.equal(kernels.linear_rows(x[:rows], weights), alone[:rows]), (weights.dtype, rows)
        torch.testing.assert_close(kernels.linear_rows(x, w), torch.nn.functional.linear(x, w), atol=1e-5,
                                   rtol=1e-5)
        assert kernels.linear_rows(x.double(), w.double()) is None  # not fp32: the caller keeps BLAS


def test_a_weight_row_has_the_same_bits_in_a_block_of_16_rows_and_after_the_last_block():
    """On AVX-512 CPUs whole blocks of 16 weight rows take the tiled kernel, the rows after the last block the
    portable one (as do all rows of a matrix under 16 rows): both are `dot`'s arithmetic, bit for bit."""
    torch.manual_seed(12)
    w, x = torch.randn(40, 200), torch.randn(7, 200)  # two blocks of 16 rows, 8 after; 200 = 12 x 16 + a tail of 8
    with torch.inference_mode():
        for rows in (1, 2, 3, 4, 5, 6, 7):
            whole = kernels.linear_rows(x[:rows], w)
            for lo in (0, 8, 16, 32):  # rows of the first block, its second half, the second block, after the last
                assert torch.equal(whole[:, lo:lo + 8], kernels.linear_rows(x[:rows], w[lo:lo + 8])), (rows, lo)


def _gemm_in_a_child(x: torch.Tensor, w: torch.Tensor, q) -> None:
    with torch.inference_mode():
        q.put(kernels.linear_rows(x, w).tolist())  # plain floats (each float32 exactly): no shared memory


def test_the_helper_threads_change_no_bits_and_a_forked_child_gets_its_own():
    """With n threads a big enough weight GEMM splits its rows into up to n parts that the caller and the helper
    threads claim (the caller takes every part no helper has claimed when it is free): every output keeps the bits it
    has alone, with more threads than cores too (here: 2 cores) and after the count changes. A process forked after
    the helpers exist has none (fork copies only the forking thread): it must make its own, not wait on the
    parent's."""
    torch.manual_seed(12)
    w, x = torch.randn(300, 200), torch.randn(9, 200)  # 540K multiply-adds: up to 16 parts
    with torch.inference_mode():
        try:
            kernels.set_threads(1)
            alone = kernels.linear_rows(x, w)
            for threads in (2, 4, 3, 8, 2):
                kernels.set_threads(threads)
                shared = [kernels.linear_rows(x, w) for _ in range(50)]
                assert all(torch.equal(s, alone) for s in shared), threads
                rows = [kernels.linear_rows(x, w[:n]) for n in (4, 8, 17, 33, 64, 299)]  # parts of 4 and 16 rows
                assert all(torch.equal(r, alone[:, : r.shape[1]]) for r in rows), threads
            ctx = multiprocessing.get_context("fork")
            q = ctx.Queue()
            child = ctx.Process(target=_gemm_in_a_child, args=(x, w, q))
            child.start()
            try:
                assert torch.equal(torch.tensor(q.get(timeout=scaled(60))), alone)
            finally:
                child.join(scaled(10))
                if child.is_alive():
                    child.kill()
            assert child.exitcode == 0
        finally:
            kernels.set_threads(1)


def test_callers_on_several_threads_at_once_keep_their_bits():
    """Two engines of one process may step at once: the C calls release the GIL, so GEMMs from several Python threads
    meet the pool together. One takes it and the others run alone; every output keeps its bits (fp32 and bf16)."""
    torch.manual_seed(14)
    jobs = [(torch.randn(9, 200), torch.randn(300, 200)), (torch.randn(5, 256), torch.randn(500, 256).bfloat16())]
    with torch.inference_mode():
        try:
            kernels.set_threads(1)
            refs = [kernels.linear_rows(x, w) for x, w in jobs]
            kernels.set_threads(4)
            wrong: list[int] = []

            def caller(i: int) -> None:
                x, w = jobs[i % 2]
                with torch.inference_mode():
                    wrong.extend(i for _ in range(300) if not torch.equal(kernels.linear_rows(x, w), refs[i % 2]))

            threads = [threading.Thread(target=caller, args=(i,)) for i in range(3)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(scaled(120))
            assert not any(t.is_alive() for t in threads)
            assert not wrong
        finally:
            kernels.set_threads(1)


def test_the_mhc_collapse_of_a_few_rows_gives_each_row_its_own_bits():
    """A verify step's rows get their mixes from one row-exact GEMM (in pairs, shared with the helper thread at 2
    threads) and their Sinkhorn rounds eight tokens to a vector: every row's collapse has the bits it has alone."""
    torch.manual_seed(13)
    T, hc, D = 11, 4, 128  # 11 x 24 x 512 multiply-adds: enough for the helper; a full vector of 8 tokens, then 3
    M = (2 + hc) * hc
    h, fn = torch.randn(T, hc, D), torch.randn(M, hc * D) * 0.05
    scale, base, norm_w = torch.rand(3), torch.randn(M) * 0.1, torch.rand(D) + 0.5
    with torch.inference_mode():
        for threads in (1, 2):
            try:
                kernels.set_threads(threads)
                rows = kernels.hc_collapse(h, fn, scale, base, 20, 1e-6, 1e-6, (norm_w, 1e-6))
                assert rows is not None
                for t in range(T):
                    alone = kernels.hc_collapse(h[t:t + 1], fn, scale, base, 20, 1e-6, 1e-6, (norm_w, 1e-6))
                    assert alone is not None
                    assert all(torch.equal(a[t:t + 1], b) for a, b in zip(rows, alone)), (threads, t)
            finally:
                kernels.set_threads(1)


def test_the_library_and_python_agree_on_every_slot_count_and_limit():
    """`load()` refuses a library whose `pdspark_abi` differs from the tuples Python fills (a slot added on one side
    only would read the wrong word); this is the check it makes."""
    lib = kernels.load()
    assert lib is not None
    assert kernel_abi.library_abi(lib) == kernel_abi.ABI


class _FakeAbi:
    """A library's `pdspark_abi` that reports `values` (ctypes sets its argtypes and restype)."""

    def __init__(self, values: tuple[int, ...]):
        self.values = values

    def __call__(self, out, n):
        for i, v in enumerate(self.values[:n]):
            out[i] = v
        return len(self.values)


def _abi_with(c_name: str, value: int) -> tuple[int, ...]:
    """`kernel_abi.ABI` with the entry of the C enum or limit `c_name` set to `value`."""
    i = [c for _, c, _ in kernel_abi.ABI_MIRRORS].index(c_name)
    return (*kernel_abi.ABI[:i], value, *kernel_abi.ABI[i + 1:])


_W, _LIMIT = len(kernel_abi.DECODE_WEIGHTS), kernel_abi.INDEX_MAX_TOKENS


@pytest.mark.parametrize("abi, named", [
    (_abi_with("W_COUNT", _W + 1), f"len(DECODE_WEIGHTS) is {_W} in kernel_abi.py but W_COUNT is {_W + 1}"),
    (_abi_with("INDEX_MAX_TOKENS", 32), f"INDEX_MAX_TOKENS is {_LIMIT} in kernel_abi.py but INDEX_MAX_TOKENS is 32"),
    (_abi_with("KIND_CSA", 2), f"DECODE_CSA is {kernel_abi.DECODE_CSA} in kernel_abi.py but KIND_CSA is 2"),
    (kernel_abi.ABI[:-1], "no ROW_BLOCK"),
    ((*kernel_abi.ABI, 7), "1 more than kernel_abi.py mirrors"),
])
def test_a_library_whose_enums_differ_is_refused_naming_the_enum(monkeypatch, caplog, abi, named):
    """A slot added to one side only: `load()` refuses the library (the PyTorch path runs) and its error names the
    Python mirror and the C enum that differ."""
    from pdspark.hardware.cpu.kernel_build import BuiltLibrary

    fake = types.SimpleNamespace(pdspark_abi=_FakeAbi(abi))
    monkeypatch.delenv("PDSPARK_NO_C_KERNELS", raising=False)
    monkeypatch.setattr(kernels, "build_library", lambda source: BuiltLibrary(fake, Path("/nowhere/lib.so")))
    with caplog.at_level(logging.ERROR, logger=kernels.__name__):
        assert kernels.load.__wrapped__() is None
    assert named in caplog.text and "PyTorch path" in caplog.text
    assert kernel_abi.abi_mismatches(abi) and kernel_abi.abi_mismatches(kernel_abi.ABI) == []


def _index_arrays():
    layout = torch.zeros(len(kernel_abi.DECODE_LAYOUT), dtype=torch.int64)
    step = torch.zeros(len(kernel_abi.DECODE_STEP), dtype=torch.int64)
    return layout, step, torch.zeros(len(kernel_abi.DECODE_STEP_SIZES), dtype=torch.int32)


@pytest.mark.parametrize("req, why", [
    ([1, 0, 0, 9, *range(9)], "the step buffers hold 8"),  # more tokens than the buffers behind `step`
    ([2, 0, 0, 1, 5, 0, 2, 7], "not 1 + 3 * 2 chunks"),  # a chunk list longer than the ids that follow
    ([1, 0, 0, -1], "negative chunk length"),
])
def test_decode_index_refuses_requests_its_buffers_cannot_hold(req, why):
    with pytest.raises(kernels.KernelArgumentError, match=re.escape(why)):
        kernels.decode_index(torch.tensor(req, dtype=torch.int64), *_index_arrays(), capacity=8)


def test_decode_index_refuses_index_arrays_of_another_type():
    layout, step, sizes = _index_arrays()
    req = torch.tensor([1, 0, 0, 1, 5], dtype=torch.int32)  # int32 ids: the C code reads 8-byte words
    with pytest.raises(kernels.KernelArgumentError, match="`req` must be a contiguous 1-D torch.int64"):
        kernels.decode_index(req, layout, step, sizes, capacity=8)
    with pytest.raises(kernels.KernelArgumentError, match="`step_sizes`"):
        kernels.decode_index(req.long(), layout, step, sizes.long(), capacity=8)


def test_index_arrays_the_c_loops_would_overrun_are_refused_before_the_call():
    """Rows past the pool, index arrays of another integer type or shape: `KernelArgumentError` naming the kernel
    and the argument, never a read out of bounds."""
    T, H, d, W = 2, 2, 16, 4
    q, swa, sink = torch.randn(T, H, d), torch.randn(10, d), torch.zeros(H)
    valid = torch.ones(T, W, dtype=torch.bool)
    assert kernels.sink_attend(q, swa, torch.zeros(T, W, dtype=torch.int64), valid, None, None, None, sink, 1.0) \
        is not None
    with pytest.raises(kernels.KernelArgumentError, match=r"`win_rows` holds rows \[10, 10\]; the pool has 10"):
        kernels.sink_attend(q, swa, torch.full((T, W), 10), valid, None, None, None, sink, 1.0)
    with pytest.raises(kernels.KernelArgumentError, match="sink_attend: `win_rows` must be torch.int64"):
        kernels.sink_attend(q, swa, torch.zeros(T, W, dtype=torch.int32), valid, None, None, None, sink, 1.0)
    keys = torch.randn(10, d)
    with pytest.raises(kernels.KernelArgumentError, match="index_pick: `rows` must be"):
        kernels.index_pick(q, torch.ones(T, H), keys, torch.zeros(T, 3, dtype=torch.int32),
                           torch.ones(T, 3, dtype=torch.bool), 1.0, 2)


def test_compact_weights_multiply_with_the_bits_of_their_decoded_fp32_weights():
    """FP8 128x128 tiles, MXFP4 groups of 32 and bf16 bits, read as stored: every output is the row-exact GEMM's over
    the dequantized fp32 weight, bit for bit, whatever rows share the call; a slice of an FP8 matrix's rows (a group
    of `wo_a`) takes its own tiles' scales."""
    torch.manual_seed(13)
    x = torch.randn(7, 256)
    q, s = release_formats.quant_fp8_blocks(torch.randn(300, 256))
    packed, ps = release_formats.quant_mxfp4(torch.randn(70, 256))
    e2m1 = release_formats.E2M1.clone()
    e8m0 = release_formats.scale_values(torch.arange(256, dtype=torch.uint8).view(torch.float8_e8m0fnu))
    with torch.inference_mode():
        fp8_ref = kernels.linear_rows(x, release_formats.dequant_fp8_blocks(q, s))
        scale = release_formats.scale_values(s)
        assert torch.equal(kernels.linear_fp8(x, q, scale), fp8_ref)
        assert torch.equal(kernels.linear_fp8(x[2:3], q, scale), fp8_ref[2:3])
        assert torch.equal(kernels.linear_fp8(x, q[130:260].contiguous(), scale, row0=130), fp8_ref[:, 130:260])
        fp4_ref = kernels.linear_rows(x, release_formats.dequant_mxfp4(packed, ps))
        got = kernels.linear_mxfp4(x, packed.view(torch.uint8), ps.view(torch.uint8), e2m1, e8m0)
        assert torch.equal(got, fp4_ref)
        try:  # the rows split in blocks of 16 with the helper threads: each output still computed whole
            for threads in (2, 3, 4):
                kernels.set_threads(threads)
                assert torch.equal(kernels.linear_fp8(x, q, scale), fp8_ref), threads
                assert torch.equal(kernels.linear_fp8(x, q[130:260].contiguous(), scale, row0=130),
                                   fp8_ref[:, 130:260]), threads
                assert torch.equal(kernels.linear_mxfp4(x, packed.view(torch.uint8), ps.view(torch.uint8), e2m1,
                                                        e8m0), fp4_ref), threads
        finally:
            kernels.set_threads(1)
        w = torch.randn(40, 256).bfloat16()
        assert torch.equal(kernels.linear_rows(x, w), kernels.linear_rows(x, w.float()))
        assert kernels.linear_fp8(x.double(), q, scale) is None  # not fp32: the caller decodes with torch
        # Every e4m3 byte but the NaNs (a NaN weight would make every output of its row NaN), decoded as torch does.
        codes = torch.cat([torch.arange(0, 127), torch.arange(128, 255)]).to(torch.uint8).repeat(16, 1)
        weights = codes.contiguous().view(torch.float8_e4m3fn)  # [16, 254]
        assert torch.equal(kernels.linear_fp8(torch.eye(254), weights, torch.ones(1, 2)).t(), weights.float())
        nan_row = torch.zeros(2, 32, dtype=torch.uint8)
        nan_row[1, 3] = 0x7F  # (e4m3's NaN byte: its row's every output NaN, the other row's not)
        out = kernels.linear_fp8(torch.ones(1, 32), nan_row.view(torch.float8_e4m3fn), torch.ones(1, 1))
        assert out[0, 0] == 0.0 and out[0, 1].isnan()
        every_code = torch.arange(256, dtype=torch.uint8).repeat(32, 1)  # [32, 256]: both nibbles of every byte
        got = kernels.linear_mxfp4(torch.eye(512), every_code, torch.full((32, 16), 127, dtype=torch.uint8), e2m1,
                                   e8m0)
        assert torch.equal(got.t(), release_formats.dequant_mxfp4(every_code, torch.full(
            (32, 16), 127, dtype=torch.uint8).view(torch.float8_e8m0fnu)))


@pytest.mark.parametrize("seed", range(6))
def test_c_top_k_mask_is_the_sorts_under_ties_signed_zeros_infinities_and_nans(seed):
    """`topk_mask`'s radix select picks what a stable descending sort of each row's valid entries picks (the tie rule
    of `select_topk`), for any number of entries and k, on scores with long runs of equal values, -0 beside +0,
    infinities and NaNs (ranked first, as the sort ranks them)."""
    g = torch.Generator().manual_seed(seed)
    specials = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan")])
    for V in (1, 7, 130, 2049, 20000):
        T = 3
        base = torch.randn(T, V, generator=g) * 10 ** float(torch.randint(-3, 4, (1,), generator=g))
        coarse = torch.round(base * 2) / 2  # few distinct values: long runs of ties
        scores = torch.where(torch.rand(T, V, generator=g) < 0.5, base, coarse)
        where = torch.rand(T, V, generator=g) < 0.05
        scores[where] = specials[torch.randint(0, 5, (int(where.sum()),), generator=g)]
        scores[0] = scores[0, 0]  # one row of equal scores
        scores[1] = torch.sort(scores[1]).values  # one rising row (NaNs last)
        valid = torch.rand(T, V, generator=g) < 0.9
        for k in sorted({1, 8, 64, 512, max(1, V - 1), V, V + 5}):
            want = torch.zeros_like(valid)
            for t in range(T):
                idx = valid[t].nonzero().flatten()
                order = torch.sort(scores[t, idx], descending=True, stable=True).indices[:k]
                want[t, idx[order]] = True
            got = kernels.topk_mask(scores, valid, k)
            assert got is not None and torch.equal(got, want), (V, k)
