"""The draft's prepared inference path (`DSparkDraft.prepare_inference`: fused matmuls, per-block inputs built
once) computes the reference path's block logits and injected context rows bit for bit: the proposals, hence
acceptance, cannot change."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

from pdspark.assets import resolve_model
from pdspark.model.dspark import DraftStage, DSparkDraft
from pdspark.model.dspark_config import DSparkConfig
from pdspark.model.model_config import ModelConfig


def random_draft(moe: bool) -> DSparkDraft:
    cfg = ModelConfig.from_dict(json.loads((Path(resolve_model("dsv4-tiny")) / "config.json").read_text()))
    dcfg = DSparkConfig(num_stages=2, target_layer_ids=(1, 3), gamma=5, mask_token_id=3, markov_rank=8,
                        intermediate_size=64, n_routed_experts=4 if moe else 0, num_experts_per_tok=2 if moe else 0,
                        uses_own_vocab_modules=True)
    draft = DSparkDraft(cfg, dcfg, 256)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in draft.named_parameters():
            p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g) if name.endswith(("norm.weight", "scale"))
                    else 0.1 * torch.randn(p.shape, generator=g))
    return draft.eval().requires_grad_(False)


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_prepared_blocks_equal_the_reference_bit_for_bit(moe, monkeypatch):
    reference = random_draft(moe)
    for stage in reference.draft_stages:  # the reference path on the same C collapse
        stage.attn_hc.freeze()
        stage.ffn_hc.freeze()
    prepared = copy.deepcopy(reference)
    prepared.prepare_inference()
    calls = []
    fast = DraftStage.forward_prepared
    monkeypatch.setattr(DraftStage, "forward_prepared", lambda self, *a: calls.append(1) or fast(self, *a))
    g = torch.Generator().manual_seed(2)
    W, d = reference.cfg.sliding_window, reference.cfg.head_dim
    for M in (1, 3):
        ctx_kv = torch.randn(2, M, W, d, generator=g)  # [stages, M, W, d]
        anchor_pos = torch.tensor([W + 20, 40, 7][:M])  # blocks near the start see invalid context rows
        valid = (anchor_pos[:, None] - W + torch.arange(W)) >= 0  # [M, W]
        anchors = torch.randint(0, reference.cfg.vocab_size, (M,), generator=g)
        with torch.inference_mode():
            want = reference.base_logits(reference.block_hidden(anchors, anchor_pos, ctx_kv, valid))
            got = prepared.base_logits(prepared.block_hidden(anchors, anchor_pos, ctx_kv, valid))
        assert got.shape == (M, 5, reference.cfg.vocab_size)
        assert torch.equal(got, want)
    assert len(calls) == 2 * 2  # the prepared path ran: two stages, two calls


def test_prepared_context_rows_equal_the_reference_bit_for_bit():
    reference = random_draft(moe=False)
    prepared = copy.deepcopy(reference)
    prepared.prepare_inference()
    g = torch.Generator().manual_seed(3)
    features = torch.randn(7, reference.cfg.hidden_size * 2, generator=g)  # [N, D*L]
    positions = torch.tensor([0, 1, 2, 50, 51, 200, 201])
    with torch.inference_mode():
        want = reference.context_kv(features, positions)
        got = prepared.context_kv(features, positions)
    assert got.shape == (2, 7, reference.cfg.head_dim)
    assert torch.equal(got, want)
