"""The draft forward as one C call (`model.cpu.draft_step.DraftStep`) against the prepared module path: its matmuls sum
in another order than BLAS, so not bit for bit: the greedy picks are equal and the logits within 1e-5 of the
logit scale; in the engine every greedy proposal of dsv4-tiny's shipped draft is the module path's."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_dspark_prepared import random_draft  # (the random dense / MoE drafts of the prepared-path test)

from pdspark import LLM, SamplingParams
from pdspark.assets import resolve_model
from pdspark.hardware.cpu import kernel_abi
from pdspark.hardware.cpu import kernels as cpu_kernels
from pdspark.model.cpu.draft_step import DraftStep

needs_c = pytest.mark.skipif(cpu_kernels.load() is None, reason="C kernels off here: the C path cannot exist")


@needs_c
def test_one_c_call_matches_the_module_path():
    draft = random_draft(moe=False)
    draft.prepare_inference()
    step = DraftStep.build(draft)
    assert step is not None
    g = torch.Generator().manual_seed(2)
    W, d = draft.cfg.sliding_window, draft.cfg.head_dim
    pool = torch.randn(2, 300, d, generator=g)  # [stages, rows, d]: context rows anywhere in the pool
    rng = np.random.default_rng(0)
    for M in (1, 3):
        anchor_pos = np.array([W + 20, 40, 7][:M])  # blocks near the start see invalid context rows
        valid = (anchor_pos[:, None] - W + np.arange(W)) >= 0  # [M, W]
        rows = np.where(valid, rng.integers(0, 299, (M, W)), 299)
        anchors = rng.integers(0, draft.cfg.vocab_size, M)
        with torch.inference_mode():
            want = draft.base_logits(draft.block_hidden(torch.from_numpy(anchors), torch.from_numpy(anchor_pos),
                                                        pool[:, torch.from_numpy(rows)], torch.from_numpy(valid)))
            got = step.try_logits(anchors, anchor_pos, DraftStep.pool_table(pool), rows, valid)
        assert got is not None and got.shape == want.shape == (M, 5, draft.cfg.vocab_size)
        assert torch.equal(got.argmax(-1), want.argmax(-1))
        assert (got - want).abs().max() <= 1e-5 * want.abs().max()
    # Where the C path does not apply: None (no pool table; a block past the rotary table).
    assert step.try_logits(anchors, anchor_pos, None, rows, valid) is None
    assert step.try_logits(anchors, anchor_pos + step.max_len, DraftStep.pool_table(pool), rows, valid) is None


@needs_c
def test_injected_context_rows_match_the_module_path():
    draft = random_draft(moe=False)
    draft.prepare_inference()
    step = DraftStep.build(draft)
    assert step is not None
    g = torch.Generator().manual_seed(3)
    features = torch.randn(7, draft.cfg.hidden_size * 2, generator=g)  # [N, D*L]
    positions = torch.tensor([0, 1, 2, 50, 51, 200, 201])
    slots = torch.tensor([5, 9, 100, 3, 250, 77, 78])
    pool = torch.zeros(2, 300, draft.cfg.head_dim)  # [stages, rows, d]
    with torch.inference_mode():
        want = draft.context_kv(features, positions)  # [stages, N, d]
        assert step.try_inject(features, positions, slots, DraftStep.pool_table(pool)) is True
    got = pool[:, slots]
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()
    pool[:, slots] = 0
    assert not pool.any()  # no other row written
    # Where the C path does not apply it writes nothing and says so with None (the module path's turn).
    assert step.try_inject(features, positions.int(), slots, DraftStep.pool_table(pool)) is None  # int32 positions
    assert step.try_inject(features, positions, slots, DraftStep.pool_table(pool.double())) is None  # no pool table
    assert not pool.any()


def test_drafts_it_does_not_cover_keep_the_module_path(monkeypatch):
    moe = random_draft(moe=True)
    moe.prepare_inference()
    assert DraftStep.build(moe) == "its stages have routed experts (the C draft block runs one shared expert a stage)"
    unprepared = random_draft(moe=False)  # no fused projections, no frozen mixes
    assert DraftStep.build(unprepared) == "its stages are not prepared for inference (`prepare_inference` not run)"
    dense = random_draft(moe=False)
    dense.prepare_inference()
    assert isinstance(DraftStep.build(dense), DraftStep)
    monkeypatch.setattr(cpu_kernels, "load", lambda: None)  # PDSPARK_NO_C_KERNELS=1 or no compiler
    assert str(DraftStep.build(dense)).startswith("no C kernels")


@needs_c
def test_engine_proposals_equal_the_module_paths():
    llm = LLM(resolve_model("dsv4-tiny"), speculative="dspark", max_model_len=128, enable_prefix_cache=False)
    drafter = llm.engine.drafter
    assert drafter is not None and drafter._step is not None  # the shipped draft takes the C path
    inner, pairs = drafter.propose, []

    def both(reqs, num_drafts):
        step, drafter._step = drafter._step, None
        module = inner(reqs, num_drafts)
        drafter._step = step
        fused = inner(reqs, num_drafts)
        pairs.append((fused, module))
        return fused

    drafter.propose = both
    prompt = torch.randint(4, 4096, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    llm.generate(prompt_token_ids=[prompt], sampling_params=SamplingParams(temperature=0, max_tokens=24,
                                                                            ignore_eos=True))
    assert len(pairs) >= 5
    assert all(fused == module for fused, module in pairs)


@needs_c
def test_a_draft_of_bf16_numbers_reads_them_as_bf16_with_the_fp32_tables_bits(monkeypatch):
    """Weights that are bf16 numbers (a checkpoint's are) go into the table as bf16 bits: the proposal logits and
    the injected context rows equal, bit for bit, those of the table over the fp32 copies."""
    draft = random_draft(moe=False)
    with torch.no_grad():
        for p in draft.parameters():
            if p.is_floating_point():
                p.copy_(p.bfloat16().float())
    draft.prepare_inference()
    halves = DraftStep.build(draft)
    with monkeypatch.context() as m:
        m.setattr(cpu_kernels, "bf16_copy", lambda w: None)
        full = DraftStep.build(draft)
    assert halves is not None and full is not None
    flag = kernel_abi.DRAFT_SIZES.index("bf16")
    assert int(halves.table.sizes[flag]) == 1 and int(full.table.sizes[flag]) == 0
    g = torch.Generator().manual_seed(4)
    W = draft.cfg.sliding_window
    pool = torch.randn(2, 300, draft.cfg.head_dim, generator=g)
    anchor_pos = np.array([W + 20, 40, 7])
    valid = (anchor_pos[:, None] - W + np.arange(W)) >= 0
    rows = np.where(valid, np.random.default_rng(1).integers(0, 299, (3, W)), 299)
    anchors = np.array([5, 77, 300])
    features = torch.randn(7, draft.cfg.hidden_size * 2, generator=g)
    positions, slots = torch.tensor([0, 1, 2, 50, 51, 200, 201]), torch.tensor([5, 9, 100, 3, 250, 77, 78])
    with torch.inference_mode():
        a = halves.try_logits(anchors, anchor_pos, DraftStep.pool_table(pool), rows, valid)
        b = full.try_logits(anchors, anchor_pos, DraftStep.pool_table(pool), rows, valid)
        assert a is not None and torch.equal(a, b)
        pools = [torch.zeros(2, 300, draft.cfg.head_dim) for _ in range(2)]
        assert halves.try_inject(features, positions, slots, DraftStep.pool_table(pools[0])) is True
        assert full.try_inject(features, positions, slots, DraftStep.pool_table(pools[1])) is True
    assert torch.equal(pools[0], pools[1]) and pools[0].any()
