"""A DSpark draft in a ModelSlim checkpoint (the DSpark rung for a quantized model). msmodelslim cannot quantize MTP
layers on CPU (its `mtp_preprocess` hard-codes 'npu'), so the test adds a random draft, in the checkpoint's DeepSeek
naming `mtp.<k>.*` with its own vocab modules (as NPU DSpark checkpoints ship them), to the msmodelslim-made
W8A8_DYNAMIC + QuaRot fixture: it loads with its own embed/head, greedy DSpark equals the quantized model's plain
greedy (one request and batched), its linears load quantized where the description says so, and the draft entries
the description leaves out (old ModelSlim output) read as FLOAT."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from helpers import GREEDY, assert_no_leaks, greedy, make_llm
from pdspark import SamplingParams
from pdspark.errors import CheckpointError, ConfigError
from pdspark.model.dspark import DSparkDraft
from pdspark.model.dspark_weights import load_draft_weights
from pdspark.model.loader import load_checkpoint, load_draft
from pdspark.model.moe import MoE, SharedExpert
from pdspark.quant.quant_experts import QuantExperts
from pdspark.quant.quant_linear import QuantLinear
from pdspark.testing.random_draft import write_random_draft

DESCRIPTION = "quant_model_description.json"
DRAFT_FILE = "dspark.safetensors"
# The draft linears ModelSlim's DSV4 recipes quantize in a layer (attention's wq_a/wq_b/wkv, shared and routed
# experts), plus the draft's own input projection.
QUANTIZED_DRAFT = re.compile(r"^mtp\.(\d+\.attn\.(wq_a|wq_b|wkv)|\d+\.ffn\.(shared_experts|experts\.\d+)\.w[123]|"
                             r"0\.main_proj)\.weight$")
MAX_TOKENS = 12
GREEDY_PARAMS = SamplingParams(max_tokens=MAX_TOKENS, **GREEDY)


def link_target(src: Path, dst: Path) -> Path:
    """`dst` holds links to the fixture's weights, tokenizer and rotation, and copies of the two files a test
    rewrites (config.json, the description): the shared cache is never written."""
    dst.mkdir(parents=True)
    for f in src.iterdir():
        if f.name in ("config.json", DESCRIPTION):
            (dst / f.name).write_text(f.read_text())
        else:
            (dst / f.name).symlink_to(f)
    return dst


def describe_draft(ckpt: Path, schemes: dict[str, str] | None = None) -> None:
    """List every draft tensor in the description: FLOAT unless `schemes` says otherwise (a real NPU checkpoint
    from msmodelslim lists them all)."""
    desc = json.loads((ckpt / DESCRIPTION).read_text())
    with safe_open(str(ckpt / DRAFT_FILE), "pt") as f:
        for name in f.keys():  # noqa: SIM118 (a safetensors handle)
            desc[name] = (schemes or {}).get(name, "FLOAT")
    (ckpt / DESCRIPTION).write_text(json.dumps(desc))


def quantize_draft(ckpt: Path) -> dict[str, torch.Tensor]:
    """Rewrite the draft's linears as msmodelslim's W8A8_DYNAMIC saver writes them (int8 weight, per-channel
    symmetric `weight_scale [N, 1]`, zero `weight_offset`); returns the dequantized weights they stand for."""
    tensors = load_file(str(ckpt / DRAFT_FILE))
    schemes, dequantized = {}, {}
    for name in [n for n in tensors if QUANTIZED_DRAFT.match(n)]:
        w = tensors.pop(name)  # [N, K]
        scale = w.abs().amax(dim=1, keepdim=True) / 127  # [N, 1]
        q = torch.round(w / scale).clamp(-127, 127).to(torch.int8)
        prefix = name.removesuffix(".weight")
        tensors |= {name: q, f"{prefix}.weight_scale": scale, f"{prefix}.weight_offset": torch.zeros_like(scale)}
        schemes |= {n: "W8A8_DYNAMIC" for n in (name, f"{prefix}.weight_scale", f"{prefix}.weight_offset")}
        dequantized[prefix] = q.float() * scale
    save_file(tensors, ckpt / DRAFT_FILE)
    describe_draft(ckpt, schemes)
    return dequantized


@pytest.fixture(scope="module")
def ckpts(modelslim_dir, tmp_path_factory):
    """The W8A8_DYNAMIC + QuaRot fixture with drafts: `listed` (own vocab modules, every draft tensor FLOAT in the
    description), `unlisted` (the same draft, no draft entries), `quantized` (a routed-MoE draft whose linears are
    W8A8_DYNAMIC, with their dequantized weights), `shared_vocab` (no own vocab modules)."""
    src, root = modelslim_dir / "w8a8_dynamic", tmp_path_factory.mktemp("modelslim_dspark")
    out = {}
    for name in ("listed", "unlisted", "quantized", "shared_vocab"):
        out[name] = link_target(src, root / name)
    out["draft"] = write_random_draft(out["listed"], gamma=3, own_vocab=True, seed=5)
    describe_draft(out["listed"])
    write_random_draft(out["unlisted"], gamma=3, own_vocab=True, seed=5)
    write_random_draft(out["quantized"], gamma=3, own_vocab=True, moe=True, seed=6)
    out["dequantized"] = quantize_draft(out["quantized"])
    write_random_draft(out["shared_vocab"], gamma=3, own_vocab=False, seed=5)
    describe_draft(out["shared_vocab"])
    return out


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(4)
    return [torch.randint(3, 4096, (int(n),), generator=g).tolist() for n in (5, 37, 70, 101)]


@pytest.fixture(scope="module")
def plain(ckpts):
    """The quantized model's plain greedy tokens, one request at a time (the draft beside it is not loaded)."""
    llm = make_llm(ckpts["listed"])
    out = []
    for p in prompts():
        llm.flush_cache()
        out.append(greedy(llm, [p], MAX_TOKENS)[0])
    return out


