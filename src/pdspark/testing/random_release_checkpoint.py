"""`write_random_release_checkpoint`: a checkpoint of any size in DeepSeek-V4's released format with random weights,
straight from a config (every tensor `model.tensor_inventory.released_tensors` predicts), and optionally its BF16 twin
(every FP8/MXFP4 weight decoded, exactly: e4m3 and e2m1 values times power-of-two scales are bf16 numbers).

For benchmarks of loading and decoding at sizes the float-master fixture (`release_checkpoint.py`) cannot reach on a
laptop: the values are random but of a trained model's scale (weights ~1e-2, norms 1), so activations stay finite.
One shard for the top-level tensors, one per layer, one per MTP block, with `model.safetensors.index.json`.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from pdspark.model.model_config import ModelConfig
from pdspark.model.tensor_inventory import TensorSpec, released_tensors
from pdspark.quant.release_formats import dequant_fp8_blocks, dequant_mxfp4

_SCALE_EXPONENT = -8  # every ue8m0 scale 2^-8: e4m3 values of ~N(0, 2) become weights of ~1e-2
_TORCH = {"BF16": torch.bfloat16, "F32": torch.float32, "I64": torch.int64}


def write_random_release_checkpoint(config: dict[str, Any], dst: str | Path, twin: str | Path | None = None,
                                    seed: int = 0, progress: bool = False) -> int:
    """Write `config` (a DSV4 config.json dict with the release `quantization_config` and `expert_dtype`) and random
    weights for it at `dst`, and the BF16 twin at `twin`; returns the checkpoint's tensor bytes."""
    cfg = ModelConfig.from_dict(config)
    specs = released_tensors(cfg, config.get("expert_dtype", "fp4"))
    g = torch.Generator().manual_seed(seed)
    dst = Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    if twin is not None:
        twin = Path(twin)
        twin.mkdir(parents=True, exist_ok=True)
    groups = list(_shards(specs))
    index: dict[str, str] = {}
    twin_index: dict[str, str] = {}
    for i, group in enumerate(groups):
        name = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        tensors = {s.name: _random(s, g, cfg.n_routed_experts) for s in group}
        save_file(tensors, str(dst / name), metadata={"format": "pt"})
        index |= dict.fromkeys(tensors, name)
        if twin is not None:
            decoded = _decoded(tensors)
            save_file(decoded, str(twin / name), metadata={"format": "pt"})
            twin_index |= dict.fromkeys(decoded, name)
        if progress:
            print(f"  shard {i + 1}/{len(groups)} written", flush=True)
    (dst / "config.json").write_text(json.dumps(config, indent=1))
    (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}, indent=1))
    if twin is not None:
        plain = {k: v for k, v in config.items() if k != "quantization_config"} | {"expert_dtype": "bf16"}
        (twin / "config.json").write_text(json.dumps(plain, indent=1))
        (twin / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {}, "weight_map": twin_index}, indent=1))
    return sum(s.nbytes for s in specs)


def _shards(specs: list[TensorSpec]) -> Iterator[list[TensorSpec]]:
    """The top-level tensors, then each layer's, then each MTP block's (the release's one layer a shard)."""
    by_prefix: dict[str, list[TensorSpec]] = {}
    for s in specs:
        parts = s.name.split(".")
        key = ".".join(parts[:2]) if parts[0] in ("layers", "mtp") else ""
        by_prefix.setdefault(key, []).append(s)
    yield from by_prefix.values()


def _random(s: TensorSpec, g: torch.Generator, n_experts: int) -> torch.Tensor:
    if s.dtype == "F8_E4M3":
        return (torch.randn(s.shape, generator=g) * 2).to(torch.float8_e4m3fn)
    if s.dtype == "F8_E8M0":
        return torch.full(s.shape, 127 + _SCALE_EXPONENT, dtype=torch.uint8).view(torch.float8_e8m0fnu)
    if s.dtype == "I8":  # packed e2m1 pairs: any byte is two codes
        return torch.randint(0, 256, s.shape, generator=g, dtype=torch.uint8).view(torch.int8)
    if s.dtype == "I64":  # tid2eid: expert ids
        return torch.randint(0, n_experts, s.shape, generator=g, dtype=torch.int64)
    if s.name.endswith(("_scale", "norm.weight")):  # mHC scales and norms: 1
        return torch.ones(s.shape, dtype=_TORCH[s.dtype])
    if s.name.endswith(("_base", "attn_sink", "ape", "gate.bias")):
        return torch.zeros(s.shape, dtype=_TORCH[s.dtype])
    return (torch.randn(s.shape, generator=g) * 0.02).to(_TORCH[s.dtype])


def _decoded(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every scaled weight decoded to BF16 under its own name, its scale dropped; the rest as they are."""
    out = {}
    for name, t in tensors.items():
        if name.endswith(".scale"):
            continue
        scale = tensors.get(name.removesuffix(".weight") + ".scale")
        if scale is None:
            out[name] = t
        elif t.dtype == torch.float8_e4m3fn:
            out[name] = dequant_fp8_blocks(t, scale).to(torch.bfloat16)
        else:
            out[name] = dequant_mxfp4(t, scale).to(torch.bfloat16)
    return out
