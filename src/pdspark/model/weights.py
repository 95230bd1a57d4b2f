"""Checkpoint loading: one explicit name map from checkpoint tensors to `DSV4Model` parameters.

Two spellings are accepted, both per layer and at the top level:
- DeepSeek's own (`embed.weight`, `layers.3.attn.wq_a.weight`, `layers.3.ffn.experts.7.w1.weight`,
  `layers.3.hc_attn_fn`, `hc_head_fn`, ...);
- what transformers' `DeepseekV4ForCausalLM.save_pretrained` writes: the same per-layer names under `model.`, with
  `model.embed_tokens.weight`, `model.hc_head.hc_fn`, `model.layers.N.attn.norm.weight` (the KV norm) and a bare
  `head.weight`.
Routed experts are stacked into `w13 [E, 2I, D]` (w1 rows then w3 rows) and `w2 [E, D, I]`. `mtp.*` tensors (the
speculative draft) are returned aside, untouched.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from pdspark.errors import CheckpointError
from pdspark.model.dsv4 import DSV4Model

# (checkpoint name, after an optional leading "model.") -> parameter name; "{L}" is the layer index.
_TOP_LEVEL = {
    "embed.weight": "embed",
    "embed_tokens.weight": "embed",
    "head.weight": "head",
    "lm_head.weight": "head",
    "norm.weight": "norm.weight",
    "hc_head_fn": "hc_head.fn",
    "hc_head_base": "hc_head.base",
    "hc_head_scale": "hc_head.scale",
    "hc_head.hc_fn": "hc_head.fn",
    "hc_head.hc_base": "hc_head.base",
    "hc_head.hc_scale": "hc_head.scale",
}
_PER_LAYER = {
    "hc_attn_fn": "attn_hc.fn",
    "hc_attn_base": "attn_hc.base",
    "hc_attn_scale": "attn_hc.scale",
    "hc_ffn_fn": "ffn_hc.fn",
    "hc_ffn_base": "ffn_hc.base",
    "hc_ffn_scale": "ffn_hc.scale",
    "attn_norm.weight": "attn_norm.weight",
    "ffn_norm.weight": "ffn_norm.weight",
    "attn.wq_a.weight": "attn.wq_a",
    "attn.q_norm.weight": "attn.q_norm.weight",
    "attn.wq_b.weight": "attn.wq_b",
    "attn.wkv.weight": "attn.wkv",
    "attn.kv_norm.weight": "attn.kv_norm.weight",
    "attn.norm.weight": "attn.kv_norm.weight",
    "attn.wo_a.weight": "attn.wo_a",
    "attn.wo_b.weight": "attn.wo_b",
    "attn.attn_sink": "attn.attn_sink",
    "attn.compressor.wkv.weight": "attn.compressor.wkv",
    "attn.compressor.wgate.weight": "attn.compressor.wgate",
    "attn.compressor.ape": "attn.compressor.ape",
    "attn.compressor.norm.weight": "attn.compressor.norm.weight",
    "attn.indexer.wq_b.weight": "attn.indexer.wq_b",
    "attn.indexer.weights_proj.weight": "attn.indexer.weights_proj",
    "attn.indexer.compressor.wkv.weight": "attn.indexer.compressor.wkv",
    "attn.indexer.compressor.wgate.weight": "attn.indexer.compressor.wgate",
    "attn.indexer.compressor.ape": "attn.indexer.compressor.ape",
    "attn.indexer.compressor.norm.weight": "attn.indexer.compressor.norm.weight",
    "ffn.gate.weight": "ffn.gate",
    "ffn.gate.bias": "ffn.bias",
    "ffn.gate.tid2eid": "ffn.tid2eid",
    "ffn.shared_experts.w1.weight": "ffn.shared.w1",
    "ffn.shared_experts.w2.weight": "ffn.shared.w2",
    "ffn.shared_experts.w3.weight": "ffn.shared.w3",
}
_LAYER_RE = re.compile(r"^layers\.(\d+)\.(.+)$")
_EXPERT_RE = re.compile(r"^ffn\.experts\.(\d+)\.(w[123])\.weight$")


@dataclass(frozen=True)
class TargetName:
    """Where a checkpoint tensor goes: a parameter, or one expert's slice of a stacked parameter."""

    param: str
    expert: int | None = None
    part: str | None = None  # "w1" | "w2" | "w3"


