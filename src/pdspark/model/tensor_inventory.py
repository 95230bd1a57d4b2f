"""`released_tensors`: every tensor DeepSeek-V4's released checkpoint holds for a config, with its shape and dtype
(DeepSeek's reference `model.py` and the released files' headers agree on them), computed from the config alone: what
`pdspark inspect` sizes a model by before (or without) reading any file.

FP8 weights are `F8_E4M3 [out, in]` + a `F8_E8M0` scale per 128x128 tile; routed experts packed MXFP4 (`I8 [out,
in/2]` + `F8_E8M0 [out, in/32]`) when `expert_dtype` is fp4, FP8 blocks with F32 scales when fp8 (Flash-Base), BF16
when bf16; norms, embedding, head, gate, compressor and `weights_proj` weights BF16; mHC, sinks, `ape`, gate bias F32;
`tid2eid` I64. The MTP blocks (`mtp.{i}.`) are SWA-only layers plus `e_proj`/`h_proj` and their norms and head mHC.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from safetensors import safe_open

from pdspark.model.model_config import CSA, HCA, ModelConfig

DTYPE_BYTES = {"F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "I8": 1, "U8": 1, "BOOL": 1, "BF16": 2, "F16": 2,
               "I16": 2, "F32": 4, "I64": 8, "I32": 4, "F64": 8}


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    dtype: str  # safetensors' spelling
    expert: int | None = None  # a routed expert's tensor (expert parallelism splits these)

    @property
    def nbytes(self) -> int:
        n = DTYPE_BYTES[self.dtype]
        for d in self.shape:
            n *= d
        return n


_EXPERT = re.compile(r"(?:^|\.)experts\.(\d+)\.")


def stored_spec(name: str, header: Any) -> TensorSpec:
    """Tensor `name` of a safetensors file as its header describes it (`safe_open(...).get_slice(name)`: no data
    read); a routed expert's tensor knows its expert."""
    m = _EXPERT.search(name)
    return TensorSpec(name, tuple(header.get_shape()), header.get_dtype(), int(m.group(1)) if m else None)


def stored_tensors(files: Iterable[Path]) -> list[TensorSpec]:
    """Every tensor of the safetensors `files`, from their headers alone."""
    out: list[TensorSpec] = []
    for f in files:
        with safe_open(str(f), "pt") as h:
            out += [stored_spec(name, h.get_slice(name)) for name in h.keys()]  # noqa: SIM118 (a safetensors handle)
    return out


def released_tensors(cfg: ModelConfig, expert_dtype: str = "fp4") -> list[TensorSpec]:
    """The released checkpoint's tensors for `cfg` (main layers, then the `num_nextn_predict_layers` MTP blocks)."""
    out: list[TensorSpec] = []
    D, V = cfg.hidden_size, cfg.vocab_size
    out += [TensorSpec("embed.weight", (V, D), "BF16"), TensorSpec("head.weight", (V, D), "BF16"),
            TensorSpec("norm.weight", (D,), "BF16"), *_head_hc("", cfg)]
    for layer, kind in enumerate(cfg.layer_types):
        out += _layer(f"layers.{layer}.", cfg, kind, cfg.hash_layers[layer], expert_dtype)
    for i in range(cfg.num_nextn_predict_layers):
        p = f"mtp.{i}."
        out += _layer(p, cfg, "sliding_attention", False, expert_dtype)
        out += [*_fp8(p + "e_proj", D, D), *_fp8(p + "h_proj", D, D), TensorSpec(p + "enorm.weight", (D,), "BF16"),
                TensorSpec(p + "hnorm.weight", (D,), "BF16"), TensorSpec(p + "norm.weight", (D,), "BF16"),
                *_head_hc(p, cfg)]
    return out


def _head_hc(prefix: str, cfg: ModelConfig) -> list[TensorSpec]:
    hc, D = cfg.hc_mult, cfg.hidden_size
    return [TensorSpec(prefix + "hc_head_fn", (hc, hc * D), "F32"), TensorSpec(prefix + "hc_head_base", (hc,), "F32"),
            TensorSpec(prefix + "hc_head_scale", (1,), "F32")]


