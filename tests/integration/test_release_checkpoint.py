"""DeepSeek-V4's released checkpoint format: native names in >= 2 shards with an index, FP8 e4m3 weights in 128x128
tiles and MXFP4 routed experts with ue8m0 scales, `quantization_config` + `expert_dtype` in config.json. A fixture in
exactly that format, written from a float checkpoint with a DSpark draft (`testing/release_checkpoint.py`), loads and
generates the tokens of its dequantized twin (greedy and seeded, DSpark on); what is malformed is a `CheckpointError`
naming the tensor or file, before anything serves."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from conftest import random_prompts
from ep_ranks import generate_job
from helpers import greedy, make_llm, prompt_logits
from pdspark import SamplingParams
from pdspark.errors import CheckpointError
from pdspark.model.compact_experts import CompactExperts
from pdspark.model.fp8_linear import Fp8Linear
from pdspark.model.loader import load_checkpoint, load_draft
from pdspark.model.resident_weights import ResidentWeights, checkpoint_bytes
from pdspark.parallel.expert_shard import ExpertShard
from pdspark.testing.random_release_checkpoint import write_random_release_checkpoint
from pdspark.testing.release_checkpoint import QUANTIZATION_CONFIG, write_release_checkpoint
from pdspark.testing.time_scale import scaled

OPTS = dict(page_size=16, max_model_len=256)


@pytest.fixture(scope="module")
def release(draft_ckpt, tmp_path_factory):
    root = tmp_path_factory.mktemp("release")
    return write_release_checkpoint(draft_ckpt, root / "fixture", root / "twin", shards=3)


def _dtypes(path) -> dict[str, tuple]:
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            for name in h.keys():  # noqa: SIM118 (a safetensors handle)
                t = h.get_slice(name)
                out[name] = (t.get_dtype(), tuple(t.get_shape()), f.name)
    return out


def test_the_fixture_is_in_the_released_format(release):
    tensors = _dtypes(release.path)
    index = json.loads((release.path / "model.safetensors.index.json").read_text())["weight_map"]
    assert index == {n: f for n, (_, _, f) in tensors.items()} and len(set(index.values())) == 3
    assert not any(n.startswith("model.") for n in tensors) and "embed.weight" in tensors and "head.weight" in tensors
    config = json.loads((release.path / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "fp8" and config["expert_dtype"] == "fp4"
    assert any(n.startswith("mtp.") for n in release.fp8 + release.fp4)  # the draft is quantized too
    for name in release.fp8:
        dtype, (out, inputs), _ = tensors[name]
        assert dtype == "F8_E4M3", name
        assert tensors[name.removesuffix("weight") + "scale"][:2] == ("F8_E8M0", (-(-out // 128), -(-inputs // 128)))
    for name in release.fp4:
        dtype, (out, half), _ = tensors[name]
        assert dtype == "I8", name
        assert tensors[name.removesuffix("weight") + "scale"][:2] == ("F8_E8M0", (out, 2 * half // 32))
    assert tensors["layers.0.ffn.gate.tid2eid"][0] == "I64"
    assert tensors["layers.0.attn.attn_sink"][0] == "F32" and tensors["norm.weight"][0] == "BF16"


def test_the_fixture_generates_its_dequantized_twins_tokens(release):
    prompts = random_prompts(3, [9, 40, 77], seed=71)
    params = [SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=24, temperature=0.8, top_k=40, seed=7, ignore_eos=True)]
    got = {}
    for which in (release.path, release.twin):
        with make_llm(which, speculative="dspark", **OPTS) as llm:
            got[which] = [[o.token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=p)]
                          for p in params]
            spec = llm.engine.spec
            assert spec.verify_steps > 0  # DSpark drafted from the quantized draft too
    assert got[release.path] == got[release.twin]


def _broken(release, tmp_path, edit) -> str:
    bad = tmp_path / "bad"
    shutil.copytree(release.path, bad)
    edit(bad)
    return str(bad)


def _edit_tensor(path, name, change):
    index = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    f = path / index[name]
    tensors = load_file(str(f))
    change(tensors)
    save_file(tensors, str(f))


@pytest.mark.parametrize("case, match", [
    ("scale shape", r"tensor 'layers\.1\.attn\.wq_a\.scale' has shape \(2, 1\); its weight's FP8 128x128 tiles "
                    r"need \(1, 1\)"),
    ("expert scale shape", r"'layers\.1\.ffn\.experts\.0\.w1\.scale' has shape .* MXFP4 groups of 32 inputs"),
    ("scale missing", r"tensor 'layers\.1\.attn\.wkv\.weight' is FP8 \(F8_E4M3\) but the checkpoint has no scale"),
    ("expert id", r"tid2eid' holds expert ids in \[9, 9\]; allowed: \[0, 3\]"),
    ("missing shard", r"checkpoint file 'model-00002-of-00003\.safetensors' cannot be read"),
    ("truncated shard", r"checkpoint file 'model-00003-of-00003\.safetensors' cannot be read"),
])
def test_a_malformed_fixture_is_refused_naming_the_tensor_or_file(release, tmp_path, case, match):
    def edit(path):
        if case == "scale shape":
            _edit_tensor(path, "layers.1.attn.wq_a.scale",
                         lambda t: t.update({"layers.1.attn.wq_a.scale": t["layers.1.attn.wq_a.scale"].repeat(2, 1)}))
        elif case == "expert scale shape":
            name = "layers.1.ffn.experts.0.w1.scale"
            _edit_tensor(path, name, lambda t: t.update({name: t[name][:, :1].contiguous()}))
        elif case == "scale missing":
            _edit_tensor(path, "layers.1.attn.wkv.scale", lambda t: t.pop("layers.1.attn.wkv.scale"))
            index_file = path / "model.safetensors.index.json"
            index = json.loads(index_file.read_text())
            del index["weight_map"]["layers.1.attn.wkv.scale"]
            index_file.write_text(json.dumps(index))
        elif case == "expert id":
            name = "layers.0.ffn.gate.tid2eid"
            _edit_tensor(path, name, lambda t: t.update({name: torch.full_like(t[name], 9)}))
        elif case == "missing shard":
            (path / "model-00002-of-00003.safetensors").unlink()
        else:
            f = path / "model-00003-of-00003.safetensors"
            f.write_bytes(f.read_bytes()[:100])

    with pytest.raises(CheckpointError, match=match):
        make_llm(_broken(release, tmp_path, edit), **OPTS)


def test_compact_weights_stay_as_stored_within_five_percent_of_the_checkpoint(release):
    """FP8 projections stay FP8 (`Fp8Linear`), routed experts MXFP4 (`CompactExperts`), BF16 matrices BF16: the
    target's resident bytes are the checkpoint's (its `mtp.*` draft is loaded apart), per dtype."""
    model = load_checkpoint(release.path, 256).model
    fp8 = [n for n in release.fp8 if not n.startswith("mtp.")]
    assert sum(isinstance(m, Fp8Linear) for m in model.modules()) == len(fp8) > 0
    assert sum(isinstance(m, CompactExperts) and m.fmt == "mxfp4" for m in model.modules()) == len(model.layers)
    assert model.embed.dtype is model.head.dtype is model.layers[1].ffn.gate.dtype is torch.bfloat16
    resident = ResidentWeights.of(model)
    stored = checkpoint_bytes(release.path, skip_prefixes=("mtp.",))
    print(f"resident {resident.describe()}; checkpoint {sum(stored.values()) / 2**20:.2f} MiB {stored}")
    assert resident.by_dtype["float8_e4m3fn"] == stored["F8_E4M3"]
    assert resident.by_dtype["uint8"] == stored["I8"] + sum(
        m.w13_scale.nbytes + m.w2_scale.nbytes for m in model.modules()
        if isinstance(m, CompactExperts))  # packed codes + their ue8m0 scales, as stored
    assert resident.total <= 1.05 * sum(stored.values())
    # The DSpark draft (its `mtp.*` tensors) is held the same way.
    ckpt = load_checkpoint(release.path, 256)
    draft = load_draft(ckpt, 256)
    assert sum(isinstance(m, Fp8Linear) for m in draft.modules()) == len(release.fp8) - len(fp8) > 0
    draft_stored = sum(checkpoint_bytes(release.path).values()) - sum(stored.values())
    print(f"draft resident {ResidentWeights.of(draft).describe()}; its checkpoint tensors {draft_stored} B")
    assert ResidentWeights.of(draft).total <= 1.05 * draft_stored


def test_expert_parallel_ranks_hold_the_shared_weights_and_half_the_experts(release):
    whole = load_checkpoint(release.path, 256).model
    experts = sum(b.nbytes for m in whole.modules() if isinstance(m, CompactExperts)
                  for _, b in m.named_buffers(recurse=False) if not _.startswith("_"))
    others = ResidentWeights.of(whole).total - experts
    n = whole.cfg.n_routed_experts
    for rank in (0, 1):
        model = load_checkpoint(release.path, 256, experts=ExpertShard(rank, 2, n)).model
        assert ResidentWeights.of(model).total == others + experts // 2, rank


def test_compact_weights_give_the_logits_and_tokens_of_the_weights_decoded_at_load(release):
    prompts = random_prompts(3, [9, 40, 77], seed=72)
    with make_llm(release.path, **OPTS) as compact, make_llm(release.path, weight_format="float32", **OPTS) as dec:
        assert any(isinstance(m, Fp8Linear) for m in compact.engine.runner.model.modules())
        assert not any(isinstance(m, Fp8Linear) for m in dec.engine.runner.model.modules())
        for ids in prompts:
            a, b = prompt_logits(compact, ids), prompt_logits(dec, ids)
            # The same weights; fp32 sums in other orders (BLAS and the batched expert path against the row-exact
            # kernels): a few 1e-5 apart in logits of magnitude ~1.
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
        assert greedy(compact, prompts, 24) == greedy(dec, prompts, 24)


def test_the_c_decode_step_reads_compact_weights_with_the_bits_of_the_same_step_over_them_decoded(release):
    """The C decode/verify step runs on the released format's weights as stored (FP8 projections, MXFP4 experts and
    the bf16 matrices beside them: no decode/verify step falls back; the FP8 draft's forwards do, counted), and every
    token and logprob equals, bit for bit, those of the
    same engine with the C step built over the dequantized twin's weights (same prefill, same pools): plain decode
    and DSpark verify steps, batches of 1 and 3."""
    twin = load_checkpoint(release.twin, 256).model
    assert twin._decode_step is not None
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
    for speculative in (None, "dspark"):
        # (no prefix cache: a second run of a prompt would compute its last tokens through the C step, the first
        # through the module path)
        with make_llm(release.path, speculative=speculative, enable_prefix_cache=False, **OPTS) as llm:
            model = llm.engine.runner.model
            own = model._decode_step
            assert own is not None, model.decode_step_off
            formats = {f for t in own.tables for fs in t.formats.values() for f in fs}
            assert {"fp8", "mxfp4", "bf16"} <= formats and "f32" not in formats
            got = []
            for step in (own, twin._decode_step):
                model._decode_step = step
                got.append([[(o.token_ids, [lp.logprob for lp in o.logprobs], [lp.top for lp in o.logprobs])
                             for o in llm.generate(prompt_token_ids=prompts, sampling_params=params)]
                            for prompts in (random_prompts(1, [60], seed=73), random_prompts(3, [9, 40, 77], seed=74))])
            model._decode_step = own
            assert got[0] == got[1]
            steps = llm.engine.stats.fast_path_fallback_steps
            assert {r: n for r, n in steps.items() if r != "draft"} == dict.fromkeys(steps.keys() - {"draft"}, 0)
            if speculative:  # the draft's FP8 projections: its forwards on the module path, logged and counted
                assert llm.engine.spec.verify_steps > 0 and steps["draft"] > 0
                assert "FP8 linears" in str(llm.engine.drafter.step_off)


def test_an_expert_parallel_group_serves_the_compact_checkpoint_as_one_process(release):
    """Two ranks, each holding (and reading) half of every layer's MXFP4 experts: one process's greedy and seeded
    tokens and logprobs."""
    prompts = random_prompts(3, [9, 40, 77], seed=73)
    one = generate_job(str(release.path), prompts, {})
    two = generate_job(str(release.path), prompts, {"ep_size": 2})
    assert two["greedy"] == one["greedy"] and two["seeded"] == one["seeded"]


# Loads a checkpoint compact in a fresh process; prints its memory before the load, its peak (VmHWM) and what the
# weights hold (the peak of a process that did nothing else before).
_LOAD_CHILD = """
import json, sys
from pathlib import Path
from pdspark.model.loader import load_checkpoint, load_draft
from pdspark.model.resident_weights import ResidentWeights