@pytest.fixture(scope="module")
def oracle(ckpts, plain, tmp_path_factory):
    """The `listed` draft with its Markov head set to propose the plain continuation of the first prompt: the bigram
    `prev -> next` of each of its first `markov_rank` steps gets a logit bias of 100 (a random draft alone is never
    accepted; this one is, so verify steps accept and reject on the quantized target)."""
    path = link_target(ckpts["listed"], tmp_path_factory.mktemp("oracle") / "ckpt")
    (path / DRAFT_FILE).unlink()
    tensors = load_file(str(ckpts["listed"] / DRAFT_FILE))
    w1, w2 = tensors["mtp.markov_head.w1.weight"], tensors["mtp.markov_head.w2.weight"]  # [V, r] each
    w1.zero_()
    w2.zero_()
    chain = [prompts()[0][-1], *plain[0]]
    used: set[int] = set()
    for k, (prev, nxt) in enumerate(zip(chain, chain[1:])):
        if k == w1.shape[1]:
            break
        if prev not in used:  # one continuation per token
            used.add(prev)
            w1[prev, k] = 10.0
            w2[nxt, k] += 10.0
    save_file(tensors, path / DRAFT_FILE)
    return path


@pytest.fixture(scope="module")
def spec_llm(ckpts):
    return make_llm(ckpts["listed"], speculative="dspark")


