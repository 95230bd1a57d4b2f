"""`write_release_checkpoint`: a float DSV4 checkpoint rewritten in DeepSeek-V4's released format, with its twin.

The released format (docs/operations.md, "DeepSeek-V4's released checkpoints"): DeepSeek's native names (no `model.`
prefix), sharded with `model.safetensors.index.json`; attention projections, the indexer's `wq_b`, the shared
experts and the MTP block's `e_proj`/`h_proj` as FP8 e4m3 in 128x128 tiles with ue8m0 `.scale`s; routed experts as
packed MXFP4 (I8, two codes a byte, low nibble first) with ue8m0 scales per 32 inputs; norms, embedding, head, gate,
compressor and `weights_proj` weights BF16; mHC tensors, `attn_sink`, `ape` and the gate bias F32; `tid2eid` I64;
`config.json` with the FP8 `quantization_config` and a top-level `expert_dtype: "fp4"`.

The twin holds what the quantized checkpoint stands for: every quantized weight decoded to float32, every other
tensor exactly as in the fixture, under the same names, in one file, with no `quantization_config`. A model loaded
from one equals a model loaded from the other.
"""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from pdspark.quant.release_formats import dequant_fp8_blocks, dequant_mxfp4, quant_fp8_blocks, quant_mxfp4

QUANTIZATION_CONFIG = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "scale_fmt": "ue8m0",
                       "weight_block_size": [128, 128]}
_FP8 = re.compile(r"(attn\.(wq_a|wq_b|wkv|wo_a|wo_b)|attn\.indexer\.wq_b|ffn\.shared_experts\.w[123]|e_proj|h_proj)"
                  r"\.weight$")
_FP4 = re.compile(r"ffn\.experts\.\d+\.w[123]\.weight$")
_F32 = re.compile(r"(hc_|attn_sink|\.ape$|gate\.bias$|\.bias$)")
# transformers' spelling -> DeepSeek's (after the `model.` prefix is dropped)
_NATIVE = {"embed_tokens.weight": "embed.weight", "lm_head.weight": "head.weight", "hc_head.hc_fn": "hc_head_fn",
           "hc_head.hc_base": "hc_head_base", "hc_head.hc_scale": "hc_head_scale"}
_KV_NORM = re.compile(r"^(layers\.\d+\.attn)\.norm\.weight$")


@dataclass(frozen=True)
class ReleaseFixture:
    path: Path
    twin: Path | None
    shards: list[str]
    fp8: list[str]  # the weights stored FP8
    fp4: list[str]  # the weights stored MXFP4


def native_name(name: str) -> str:
    name = name.removeprefix("model.")
    if name in _NATIVE:
        return _NATIVE[name]
    return _KV_NORM.sub(r"\1.kv_norm.weight", name)


def write_release_checkpoint(src: str | Path, dst: str | Path, twin: str | Path | None = None,
                             shards: int = 2) -> ReleaseFixture:
    """Rewrite the float checkpoint at `src` in the released format at `dst` (in `shards` files), and its
    dequantized twin at `twin`. Every file of `src` that is no weight (tokenizer, generation config) is copied."""
    src, dst = Path(src), Path(dst)
    tensors = _read(src)
    out: dict[str, torch.Tensor] = {}
    fp8: list[str] = []
    fp4: list[str] = []
    decoded: dict[str, torch.Tensor] = {}  # the twin's
    for name, t in tensors.items():
        native = native_name(name)
        if _FP4.search(native) and t.is_floating_point():
            packed, scale = quant_mxfp4(t)
            out[native], out[_scale_of(native)] = packed, scale
            decoded[native] = dequant_mxfp4(packed, scale)
            fp4.append(native)
        elif _FP8.search(native) and t.is_floating_point():
            q, scale = quant_fp8_blocks(t)
            out[native], out[_scale_of(native)] = q, scale
            decoded[native] = dequant_fp8_blocks(q, scale)
            fp8.append(native)
        elif not t.is_floating_point():
            out[native] = decoded[native] = t.to(torch.int64) if native.endswith("tid2eid") else t
        else:
            kept = t.to(torch.float32 if _F32.search(native) else torch.bfloat16)
            out[native] = decoded[native] = kept
    shard_names = _write_shards(out, dst, shards)
    config = json.loads((src / "config.json").read_text())
    _copy_other_files(src, dst)
    (dst / "config.json").write_text(json.dumps({**config, "quantization_config": QUANTIZATION_CONFIG,
                                                 "expert_dtype": "fp4"}, indent=2))
    twin_path = None
    if twin is not None:
        twin_path = Path(twin)
        twin_path.mkdir(parents=True, exist_ok=True)
        _copy_other_files(src, twin_path)
        (twin_path / "config.json").write_text(json.dumps(config, indent=2))
        save_file({k: v.contiguous() for k, v in decoded.items()}, str(twin_path / "model.safetensors"))
    return ReleaseFixture(dst, twin_path, shard_names, sorted(fp8), sorted(fp4))


def _scale_of(weight: str) -> str:
    return weight.removesuffix(".weight") + ".scale"


def _read(path: Path) -> dict[str, torch.Tensor]:
    index = path / "model.safetensors.index.json"
    files = (sorted({path / f for f in json.loads(index.read_text())["weight_map"].values()}) if index.is_file()
             else sorted(path.glob("*.safetensors")))
    out: dict[str, torch.Tensor] = {}
    for f in files:
        with safe_open(str(f), "pt") as h:
            for name in h.keys():  # noqa: SIM118 (a safetensors handle)
                out[name] = h.get_tensor(name)
    return out


def _write_shards(tensors: dict[str, torch.Tensor], dst: Path, shards: int) -> list[str]:
    """Names in order, cut into `shards` files of about equal tensor counts (a weight and its scale together)."""
    dst.mkdir(parents=True, exist_ok=True)
    names = sorted(n for n in tensors if not n.endswith(".scale"))
    per = -(-len(names) // shards)
    files = [f"model-{k + 1:05d}-of-{shards:05d}.safetensors" for k in range(shards)]
    weight_map: dict[str, str] = {}
    for k, file in enumerate(files):
        part: dict[str, torch.Tensor] = {}
        for name in names[k * per : (k + 1) * per]:
            part[name] = tensors[name].contiguous()
            if (scale := _scale_of(name)) in tensors:
                part[scale] = tensors[scale].contiguous()
        save_file(part, str(dst / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, file))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (dst / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    return files


def _copy_other_files(src: Path, dst: Path) -> None:
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors") and f.name != "model.safetensors.index.json":
            shutil.copy(f, dst / f.name)