def status(key):
    return next(int(x.split()[1]) * 1024 for x in Path("/proc/self/status").read_text().splitlines()
                if x.startswith(key + ":"))

before = status("VmRSS")
model = load_checkpoint(sys.argv[1], 256, draft=False).model
print(json.dumps({"before": before, "peak": status("VmHWM"), "resident": ResidentWeights.of(model).total}))
"""


def test_loading_peaks_under_resident_plus_the_largest_tensor_plus_ten_percent(tmp_path):
    """A random 0.37 GiB checkpoint of the released format (`testing/random_release_checkpoint.py`), loaded compact
    in a fresh process: the resident memory the load adds at its peak is at most the weights' resident bytes plus the
    largest single tensor (in flight while it is copied) plus 10% (the issue's bound; measured: ~1.22x resident
    here, ~1.13x on the 1 GiB checkpoint of `bench/bench_release_weights.py`)."""
    config = dict(
        model_type="deepseek_v4", architectures=["DeepseekV4ForCausalLM"], vocab_size=32768, hidden_size=1024,
        num_hidden_layers=3, num_attention_heads=8, head_dim=512, qk_rope_head_dim=64, q_lora_rank=512, o_groups=2,
        o_lora_rank=512, index_n_heads=8, index_head_dim=128, index_topk=64, n_routed_experts=32,
        num_experts_per_tok=6, moe_intermediate_size=1024, num_hash_layers=1, hc_mult=4, sliding_window=128,
        compress_ratios=[0, 4, 128, 0], num_nextn_predict_layers=1, expert_dtype="fp4", rope_theta=10000,
        max_position_embeddings=4096, eos_token_id=1, quantization_config=dict(QUANTIZATION_CONFIG))
    write_random_release_checkpoint(config, tmp_path / "ckpt")
    out = subprocess.run([sys.executable, "-c", _LOAD_CHILD, str(tmp_path / "ckpt")], check=True,
                         capture_output=True, text=True, timeout=scaled(300))
    got = json.loads(out.stdout.strip().splitlines()[-1])
    largest = 32768 * 1024 * 2  # the bf16 embedding (and head): the largest tensor
    growth = got["peak"] - got["before"]
    print(f"resident {got['resident'] / 2**20:.0f} MiB, load peak growth {growth / 2**20:.0f} MiB")
    assert got["resident"] <= 1.05 * sum(checkpoint_bytes(tmp_path / "ckpt", skip_prefixes=("mtp.",)).values())
    assert growth <= 1.1 * (got["resident"] + largest)