def test_the_draft_runs_with_its_own_vocab_modules(ckpts, spec_llm):
    llm = spec_llm
    target, draft = llm.engine.runner.model, llm.engine.drafter.draft
    embed, head = draft.vocab
    assert embed is draft.embed and head is draft.head
    with safe_open(str(ckpts["listed"] / DRAFT_FILE), "pt") as f:
        assert torch.equal(embed, f.get_tensor("mtp.embed.weight"))
        assert torch.equal(head, f.get_tensor("mtp.head.weight"))
    assert not torch.allclose(embed, target.embed, atol=1e-3) and not torch.allclose(head, target.head, atol=1e-3)
    for name, p in ckpts["draft"].state_dict().items():  # every tensor from its `mtp.*` name, in its place
        assert torch.equal(draft.state_dict()[name], p), name
    # Every draft tensor is FLOAT: nothing of the draft runs quantized, while the target's linears do.
    assert not any(isinstance(m, QuantLinear | QuantExperts) for m in draft.modules())
    assert any(isinstance(m, QuantLinear) for m in target.modules())


def test_greedy_dspark_equals_plain_greedy_on_the_quantized_model(spec_llm, plain):
    llm = spec_llm
    llm.flush_cache()
    assert greedy(llm, prompts()[1:2], MAX_TOKENS) == plain[1:2]  # one request
    llm.flush_cache()
    outs = llm.generate(prompt_token_ids=prompts(), sampling_params=GREEDY_PARAMS)  # batched
    assert [o.token_ids for o in outs] == plain
    assert all(o.spec_verify_steps > 0 for o in outs)  # every request went through verify steps
    assert_no_leaks(llm)


def test_greedy_dspark_with_accepted_drafts_equals_plain_greedy(oracle, plain):
    llm = make_llm(oracle, speculative="dspark")
    outs = llm.generate(prompt_token_ids=prompts(), sampling_params=GREEDY_PARAMS)
    assert [o.token_ids for o in outs] == plain
    assert outs[0].spec_accepted_tokens >= 6  # the first prompt's drafts were accepted
    assert_no_leaks(llm)


def test_draft_entries_missing_from_the_description_read_as_float(ckpts):
    """Old ModelSlim output has no `mtp.*` entries: the draft loads as FLOAT, the same as with them listed."""
    desc = json.loads((ckpts["unlisted"] / DESCRIPTION).read_text())
    assert not any(k.startswith("mtp.") for k in desc)
    draft = load_draft(load_checkpoint(ckpts["unlisted"], 64), 64)
    for name, p in ckpts["draft"].state_dict().items():
        assert torch.equal(draft.state_dict()[name], p), name
    assert not any(isinstance(m, QuantLinear | QuantExperts) for m in draft.modules())


def test_quantized_draft_linears_load_quantized_and_stay_lossless(ckpts, plain):
    llm = make_llm(ckpts["quantized"], speculative="dspark")
    draft = llm.engine.drafter.draft
    assert isinstance(draft.main_proj, QuantLinear)
    for s, stage in enumerate(draft.draft_stages):
        assert isinstance(stage.ffn, MoE) and isinstance(stage.ffn.experts, QuantExperts)
        assert not hasattr(stage.ffn, "w13")  # the float stacks are replaced, not kept beside
        for proj in ("wq_a", "wq_b", "wkv"):
            q = getattr(stage.attn, proj)
            assert isinstance(q, QuantLinear) and q.scheme == "W8A8_DYNAMIC"
            assert torch.equal(q.dequantized_weight(), ckpts["dequantized"][f"mtp.{s}.attn.{proj}"])
        assert isinstance(stage.ffn.shared, SharedExpert) and isinstance(stage.ffn.shared.w2, QuantLinear)
        w13, w2 = stage.ffn.experts.dequantized()
        for e in range(stage.ffn.n_experts):  # each expert and projection in its place
            w1 = ckpts["dequantized"][f"mtp.{s}.ffn.experts.{e}.w1"]
            assert torch.equal(w13[e, : w1.shape[0]], w1)
            assert torch.equal(w13[e, w1.shape[0] :], ckpts["dequantized"][f"mtp.{s}.ffn.experts.{e}.w3"])
            assert torch.equal(w2[e], ckpts["dequantized"][f"mtp.{s}.ffn.experts.{e}.w2"])
        assert not isinstance(stage.attn.wo_b, QuantLinear)  # FLOAT entries stay float
    outs = llm.generate(prompt_token_ids=prompts(), sampling_params=GREEDY_PARAMS)
    assert [o.token_ids for o in outs] == plain
    assert all(o.spec_verify_steps > 0 for o in outs)


