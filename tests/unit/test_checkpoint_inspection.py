"""`pdspark inspect`: per-rank bytes of DeepSeek-V4-Flash at EP 8 and 16 from its config alone, checked against a
hand computation from the shapes of the reference's tensor table (`dsv4-checkpoint-format.md` §3, written out here
independently of `model/tensor_inventory.py`); the coverage of a real checkpoint's tensors; the KV pack's size."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from pdspark.errors import ConfigError
from pdspark.model.checkpoint_inspection import inspect_model, kv_bytes

# V4-Flash's format-relevant config keys (reference §2).
FLASH = dict(
    model_type="deepseek_v4", architectures=["DeepseekV4ForCausalLM"], vocab_size=129280, hidden_size=4096,
    num_hidden_layers=43, num_attention_heads=64, head_dim=512, qk_rope_head_dim=64, q_lora_rank=1024, o_groups=8,
    o_lora_rank=1024, index_n_heads=64, index_head_dim=128, index_topk=512, n_routed_experts=256,
    num_experts_per_tok=6, moe_intermediate_size=2048, num_hash_layers=3, hc_mult=4, sliding_window=128,
    compress_ratios=[0, 0] + [4 if layer % 2 == 0 else 128 for layer in range(2, 43)] + [0],
    num_nextn_predict_layers=1, expert_dtype="fp4", rope_theta=10000, max_position_embeddings=1048576,
    quantization_config={"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "scale_fmt": "ue8m0",
                         "weight_block_size": [128, 128]})


def _hand_computed_flash() -> tuple[int, int]:
    """(bytes every rank holds, bytes of all routed experts), from the reference's table: FP8 weight = out*in + its
    ue8m0 tiles; a routed expert's packed I8 weight and its ue8m0 scale as the table lists them; BF16 2 bytes, F32 4,
    I64 8."""
    def fp8(out, inputs):
        return out * inputs + (out // 128) * (inputs // 128)

    top = 2 * 129280 * 4096 * 2 + 4096 * 2 + (4 * 16384 + 4 + 1) * 4  # embed, head, norm, hc_head_*

    def block(layer):  # what every layer (and the MTP block, id 43) holds besides its routed experts
        b = 2 * 4096 * 2 + 2 * (24 * 16384 + 24 + 3) * 4  # attn/ffn norms; hc_attn_*, hc_ffn_*
        b += fp8(1024, 4096) + 1024 * 2 + fp8(32768, 1024) + fp8(512, 4096) + 512 * 2  # wq_a q_norm wq_b wkv kv_norm
        b += fp8(8192, 4096) + fp8(4096, 8192) + 64 * 4  # wo_a, wo_b, attn_sink
        b += 256 * 4096 * 2 + (129280 * 6 * 8 if layer < 3 else 256 * 4)  # gate; tid2eid or bias
        b += 2 * fp8(2048, 4096) + fp8(4096, 2048)  # shared experts
        return b

    c4 = 2 * 1024 * 4096 * 2 + 4 * 1024 * 4 + 512 * 2  # compressor wkv, wgate, ape, norm
    c4 += fp8(8192, 1024) + 64 * 4096 * 2 + 2 * 256 * 4096 * 2 + 4 * 256 * 4 + 128 * 2  # the indexer
    c128 = 2 * 512 * 4096 * 2 + 128 * 512 * 4 + 512 * 2
    layers = sum(block(layer) for layer in range(43)) + 21 * c4 + 20 * c128
    mtp = block(43) + 2 * fp8(4096, 4096) + 3 * 4096 * 2 + (4 * 16384 + 4 + 1) * 4
    # w1, w3: I8 [2048, 2048] + scale [2048, 128]; w2: I8 [4096, 1024] + scale [4096, 64] (the table's shapes)
    expert = 2 * (2048 * 2048 + 2048 * 128) + (4096 * 1024 + 4096 * 64)
    return top + layers + mtp, (43 + 1) * 256 * expert  # (the MTP block is a whole layer: its own 256 experts)


@pytest.fixture
def flash_config(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(FLASH))
    return path


def test_v4_flash_bytes_per_rank_at_ep_8_and_16_match_the_hand_computation(flash_config):
    shared, experts = _hand_computed_flash()
    report = inspect_model(config_file=flash_config, ep_sizes=(1, 8, 16))
    for rank in report.ranks:
        assert rank.experts == experts // rank.ep_size
        assert rank.total == shared + experts // rank.ep_size, rank.ep_size
    assert report.ranks[0].by_dtype["I8"] == 44 * 256 * (2 * 2048 * 2048 + 4096 * 1024)  # packed FP4 codes
    # (The figures the README states: a rank holds 25.93 GiB at EP 8, 17.16 GiB at EP 16.)
    assert [round(r.total / 2**30, 2) for r in report.ranks[1:]] == [25.93, 17.16]


def test_the_kv_per_token_of_v4_flash_and_the_fp8_pack(flash_config):
    report = inspect_model(config_file=flash_config, kv_cache_dtype="fp8_e4m3", memory_gib=80, ep_sizes=(8,))
    kv = report.kv  # 21 CSA layers: a 584 B row and a 132 B indexer key per 4 tokens; 20 HCA layers: 584 B per 128
    assert kv.per_token == {"c4_kv": 21 * 584 / 4, "c4_index": 21 * 132 / 4, "c128_kv": 20 * 584 / 128}
    assert kv_bytes(report.cfg, "bfloat16").per_token["c4_kv"] == 21 * 1024 / 4
    tokens = report.tokens_in_budget(report.ranks[0])
    assert tokens == int((80 * 2**30 - report.ranks[0].total) // kv.token)


def test_a_checkpoints_tensors_are_covered_and_a_stray_or_missing_one_is_named(tmp_path):
    from safetensors.torch import load_file, save_file

    from pdspark.assets import resolve_model
    from pdspark.testing.release_checkpoint import write_release_checkpoint

    fixture = write_release_checkpoint(resolve_model("dsv4-tiny"), tmp_path / "fx")
    good = inspect_model(fixture.path, ep_sizes=(2,))
    assert good.coverage is not None and not good.coverage.unknown and not good.coverage.missing
    shard = fixture.path / fixture.shards[0]
    tensors = load_file(str(shard))
    gone = sorted(n for n in tensors if n.endswith("attn.wkv.weight"))[0]
    tensors["layers.0.attn.not_a_tensor"] = tensors.pop(gone)
    save_file(tensors, str(shard))
    bad = inspect_model(fixture.path).coverage
    assert bad is not None and bad.unknown == ["layers.0.attn.not_a_tensor"] and bad.missing == [gone]


def test_the_command_prints_the_figures_and_refuses_bad_input(flash_config):
    out = subprocess.run([sys.executable, "-m", "pdspark.cli", "inspect", "--config", str(flash_config),
                          "--ep-size", "8", "--ep-size", "16", "--memory-gib", "80", "--dp-attention"],
                         capture_output=True, text=True, check=True).stdout
    assert "43 layers (2 sliding, 21 CSA, 20 HCA; 3 hash-routed), 1 MTP block(s)" in out
    assert "the released format, predicted from the config" in out and "ep times this" in out
    with pytest.raises(ConfigError, match="`ep_size` is 3; allowed: a divisor of the model's 256 routed experts"):
        inspect_model(config_file=flash_config, ep_sizes=(3,))
    with pytest.raises(ConfigError, match="`kv_cache_dtype` is 'int4'; allowed"):
        inspect_model(config_file=flash_config, kv_cache_dtype="int4")
