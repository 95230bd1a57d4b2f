"""Make tiny DeepSeek-V4 checkpoints quantized by the real msmodelslim (26.1.0) on CPU: the ModelSlim test fixtures.

Run with the interpreter of the venv that holds msmodelslim (`make modelslim-fixtures` creates it and runs this):

    .venv-modelslim/bin/python scripts/make_modelslim_fixtures.py [OUT]

OUT defaults to `fixture_dir()` (~/.cache/pdspark/modelslim/<hash of this file>), so editing the generator makes new
fixtures. It writes, each a checkpoint directory pdspark loads:
- `float/`: 4 layers (sliding, CSA, HCA, CSA), hidden 64, 8 experts (6 active), DeepSeek's own tensor names (what
  msmodelslim's DSV4 adapter reads), `model.safetensors.index.json`, a word-level tokenizer (`t<i>` -> id i) and a
  calibration jsonl of its words;
- `w8a8_dynamic/`: QuaRot (Hadamard, block 32) then W8A8_DYNAMIC on the attention and FFN linears msmodelslim's
  DSV4 recipe quantizes (its `flex_smooth_quant` step fails on CPU and is left out);
- `w8a8/`: static W8A8 on the attention linears and the shared experts (the static step first: a second
  calibrated step fails on CPU), routed experts W8A8_DYNAMIC (msmodelslim's static expert folds the routing weight
  into its input);
- `w4a8_dynamic/`: routed experts W4A8_DYNAMIC, the other quantized linears W8A8_DYNAMIC.
Sizes that msmodelslim's DSV4 model fixes (it reads only ten config keys): vocab 129280, head_dim 512,
o_lora_rank 1024, window 128, hc_mult 4, 6 active experts, 3 hash layers, 64 index heads x 128.

The generator imports nothing from pdspark (it runs in the other venv); `fixture_dir` is read by the tests through
`--print-dir`, with any Python.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve()
CACHE_ROOT = Path(os.environ.get("PDSPARK_MODELSLIM_CACHE", Path.home() / ".cache" / "pdspark" / "modelslim"))
SCHEMES = ("w8a8_dynamic", "w8a8", "w4a8_dynamic")
DONE = "DONE"

VOCAB = 129280
N_LAYERS = 4
RATIOS = [0, 4, 128, 4]  # sliding, CSA, HCA, CSA
HIDDEN, HEADS, O_GROUPS, Q_LORA, INTER, EXPERTS, TOPK = 64, 2, 2, 64, 32, 8, 6
SEED = 0

# What msmodelslim reads (ten keys) plus what transformers' DeepseekV4Config and pdspark read, each at msmodelslim's
# fixed default. YaRN is off (plain rope): msmodelslim's model copy would apply it to the sliding layer too.
CONFIG = {
    "architectures": ["DeepseekV4ForCausalLM"],
    "model_type": "deepseek_v4",
    "vocab_size": VOCAB,
    "hidden_size": HIDDEN,
    "num_hidden_layers": N_LAYERS,
    "num_attention_heads": HEADS,
    "num_key_value_heads": 1,
    "head_dim": 512,
    "qk_rope_head_dim": 64,
    "q_lora_rank": Q_LORA,
    "o_groups": O_GROUPS,
    "o_lora_rank": 1024,
    "sliding_window": 128,
    "compress_ratios": RATIOS,
    "layer_types": ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
                    "compressed_sparse_attention"],
    "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128},
    "index_n_heads": 64,
    "index_head_dim": 128,
    "index_topk": 16,
    "n_routed_experts": EXPERTS,
    "n_shared_experts": 1,
    "num_experts_per_tok": TOPK,
    "moe_intermediate_size": INTER,
    "mlp_layer_types": ["hash_moe", "hash_moe", "hash_moe", "moe"],
    "num_hash_layers": 3,
    "routed_scaling_factor": 1.5,
    "scoring_func": "sqrtsoftplus",
    "norm_topk_prob": True,
    "swiglu_limit": 10.0,
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-6,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "compress_rope_theta": 160000.0,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "num_nextn_predict_layers": 0,
    "dtype": "bfloat16",
}

_DYNAMIC = {"scope": "per_token", "dtype": "int8", "symmetric": True, "method": "minmax"}
_STATIC = {"scope": "per_tensor", "dtype": "int8", "symmetric": False, "method": "minmax"}
_WEIGHT8 = {"scope": "per_channel", "dtype": "int8", "symmetric": True, "method": "minmax"}
_WEIGHT4 = {"scope": "per_channel", "dtype": "int4", "symmetric": True, "method": "minmax"}
# The attention linears msmodelslim's DSV4 recipe quantizes: wq_a, wq_b, wkv, indexer.wq_b.
_ATTN_FLOAT = ["*wo_a", "*wo_b", "*compressor.wgate", "*compressor.wkv", "*indexer.weights_proj",
               "*indexer.compressor.wgate", "*indexer.compressor.wkv"]


def _step(act: dict, weight: dict, include: list[str], exclude: list[str]) -> dict:
    return {"type": "linear_quant", "qconfig": {"act": act, "weight": weight}, "include": include,
            "exclude": exclude}


def recipes(calib: Path) -> dict[str, dict]:
    def cfg(process: list[dict]) -> dict:
        return {"apiversion": "modelslim_v1", "spec": {
            "process": process, "dataset": str(calib), "runner": "model_wise",
            "save": [{"type": "ascendv1_saver", "part_file_size": 0}]}}

    return {
        "w8a8_dynamic": cfg([
            {"type": "quarot", "block_size": 32},
            _step(_DYNAMIC, _WEIGHT8, ["*attn*"], _ATTN_FLOAT),
            _step(_DYNAMIC, _WEIGHT8, ["*ffn*"], ["*gate"]),
        ]),
        "w8a8": cfg([
            _step(_STATIC, _WEIGHT8, ["*attn*", "*shared_experts*"], _ATTN_FLOAT),
            _step(_DYNAMIC, _WEIGHT8, ["*ffn.experts*"], []),
        ]),
        "w4a8_dynamic": cfg([
            _step(_DYNAMIC, _WEIGHT8, ["*attn*", "*shared_experts*"], _ATTN_FLOAT),
            _step(_DYNAMIC, _WEIGHT4, ["*ffn.experts*"], []),
        ]),
    }


def fixture_dir() -> Path:
    """Where this generator's output lives: keyed by the generator's own bytes."""
    return CACHE_ROOT / hashlib.sha256(HERE.read_bytes()).hexdigest()[:16]


def build_float(out: Path) -> None:
    """Random weights for every tensor of msmodelslim's DSV4 model class (its names and shapes), saved as a
    DeepSeek-named checkpoint."""
    import torch
    from msmodelslim.model.deepseek_v4.model import ModelArgs, Transformer
    from safetensors.torch import save_file

    torch.manual_seed(SEED)
    torch.set_default_dtype(torch.bfloat16)
    args = ModelArgs(dim=HIDDEN, moe_inter_dim=INTER, index_topk=CONFIG["index_topk"], n_routed_experts=EXPERTS,
                     n_heads=HEADS, num_hidden_layers=N_LAYERS, o_groups=O_GROUPS, q_lora_rank=Q_LORA,
                     route_scale=CONFIG["routed_scaling_factor"], compress_ratios=[max(r, 1) for r in RATIOS],
                     original_seq_len=0)
    model = Transformer(args)
    torch.set_default_dtype(torch.float32)
    tensors = {}
    for name, t in model.state_dict().items():
        tensors[name] = _init(name, t).contiguous()
    save_file(tensors, str(out / "model.safetensors"))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": dict.fromkeys(tensors, "model.safetensors")}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    (out / "config.json").write_text(json.dumps(CONFIG, indent=2))


def _init(name: str, t):
    import torch

    if name.endswith("tid2eid"):  # hash routing: 6 distinct experts per token id
        return torch.stack([torch.randperm(EXPERTS)[:TOPK] for _ in range(VOCAB)]).to(t.dtype)
    if name.endswith("gate.bias"):  # small: every routed expert still gets calibration tokens
        return (torch.randn(t.shape) * 0.01).to(t.dtype)
    if name.endswith("norm.weight"):  # not exactly 1: QuaRot must fold them into the next linear
        return (1 + 0.1 * torch.randn(t.shape)).to(t.dtype)
    if name == "embed.weight":
        return torch.randn(t.shape).to(t.dtype)
    if "hc_" in name and name.endswith("_base"):
        return (0.1 * torch.randn(t.shape)).to(t.dtype)
    if "hc_" in name and name.endswith("_scale"):
        return torch.full(t.shape, 0.5).to(t.dtype)
    if name.endswith("attn_sink"):
        return torch.zeros(t.shape, dtype=t.dtype)
    if name.endswith("ape"):
        return (0.02 * torch.randn(t.shape)).to(t.dtype)
    # Linears (and hc_*_fn) at 1/sqrt(fan_in): experts at 0.02 would contribute almost nothing to the output.
    return (torch.randn(t.shape) / math.sqrt(t.shape[-1])).to(t.dtype)


def write_tokenizer(out: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t2"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "t0", "eos_token": "t1", "pad_token": "t2",
        "unk_token": "t2", "model_max_length": 4096}, indent=2))


def write_calibration(out: Path) -> Path:
    import torch

    g = torch.Generator().manual_seed(SEED + 1)
    path = out / "calib.jsonl"
    with path.open("w") as f:
        for _ in range(8):
            words = " ".join(f"t{int(i)}" for i in torch.randint(3, 4096, (48,), generator=g))
            f.write(json.dumps({"inputs_pretokenized": words}) + "\n")
    return path


def quantize(model: Path, cfg: dict, save: Path) -> None:
    """One msmodelslim run (in its own process: msmodelslim changes torch's default dtype)."""
    cfg_file = save.with_suffix(".yaml")
    cfg_file.write_text(json.dumps(cfg, indent=1))  # YAML is a superset of JSON
    cmd = [sys.executable, str(HERE), "--run-msmodelslim", "quant", "--model_path", str(model), "--save_path",
           str(save), "--device", "cpu", "--model_type", "DeepSeek-V4-Flash", "--config_path", str(cfg_file)]
    subprocess.run(cmd, check=True, timeout=900)


def run_msmodelslim(argv: list[str]) -> int:
    """msmodelslim's command line with its DSV4 model's YaRN off (it reads `original_seq_len` from no config key
    and would otherwise rotate the sliding layer with YaRN as well, unlike DeepSeek's reference)."""
    import dataclasses

    import msmodelslim.model.deepseek_v4.model_adapter as adapter
    from msmodelslim.cli.__main__ import main

    @dataclasses.dataclass
    class NoYarnArgs(adapter.ModelArgs):
        original_seq_len: int = 0

    adapter.ModelArgs = NoYarnArgs
    sys.argv = ["msmodelslim", *argv]
    return main() or 0


def make(out: Path) -> None:
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    (tmp / "float").mkdir(parents=True)
    build_float(tmp / "float")
    write_tokenizer(tmp / "float")
    calib = write_calibration(tmp / "float")
    for scheme, cfg in recipes(calib).items():
        quantize(tmp / "float", cfg, tmp / scheme)
        # The saver copies config.json but not the tokenizer.json the engine reads.
        shutil.copy(tmp / "float" / "tokenizer.json", tmp / scheme / "tokenizer.json")
    (tmp / DONE).write_text("ok\n")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--run-msmodelslim":
        sys.exit(run_msmodelslim(sys.argv[2:]))
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out", nargs="?", type=Path, default=None, help="output directory (default: the cache)")
    parser.add_argument("--print-dir", action="store_true", help="print the cache directory and exit")
    args = parser.parse_args()
    out = args.out or fixture_dir()
    if args.print_dir:
        print(out)
        return
    if (out / DONE).is_file():
        print(f"fixtures up to date in {out}")
        return
    make(out)
    print(f"fixtures made in {out}")


if __name__ == "__main__":
    main()