@torch.inference_mode()
def test_quantized_draft_logits_match_its_dequantized_float_twin(ckpts):
    """The quantized draft's logits against the same draft with the dequantized weights in float: close (only the
    per-token int8 activations differ), and not equal (the int8 path ran)."""
    draft = load_draft(load_checkpoint(ckpts["quantized"], 64), 64)
    tensors = load_file(str(ckpts["quantized"] / DRAFT_FILE))
    for prefix, w in ckpts["dequantized"].items():
        del tensors[f"{prefix}.weight_scale"], tensors[f"{prefix}.weight_offset"]
        tensors[f"{prefix}.weight"] = w
    twin = DSparkDraft(draft.cfg, draft.dcfg, 64)
    assert load_draft_weights(twin, tensors) is None  # no description: all float
    twin.prepare_inference()
    g = torch.Generator().manual_seed(0)
    M, W, n_targets = 2, 6, len(draft.dcfg.target_layer_ids)
    features = torch.randn(M * W, draft.cfg.hidden_size * n_targets, generator=g)  # [M*W, D*L]
    positions = torch.arange(W).repeat(M)
    anchors, anchor_pos, valid = torch.tensor([7, 300]), torch.full((M,), W), torch.ones(M, W, dtype=torch.bool)
    logits = []
    for d in (draft, twin):
        ctx = d.context_kv(features, positions).view(d.dcfg.num_stages, M, W, -1)  # [stages, M, W, d]
        logits.append(d.base_logits(d.block_hidden(anchors, anchor_pos, ctx, valid)))  # [M, G, V]
    cosine = torch.nn.functional.cosine_similarity(logits[0], logits[1], dim=-1)
    assert float(cosine.min()) >= 0.99, cosine
    assert not torch.allclose(logits[0], logits[1], atol=1e-5)


def test_a_quarot_target_refuses_a_draft_without_its_own_vocab_modules(ckpts):
    ckpt = load_checkpoint(ckpts["shared_vocab"], 64)
    assert ckpt.quarot
    with pytest.raises(ConfigError, match="QuaRot-rotated: its DSpark draft needs its own embed and head"):
        load_draft(ckpt, 64)
    with pytest.raises(ConfigError, match="uses_own_vocab_modules"):
        make_llm(ckpts["shared_vocab"], speculative="dspark")


def test_bad_draft_entries_name_the_tensor(ckpts, tmp_path):
    # A draft weight listed as quantized where pdspark runs float (the vocab head is FLOAT in every recipe).
    head_quantized = link_target(ckpts["listed"], tmp_path / "head_quantized")
    desc = json.loads((head_quantized / DESCRIPTION).read_text())
    desc["mtp.head.weight"] = "W8A8_DYNAMIC"
    (head_quantized / DESCRIPTION).write_text(json.dumps(desc))
    with pytest.raises(CheckpointError, match=r"mtp\.head\.weight is W8A8_DYNAMIC .* runs it in float only"):
        load_draft(load_checkpoint(head_quantized, 64), 64)
    # An int8 draft weight the description does not list: never cast to float with its scales dropped.
    unlisted = link_target(ckpts["quantized"], tmp_path / "unlisted_int8")
    desc = json.loads((unlisted / DESCRIPTION).read_text())
    (unlisted / DESCRIPTION).write_text(json.dumps({k: v for k, v in desc.items() if not k.startswith("mtp.")}))
    with pytest.raises(CheckpointError, match=r"'mtp\.\d+\.\S+\.weight' is int8 but stands for a float parameter"):
        load_draft(load_checkpoint(unlisted, 64), 64)