def _fp8(name: str, out: int, inputs: int, scale_dtype: str = "F8_E8M0") -> list[TensorSpec]:
    return [TensorSpec(name + ".weight", (out, inputs), "F8_E4M3"),
            TensorSpec(name + ".scale", (-(-out // 128), -(-inputs // 128)), scale_dtype)]


def _expert(name: str, out: int, inputs: int, expert: int, expert_dtype: str) -> list[TensorSpec]:
    if expert_dtype == "fp4":
        return [TensorSpec(name + ".weight", (out, inputs // 2), "I8", expert),
                TensorSpec(name + ".scale", (out, inputs // 32), "F8_E8M0", expert)]
    if expert_dtype == "fp8":
        return [TensorSpec(s.name, s.shape, s.dtype, expert) for s in _fp8(name, out, inputs, "F32")]
    return [TensorSpec(name + ".weight", (out, inputs), "BF16", expert)]


def _layer(p: str, cfg: ModelConfig, kind: str, hashed: bool, expert_dtype: str) -> list[TensorSpec]:
    D, hc, mix = cfg.hidden_size, cfg.hc_mult, cfg.hc_mix_dim
    H, hd, q, I, E = cfg.num_attention_heads, cfg.head_dim, cfg.q_lora_rank, cfg.moe_intermediate_size, \
        cfg.n_routed_experts
    out = [TensorSpec(p + "attn_norm.weight", (D,), "BF16"), TensorSpec(p + "ffn_norm.weight", (D,), "BF16")]
    for part in ("attn", "ffn"):
        out += [TensorSpec(f"{p}hc_{part}_fn", (mix, hc * D), "F32"), TensorSpec(f"{p}hc_{part}_base", (mix,), "F32"),
                TensorSpec(f"{p}hc_{part}_scale", (3,), "F32")]
    a = p + "attn."
    out += [*_fp8(a + "wq_a", q, D), TensorSpec(a + "q_norm.weight", (q,), "BF16"), *_fp8(a + "wq_b", H * hd, q),
            *_fp8(a + "wkv", hd, D), TensorSpec(a + "kv_norm.weight", (hd,), "BF16"),
            *_fp8(a + "wo_a", cfg.o_groups * cfg.o_lora_rank, H * hd // cfg.o_groups),
            *_fp8(a + "wo_b", D, cfg.o_groups * cfg.o_lora_rank), TensorSpec(a + "attn_sink", (H,), "F32")]
    if kind == CSA:  # the compressor (two halves: coff 2) and the lightning indexer with its own compressor
        c, ih = a + "compressor.", cfg.index_head_dim
        out += [TensorSpec(c + "wkv.weight", (2 * hd, D), "BF16"), TensorSpec(c + "wgate.weight", (2 * hd, D), "BF16"),
                TensorSpec(c + "ape", (cfg.csa_ratio, 2 * hd), "F32"), TensorSpec(c + "norm.weight", (hd,), "BF16")]
        i = a + "indexer."
        out += [*_fp8(i + "wq_b", cfg.index_n_heads * ih, q),
                TensorSpec(i + "weights_proj.weight", (cfg.index_n_heads, D), "BF16"),
                TensorSpec(i + "compressor.wkv.weight", (2 * ih, D), "BF16"),
                TensorSpec(i + "compressor.wgate.weight", (2 * ih, D), "BF16"),
                TensorSpec(i + "compressor.ape", (cfg.csa_ratio, 2 * ih), "F32"),
                TensorSpec(i + "compressor.norm.weight", (ih,), "BF16")]
    elif kind == HCA:
        c = a + "compressor."
        out += [TensorSpec(c + "wkv.weight", (hd, D), "BF16"), TensorSpec(c + "wgate.weight", (hd, D), "BF16"),
                TensorSpec(c + "ape", (cfg.hca_ratio, hd), "F32"), TensorSpec(c + "norm.weight", (hd,), "BF16")]
    f = p + "ffn."
    out.append(TensorSpec(f + "gate.weight", (E, D), "BF16"))
    out.append(TensorSpec(f + "gate.tid2eid", (cfg.vocab_size, cfg.num_experts_per_tok), "I64") if hashed
               else TensorSpec(f + "gate.bias", (E,), "F32"))
    for e in range(E):
        for w, (o, n) in (("w1", (I, D)), ("w2", (D, I)), ("w3", (I, D))):
            out += _expert(f"{f}experts.{e}.{w}", o, n, e, expert_dtype)
    out += [*_fp8(f + "shared_experts.w1", I, D), *_fp8(f + "shared_experts.w2", D, I),
            *_fp8(f + "shared_experts.w3", I, D)]
    return out
