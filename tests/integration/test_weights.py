"""Checkpoint loading: transformers' layout and DeepSeek's original naming give the same model."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import MIXED, random_prompts
from helpers import greedy, make_llm
from pdspark.errors import CheckpointError
from pdspark.model.loader import load_checkpoint
from pdspark.model.weights import map_name

RATIO_OF = {"sliding_attention": 0, "compressed_sparse_attention": 4, "heavily_compressed_attention": 16}


def to_deepseek_names(name: str) -> str:
    name = name.removeprefix("model.")
    top = {"embed_tokens.weight": "embed.weight", "hc_head.hc_fn": "hc_head_fn", "hc_head.hc_base": "hc_head_base",
           "hc_head.hc_scale": "hc_head_scale"}
    if name in top:
        return top[name]
    return name.replace(".attn.norm.weight", ".attn.kv_norm.weight")


def write_deepseek_checkpoint(src, dst):
    """The same weights as DeepSeek ships them: original names, two shards with an index, DeepSeek config keys."""
    dst.mkdir()
    tensors = {to_deepseek_names(k): v for k, v in load_file(src / "model.safetensors").items()}
    tensors["mtp.0.e_proj.weight"] = torch.ones(64, 64)
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2 :]}
    weight_map = {}
    for file, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, dst / file)
        weight_map.update({k: file for k in keys})
    (dst / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    cfg = json.loads((src / "config.json").read_text())
    cfg["compress_ratios"] = [RATIO_OF[t] for t in cfg.pop("layer_types")] + [0]  # + the MTP block
    cfg.pop("compress_rates")
    cfg["num_hash_layers"] = cfg.pop("mlp_layer_types").count("hash_moe")
    cfg["qk_rope_head_dim"] = int(cfg["head_dim"] * cfg.pop("partial_rotary_factor"))
    rope = cfg.pop("rope_parameters")["compress"]
    cfg["rope_scaling"] = {k: v for k, v in rope.items() if k not in ("rope_theta", "partial_rotary_factor")}
    cfg["rope_scaling"]["type"] = cfg["rope_scaling"].pop("rope_type")
    (dst / "config.json").write_text(json.dumps(cfg))


def test_deepseek_naming_loads_the_same_model(checkpoints, tmp_path):
    path, _ = checkpoints(MIXED, tokenizer=False)
    write_deepseek_checkpoint(path, tmp_path / "ds")
    ckpt = load_checkpoint(tmp_path / "ds", max_len=256)
    assert set(ckpt.extra) == {"mtp.0.e_proj.weight"}  # kept aside for the speculative decoder
    prompts = random_prompts(2, [40, 70], seed=21)
    assert greedy(make_llm(tmp_path / "ds"), prompts, 16) == greedy(make_llm(path), prompts, 16)


def test_name_map_covers_both_spellings():
    assert map_name("model.layers.2.attn.norm.weight") == map_name("layers.2.attn.kv_norm.weight")
    assert map_name("model.embed_tokens.weight") == map_name("embed.weight")
    assert map_name("model.hc_head.hc_fn") == map_name("hc_head_fn")
    w1, w3 = map_name("layers.1.ffn.experts.3.w1.weight"), map_name("layers.1.ffn.experts.3.w3.weight")
    assert (w1.param, w1.expert, w1.half) == ("layers.1.ffn.w13", 3, 0)
    assert (w3.param, w3.expert, w3.half) == ("layers.1.ffn.w13", 3, 1)
    assert map_name("mtp.0.e_proj.weight") is None


def test_an_expert_id_out_of_range_in_a_hash_table_is_refused_at_load(checkpoints, tmp_path):
    """The C MoE indexes expert weights with tid2eid's ids unchecked; a checkpoint naming expert 4 of 4 (ids
    0..3) is refused before serving, naming the tensor."""
    path, _ = checkpoints(MIXED, tokenizer=False)
    shutil.copytree(path, tmp_path / "bad")
    tensors = load_file(tmp_path / "bad" / "model.safetensors")
    name = next(k for k in tensors if k.endswith("tid2eid"))
    tensors[name][7, 1] = 4
    save_file(tensors, tmp_path / "bad" / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"tid2eid.*\[0, 4\]; allowed: \[0, 3\]"):
        load_checkpoint(tmp_path / "bad", max_len=256)
