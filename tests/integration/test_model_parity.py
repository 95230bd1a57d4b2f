"""Rung 1 of the equality ladder: pdspark's paged engine against transformers' `DeepseekV4ForCausalLM`."""

from __future__ import annotations

import pytest
import torch

from conftest import HC4, MIXED, SPARSE, TIED, random_prompts
from helpers import assert_no_leaks, greedy, make_llm, prompt_logits
from hf_reference import hf_generate, hf_greedy
from pdspark import SamplingParams
from pdspark.hardware.cpu.kernel_abi import ROW_BLOCK
from pdspark.model import indexer as indexer_module

# Longer than three HCA groups (ratio 16) plus a partial one, and crossing more groups while decoding.
PROMPT_LENGTHS = [53, 70, 100]


@pytest.mark.parametrize("spec", [MIXED, HC4, TIED], ids=["mixed", "hc4", "tied"])
def test_greedy_tokens_match_transformers(checkpoints, spec):
    path, hf = checkpoints(spec)
    llm = make_llm(path)
    prompts = random_prompts(3, PROMPT_LENGTHS, seed=spec.seed)
    ours = greedy(llm, prompts, 40)
    for prompt, tokens in zip(prompts, ours):
        assert tokens == hf_greedy(hf, prompt, 40)
    assert_no_leaks(llm)


@pytest.mark.parametrize("spec", [MIXED, HC4, TIED, SPARSE], ids=["mixed", "hc4", "tied", "sparse"])
def test_prefill_logits_match_transformers(checkpoints, spec):
    path, hf = checkpoints(spec)
    llm = make_llm(path)
    (prompt,) = random_prompts(1, [150], seed=7)
    ours = prompt_logits(llm, prompt)
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0]
    # With a sparse indexer the selection can differ where scores tie (transformers' top-k breaks ties its own
    # way); compare only positions where at most `index_topk` entries are visible there.
    n = len(prompt) if spec.index_topk >= len(prompt) // 4 else 4 * (spec.index_topk + 1) - 1
    torch.testing.assert_close(ours[:n], ref[:n].float(), atol=1e-4, rtol=0)


@pytest.mark.parametrize("spec", [MIXED, HC4], ids=["mixed", "hc4"])
def test_decode_logprobs_match_transformers(checkpoints, spec):
    path, hf = checkpoints(spec)
    llm = make_llm(path)
    (prompt,) = random_prompts(1, [61], seed=3)
    out = llm.generate(
        prompt_token_ids=[prompt],
        sampling_params=SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=3),
    )[0]
    ref = hf_generate(hf, prompt, 24, output_scores=True, return_dict_in_generate=True)
    assert out.token_ids == ref.sequences[0, len(prompt):].tolist()
    for step, lp in enumerate(out.logprobs):
        ref_lp = torch.log_softmax(ref.scores[step][0].float(), dim=-1)
        assert abs(lp.logprob - ref_lp[lp.token_id].item()) < 1e-4
        for token, value in lp.top.items():
            assert abs(value - ref_lp[token].item()) < 1e-4


def reference_selection(scores: torch.Tensor, position: int, ratio: int, topk: int) -> set[int]:
    """The tie rule, written plainly: rank visible entries by score (highest first), then by index (lowest)."""
    visible = (position + 1) // ratio
    ranked = sorted(range(visible), key=lambda g: (-float(scores[g]), g))
    return set(ranked[:topk])


def test_sparse_indexer_selection_matches_reference(checkpoints, monkeypatch):
    path, hf = checkpoints(SPARSE)
    llm = make_llm(path)
    (prompt,) = random_prompts(1, [160], seed=11)

    picked = []  # (scores [T, V], each row's picked entries) per CSA layer, in layer order
    original, original_c = indexer_module.select_topk, indexer_module.cpu_kernels.topk_mask
    original_shared = indexer_module.cpu_kernels.index_pick_shared

    def recording(scores, valid, k):
        top = original(scores, valid, k)
        picked.append((scores, [{int(c) for c, v in zip(cols, ok) if v} for cols, ok in zip(top.columns, top.valid)]))
        return top

    def recording_c(scores, valid, k):  # (the C selection, which a prefill takes when it can)
        mask = original_c(scores, valid, k)
        if mask is not None:
            picked.append((scores, [set(torch.nonzero(row).flatten().tolist()) for row in mask]))
        return mask

    def recording_shared(q, w, keys, rows, valid, scale, k, layout="rows"):  # (a prefill segment's pick in C)
        assert layout in ("rows", "blocked")  # (fp32 pools here: the scores below read the keys as floats)
        out = original_shared(q, w, keys, rows, valid, scale, k, layout=layout)
        if out is not None:  # its scores: the same bits from the one scoring routine (a unit test checks)
            floats = keys[rows] if layout == "rows" else keys[rows // ROW_BLOCK, :, rows % ROW_BLOCK]
            scores = indexer_module.index_scores(q, w, floats[:, : q.shape[-1]].contiguous(), scale)
            entry = {int(r): g for g, r in enumerate(rows)}  # (the picks come as pool rows: each entry's own)
            picked.append((scores, [{entry[int(r)] for r, ok in zip(rs, oks) if ok} for rs, oks in zip(*out)]))
        return out

    monkeypatch.setattr(indexer_module, "select_topk", recording)
    monkeypatch.setattr(indexer_module.cpu_kernels, "topk_mask", recording_c)
    monkeypatch.setattr(indexer_module.cpu_kernels, "index_pick_shared", recording_shared)
    prompt_logits(llm, prompt)

    # transformers' own scores for the first CSA layer, whose input does not depend on any earlier selection.
    hf_scores = []
    first_csa = next(layer for layer in hf.model.layers if hasattr(layer.self_attn.compressor, "indexer"))
    hook = first_csa.self_attn.compressor.indexer.scorer.register_forward_hook(
        lambda m, i, o: hf_scores.append(o[0])
    )
    with torch.no_grad():
        hf(torch.tensor([prompt]))
    hook.remove()
    positions = torch.arange(len(prompt))[:, None]
    visible = torch.arange(hf_scores[0].shape[1])[None, :] < (positions + 1) // SPARSE.csa_ratio
    torch.testing.assert_close(picked[0][0][visible], hf_scores[0][visible], atol=1e-5, rtol=0)

    assert len(picked) == 2
    ties = 0
    for layer, (scores, rows) in enumerate(picked):
        for pos in range(len(prompt)):
            ours = rows[pos]
            assert ours == reference_selection(scores[pos], pos, SPARSE.csa_ratio, SPARSE.index_topk), (layer, pos)
            if layer == 0:
                assert ours == reference_selection(hf_scores[0][pos], pos, SPARSE.csa_ratio, SPARSE.index_topk)
            visible = (pos + 1) // SPARSE.csa_ratio
            ties += int((scores[pos, :visible] == 0).sum() > 1)
    assert ties > 0, "the workload should exercise the tie rule"
