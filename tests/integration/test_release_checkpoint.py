"""DeepSeek-V4's released checkpoint format: native names in >= 2 shards with an index, FP8 e4m3 weights in 128x128
tiles and MXFP4 routed experts with ue8m0 scales, `quantization_config` + `expert_dtype` in config.json. A fixture in
exactly that format, written from a float checkpoint with a DSpark draft (`testing/release_checkpoint.py`), loads and
generates the tokens of its dequantized twin (greedy and seeded, DSpark on); what is malformed is a `CheckpointError`
naming the tensor or file, before anything serves."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from conftest import random_prompts
from helpers import make_llm
from pdspark import SamplingParams
from pdspark.errors import CheckpointError
from pdspark.testing.release_checkpoint import write_release_checkpoint

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
