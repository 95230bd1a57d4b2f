"""The MoE's three execution paths (per pair, grouped by expert, dense over all experts) are one function."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pdspark.llm import resolve_model
from pdspark.model.model_config import ModelConfig
from pdspark.model.moe import MoE


@pytest.mark.parametrize("is_hash", [False, True])
def test_routed_paths_agree(is_hash):
    cfg = ModelConfig.from_dir(resolve_model("dsv4-tiny"))  # 8 experts, top-2: every path applies
    torch.manual_seed(0)
    moe = MoE(cfg, is_hash)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.05)
        if is_hash:
            moe.tid2eid.copy_(torch.stack([torch.randperm(cfg.n_routed_experts)[:2] for _ in range(cfg.vocab_size)]))
    moe.fuse()
    assert moe._dense_w13 is not None
    for T in (1, 3, 6, 16):
        x = torch.randn(T, cfg.hidden_size)
        input_ids = torch.randint(0, cfg.vocab_size, (T,))
        with torch.inference_mode():
            ids, weights = moe.route(x, input_ids)
            by_expert = moe._slots_by_expert(x, ids)
            torch.testing.assert_close(moe._slots_by_pair(x, ids), by_expert, atol=1e-6, rtol=1e-5)
            torch.testing.assert_close(moe._slots_dense(x, ids), by_expert, atol=1e-6, rtol=1e-5)
            fast = moe(x, input_ids)  # fused router + whichever path the step size picks
        with torch.enable_grad():
            reference = moe(x, input_ids)  # unfused: separate router and shared expert, grouped experts
        torch.testing.assert_close(fast, reference.detach(), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("scoring", ["sqrtsoftplus", "sigmoid"])
def test_a_tokens_routing_has_the_same_bits_wherever_it_sits_in_the_batch(scoring):
    """The router's scores of a token alone and at any row of a batch are the same bits (`F.softplus` and
    `torch.sigmoid` compute a tensor's last `numel % vector width` elements in scalar code with other bits, so the
    last tokens of a step were scored differently than in a bigger batch: a batch-dependent routing weight)."""
    cfg = dataclasses.replace(ModelConfig.from_dir(resolve_model("dsv4-tiny")), n_routed_experts=7)  # 7: all tail
    torch.manual_seed(12)
    moe = MoE(cfg, is_hash=False)
    moe.scoring_func = scoring
    logits = torch.randn(37, 7) * 6
    ids = torch.zeros(37, dtype=torch.int64)
    batched = moe._route_logits(logits, ids)
    for t in range(37):
        alone = moe._route_logits(logits[t : t + 1], ids[t : t + 1])
        assert torch.equal(alone.weights, batched.weights[t : t + 1]), t