def map_name(name: str) -> TargetName | None:
    """Map a checkpoint tensor name to its destination; None for names this model does not own (e.g. `mtp.*`)."""
    if name.startswith("model."):
        name = name[len("model.") :]
    if name in _TOP_LEVEL:
        return TargetName(_TOP_LEVEL[name])
    m = _LAYER_RE.match(name)
    if not m:
        return None
    layer, rest = m.group(1), m.group(2)
    if rest in _PER_LAYER:
        return TargetName(f"layers.{layer}.{_PER_LAYER[rest]}")
    e = _EXPERT_RE.match(rest)
    if e:
        part = e.group(2)
        param = "ffn.w2" if part == "w2" else "ffn.w13"
        return TargetName(f"layers.{layer}.{param}", int(e.group(1)), part)
    return None


@dataclass
class LoadReport:
    extra: dict[str, torch.Tensor]  # mtp.* tensors, for the speculative decoder
    num_tensors: int


def checkpoint_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / n for n in names]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no *.safetensors files in {path}")
    return files


def load_weights(model: DSV4Model, path: str | Path, progress: bool = False) -> LoadReport:
    """Copy every tensor of the checkpoint at `path` into `model`; raises `CheckpointError` on any mismatch."""
    path = Path(path)
    params = dict(model.named_parameters())
    params.update(dict(model.named_buffers()))
    filled: set[str] = set()
    experts_seen: dict[str, set[tuple[int, str]]] = {}
    extra: dict[str, torch.Tensor] = {}
    count = 0
    files = checkpoint_files(path)
    names = [(f, n) for f in files for n in _keys(f)]
    bar = _progress(len(names), progress)
    handles = {f: safe_open(str(f), "pt") for f in files}
    with torch.no_grad():
        for f, name in names:
            bar.update(1)
            count += 1
            if name.endswith((".scale", "_scale_inv")):  # FP8/FP4 block scales, not mHC `*_scale` parameters
                raise CheckpointError(f"quantized tensor {name!r}: FP8/FP4 checkpoints are not supported")
            if name.startswith("mtp.") or name.startswith("model.mtp."):
                extra[name.removeprefix("model.")] = handles[f].get_tensor(name)
                continue
            target = map_name(name)
            if target is None or target.param not in params:
                raise CheckpointError(f"unexpected tensor {name!r} in {f.name} (not part of this model's config)")
            tensor = handles[f].get_tensor(name)
            dest = params[target.param]
            if target.expert is None:
                _copy(dest, tensor, name)
                filled.add(target.param)
                continue
            dest_slice = _expert_slice(dest, target)
            _copy(dest_slice, tensor, name)
            experts_seen.setdefault(target.param, set()).add((target.expert, target.part or ""))
    bar.close()
    _check_complete(model, params, filled, experts_seen)
    return LoadReport(extra=extra, num_tensors=count)


def _keys(f: Path) -> list[str]:
    with safe_open(str(f), "pt") as h:
        return list(h.keys())


def _expert_slice(dest: torch.Tensor, target: TargetName) -> torch.Tensor:
    e = target.expert
    if target.part == "w2":
        return dest[e]
    inter = dest.shape[1] // 2
    return dest[e, :inter] if target.part == "w1" else dest[e, inter:]


def _copy(dest: torch.Tensor, src: torch.Tensor, name: str) -> None:
    if tuple(dest.shape) != tuple(src.shape):
        raise CheckpointError(f"tensor {name!r} has shape {tuple(src.shape)}; the config implies {tuple(dest.shape)}")
    dest.copy_(src.to(dest.dtype))


def _check_complete(model: DSV4Model, params: dict, filled: set[str], experts_seen: dict) -> None:
    if "head" not in filled and model.cfg.tie_word_embeddings and "embed" in filled:
        model.head.data.copy_(model.embed.data)
        filled.add("head")
    missing = []
    n_exp = model.cfg.n_routed_experts
    for name in params:
        if name.endswith("ffn.w13") or name.endswith("ffn.w2"):
            parts = ("w1", "w3") if name.endswith("w13") else ("w2",)
            seen = experts_seen.get(name, set())
            for e in range(n_exp):
                missing += [f"{name[:-4]}.experts.{e}.{p}" for p in parts if (e, p) not in seen]
        elif name not in filled and not name.startswith("rope_"):
            missing.append(name)
    if missing:
        shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
        raise CheckpointError(f"checkpoint is missing {len(missing)} tensor(s): {shown}")


class _NoBar:
    def update(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass


def _progress(total: int, enabled: bool):
    if not enabled:
        return _NoBar()
    from tqdm import tqdm

    return tqdm(total=total, desc="loading weights", unit="tensor")
