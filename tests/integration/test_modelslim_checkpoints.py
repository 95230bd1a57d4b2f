"""ModelSlim checkpoints made by the real msmodelslim on CPU (W8A8_DYNAMIC with QuaRot, static W8A8, W4A8_DYNAMIC):
pdspark loads them, runs every quantized linear as its dequantized float reference, stays close to the float model
end to end, and generates the same greedy tokens whatever the batching, chunking or prefix cache."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open

from helpers import GREEDY, greedy, make_llm, prompt_logits
from pdspark import SamplingParams
from pdspark.errors import CheckpointError, ConfigError
from pdspark.model.loader import load_checkpoint, load_draft
from pdspark.model.moe import MoE, swiglu
from pdspark.model.weights import describe, map_name
from pdspark.quant import kernels
from pdspark.quant.quant_experts import QuantExperts
from pdspark.quant.quant_linear import QuantLinear
from quant_reference import assert_fp32_close, experts_reference, linear_reference

SCHEMES = ("w8a8_dynamic", "w8a8", "w4a8_dynamic")
MIN_MEAN_COSINE = {"w8a8_dynamic": 0.99, "w8a8": 0.98}
CLEAR_GAP = 0.06  # float top-1 minus top-2 logit: 8-bit quantization moves flat tiny-model gaps by up to ~0.05


def prompts(n: int = 10, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 4096, (int(length),), generator=g).tolist()
            for length in torch.randint(4, 120, (n,), generator=g)]


@pytest.fixture(scope="module")
def llms(modelslim_dir):
    """The float model and the two 8-bit ones, loaded once (`LLM(path)`: nothing says "quantized")."""
    return {name: make_llm(modelslim_dir / name) for name in ("float", "w8a8_dynamic", "w8a8")}


@pytest.fixture(scope="module")
def float_logits(llms):
    return [prompt_logits(llms["float"], p) for p in prompts()]


def quantized_modules(model):
    return {n: m for n, m in model.named_modules() if isinstance(m, QuantLinear | QuantExperts)}


@pytest.mark.parametrize("scheme", SCHEMES)
def test_every_quantized_linear_equals_its_dequantized_float(modelslim_dir, llms, scheme):
    model = llms[scheme].engine.runner.model if scheme in llms else \
        load_checkpoint(modelslim_dir / scheme, 256).model
    desc = json.loads((modelslim_dir / scheme / "quant_model_description.json").read_text())
    modules = quantized_modules(model)
    # Every linear the description quantizes runs quantized, with its own scheme (experts: one module per layer).
    expected = {describe(map_name(k)).removesuffix(".weight") for k, v in desc.items()  # type: ignore[arg-type]
                if k.endswith(".weight") and v != "FLOAT" and ".experts." not in k}
    assert {n.replace(".ffn.shared.", ".ffn.shared_experts.") for n, m in modules.items()
            if isinstance(m, QuantLinear)} == expected
    for name, m in modules.items():
        ckpt_name = name.replace(".ffn.shared.", ".ffn.shared_experts.")
        if isinstance(m, QuantLinear):
            assert m.scheme == desc[f"{ckpt_name}.weight"], name
            if not m.dynamic:  # DSV4 linears have no bias: quant_bias is the folded zero point alone
                assert torch.equal(m.quant_bias, kernels.fold_zero_point(None, m.weight, m.input_offset,
                                                                          m.deq_scale)), name
    g = torch.Generator().manual_seed(0)
    for name, m in modules.items():
        if isinstance(m, QuantLinear):
            x = torch.randn(3, m.in_features, generator=g) * 2
            assert_fp32_close(m(x), linear_reference(m, x))
        else:
            assert m.scheme == desc[f"{name}.7.w2.weight"]
            x = torch.randn(5, m.w13.shape[2], generator=g)
            ids = torch.stack([torch.randperm(m.n_experts, generator=g)[:6] for _ in range(5)])
            w = torch.rand(5, 6, generator=g)
            act = lambda gate, up: swiglu(gate, up, 10.0)  # noqa: E731
            assert_fp32_close((m(x, ids, act) * w[..., None]).sum(1), experts_reference(m, x, ids, w, act))
    assert sum(isinstance(m, QuantExperts) for m in modules.values()) == 4  # every layer's routed experts


@pytest.mark.parametrize("scheme", ["w8a8", "w4a8_dynamic"])
def test_dequantized_weights_are_the_float_checkpoints(modelslim_dir, llms, scheme):
    """Without QuaRot the dequantized weights are the float ones within a fraction of a quantization step: each
    tensor landed in its place (right layer, expert, w1/w3 half, int4 nibble order; a misplaced one is off by
    about the weight itself, tens of steps at 8 bits, several at 4). Linears are within half a step; msmodelslim
    quantizes routed experts in bf16 (their scales are bf16-rounded), which puts them within 0.75 of a step."""
    model = llms[scheme].engine.runner.model if scheme in llms else \
        load_checkpoint(modelslim_dir / scheme, 256).model
    with safe_open(str(modelslim_dir / "float" / "model.safetensors"), "pt") as f:
        def float_weight(name: str) -> torch.Tensor:
            return f.get_tensor(name).float()

        for name, m in quantized_modules(model).items():
            if isinstance(m, QuantLinear):
                w = float_weight(name.replace(".ffn.shared.", ".ffn.shared_experts.") + ".weight")
                step = (m.dequantized_weight() / m.weight.float().clamp(min=1)).abs().amax(dim=1, keepdim=True)
                assert ((m.dequantized_weight() - w).abs() <= 0.51 * step + 1e-6).all(), name
            else:
                w13, w2 = m.dequantized()
                layer = name.removesuffix(".ffn.experts")
                for e in range(m.n_experts):
                    w1, w3 = float_weight(f"{layer}.ffn.experts.{e}.w1.weight"), \
                        float_weight(f"{layer}.ffn.experts.{e}.w3.weight")
                    for got, want, scale in ((w13[e], torch.cat([w1, w3]), m.w13_scale[e]),
                                             (w2[e], float_weight(f"{layer}.ffn.experts.{e}.w2.weight"),
                                              m.w2_scale[e])):
                        assert ((got - want).abs() <= 0.8 * scale[:, None] + 1e-6).all(), (name, e)


def test_quarot_checkpoint_runs_with_its_own_rotated_embed_and_head(modelslim_dir, llms):
    model = llms["w8a8_dynamic"].engine.runner.model
    with safe_open(str(modelslim_dir / "w8a8_dynamic" / "quant_model_weights.safetensors"), "pt") as f:
        assert torch.equal(model.embed, f.get_tensor("embed.weight").float())
        assert torch.equal(model.head, f.get_tensor("head.weight").float())
    assert not torch.allclose(model.embed, llms["float"].engine.runner.model.embed, atol=1e-3)  # rotated


@pytest.mark.parametrize("scheme", ["w8a8_dynamic", "w8a8"])
def test_logits_close_to_the_float_model(llms, float_logits, scheme):
    cosines, clear, same = [], 0, 0
    for p, ref in zip(prompts(), float_logits):
        ours = prompt_logits(llms[scheme], p)
        cosines.append(F.cosine_similarity(ours, ref, dim=-1))
        top2 = ref[-1].topk(2).values
        if top2[0] - top2[1] >= CLEAR_GAP:
            clear += 1
            same += int(ours[-1].argmax() == ref[-1].argmax())
    mean = float(torch.cat(cosines).mean())
    assert mean >= MIN_MEAN_COSINE[scheme], mean
    assert clear >= 4 and same == clear, (clear, same)


def test_greedy_through_the_ladder_equals_one_shot(modelslim_dir, llms):
    """Batched, prefix-cached and chunked runs of the quantized model give its one-shot tokens."""
    llm = llms["w8a8_dynamic"]
    ps = prompts(6, seed=1)
    shared = ps[0][:40] + [7, 8, 9]  # shares 2.5 pages with ps[0]: a prefix-cache hit after it ran
    ps.append(shared)
    one_shot = []
    for p in ps:
        llm.flush_cache()
        one_shot.append(greedy(llm, [p], 8)[0])
    llm.flush_cache()
    assert greedy(llm, ps, 8) == one_shot  # batched, cold cache
    assert greedy(llm, ps, 8) == one_shot  # batched, every prompt's pages cached
    chunked = make_llm(modelslim_dir / "w8a8_dynamic", max_num_batched_tokens=24, max_num_seqs=4)
    assert greedy(chunked, ps, 8) == one_shot


def test_description_decides_and_bad_checkpoints_name_the_tensor(modelslim_dir, tmp_path):
    src = modelslim_dir / "w4a8_dynamic"
    bad = tmp_path / "mixed_experts"
    shutil.copytree(src, bad)
    desc = json.loads((bad / "quant_model_description.json").read_text())
    assert desc["model_quant_type"] != "W4A8_DYNAMIC"  # unreliable: the per-tensor entries decide
    desc["layers.2.ffn.experts.5.w3.weight"] = "W8A8_DYNAMIC"
    (bad / "quant_model_description.json").write_text(json.dumps(desc))
    with pytest.raises(CheckpointError, match=r"layers\.2\.ffn\.experts\.5\.w3 is W8A8_DYNAMIC but expert 0 is "
                                              "W4A8_DYNAMIC"):
        load_checkpoint(bad, 64)
    with pytest.raises(ConfigError, match="has no quant_model_description.json"):
        load_checkpoint(modelslim_dir / "float", 64, quantization="modelslim")
    with pytest.raises(ConfigError, match=r"allowed: \['auto', 'modelslim', 'none'\]"):
        load_checkpoint(src, 64, quantization="int8")
    # Read as float: an int8 weight is refused, not cast (its scales would fit nowhere anyway).
    with pytest.raises(CheckpointError, match=r"'layers\.\d+\.\S+\.weight' is int8 but stands for a float parameter"):
        load_checkpoint(src, 64, quantization="none")


def test_moe_layers_run_quantized_experts_only(llms):
    for layer in llms["w8a8"].engine.runner.model.layers:
        assert isinstance(layer.ffn, MoE) and isinstance(layer.ffn.experts, QuantExperts)
        assert not hasattr(layer.ffn, "w13")  # the float stacks are gone, not kept beside the int8 ones


def test_disaggregated_greedy_equals_one_shot(modelslim_dir, llms):
    """Prefill and decode workers on the quantized checkpoint (in-process transfer): the cache they hand over
    continues into the offline tokens (both sides hold the same int8 weights: their fingerprints agree)."""
    from test_pd_inprocess import Pair

    ps = prompts(2, seed=2)
    params = SamplingParams(max_tokens=8, **GREEDY)
    pair = Pair(modelslim_dir / "w8a8_dynamic", opts=dict(page_size=16, max_model_len=256, max_num_seqs=4))
    try:
        for i, p in enumerate(ps):
            llms["w8a8_dynamic"].flush_cache()
            offline = greedy(llms["w8a8_dynamic"], [p], 8)[0]
            assert pair.run(p, params, request_id=str(i))["outputs"][-1].token_ids == offline
        assert pair.free_counts_restored()
    finally:
        pair.close()


def test_a_quarot_target_refuses_a_draft_sharing_its_rotated_vocab_modules(modelslim_dir, tmp_path):
    ckpt_dir = tmp_path / "quarot_with_draft"
    shutil.copytree(modelslim_dir / "w8a8_dynamic", ckpt_dir)
    cfg = json.loads((ckpt_dir / "config.json").read_text())
    cfg["dspark"] = {"num_stages": 1, "target_layer_ids": [1, 3], "gamma": 3, "mask_token_id": 2,
                     "uses_own_vocab_modules": False}
    (ckpt_dir / "config.json").write_text(json.dumps(cfg))
    ckpt = load_checkpoint(ckpt_dir, 64)
    assert ckpt.quarot and not load_checkpoint(modelslim_dir / "w8a8", 64).quarot
    with pytest.raises(ConfigError, match="QuaRot-rotated: its DSpark draft needs its own embed and head"):
        load_draft(ckpt, 64)
