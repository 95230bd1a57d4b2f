"""`ModelConfig`: the DSV4 architecture as read from a checkpoint's `config.json`.

Accepts both spellings that exist in the wild:
- transformers' `DeepseekV4Config` (`layer_types`, `compress_rates`, `mlp_layer_types`, nested `rope_parameters`,
  `partial_rotary_factor`);
- DeepSeek's own (`compress_ratios` with one extra entry for the MTP block, `num_hash_layers`, `qk_rope_head_dim`,
  `rope_scaling`).
Anything the engine cannot run exactly is a `ConfigError` naming the key and the allowed values.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdspark.errors import ConfigError, check_choice

SLIDING = "sliding_attention"
CSA = "compressed_sparse_attention"
HCA = "heavily_compressed_attention"
LAYER_TYPES = (SLIDING, CSA, HCA)
MLP_LAYER_TYPES = ("hash_moe", "moe")
SCORING_FUNCS = ("sqrtsoftplus", "sigmoid")
ROPE_TYPES = ("default", "yarn")


@dataclass(frozen=True)
class RopeConfig:
    """One RoPE table: plain (`default`) or YaRN-scaled, on the trailing `rope_dim` channels."""

    theta: float
    rope_type: str = "default"
    factor: float = 1.0
    original_max_position_embeddings: int = 0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    # Multiplies cos/sin. DSV4 sets 1.0 for YaRN (no mscale on the softmax scale).
    attention_factor: float = 1.0

    def __post_init__(self) -> None:
        check_choice("rope_parameters.rope_type", self.rope_type, ROPE_TYPES)
        if self.rope_type == "yarn" and self.original_max_position_embeddings <= 0:
            raise ConfigError("yarn rope needs `original_max_position_embeddings` > 0")


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    head_dim: int
    rope_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    sliding_window: int
    layer_types: tuple[str, ...]
    csa_ratio: int
    hca_ratio: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    n_routed_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    hash_layers: tuple[bool, ...]
    scoring_func: str
    routed_scaling_factor: float
    swiglu_limit: float
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    rms_norm_eps: float
    main_rope: RopeConfig
    compress_rope: RopeConfig
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    num_nextn_predict_layers: int = 0
    # The raw dict, kept so a fingerprint and `save` can reproduce it.
    raw: dict = dataclasses.field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        if len(self.layer_types) != self.num_hidden_layers:
            raise ConfigError(
                f"`layer_types` has {len(self.layer_types)} entries; `num_hidden_layers` is {self.num_hidden_layers}"
            )
        for t in self.layer_types:
            check_choice("layer_types[]", t, LAYER_TYPES)
        if len(self.hash_layers) != self.num_hidden_layers:
            raise ConfigError("`mlp_layer_types` must have one entry per layer")
        check_choice("scoring_func", self.scoring_func, SCORING_FUNCS)
        if self.num_attention_heads % self.o_groups:
            raise ConfigError(
                f"`num_attention_heads` ({self.num_attention_heads}) must be a multiple of `o_groups` ({self.o_groups})"
            )
        if self.rope_dim % 2 or not 0 < self.rope_dim <= self.head_dim:
            raise ConfigError(f"rope dims ({self.rope_dim}) must be even and within `head_dim` ({self.head_dim})")
        if self.index_rope_dim > self.index_head_dim:
            raise ConfigError("`index_head_dim` must be at least the rope dims")
        if self.num_experts_per_tok > self.n_routed_experts:
            raise ConfigError("`num_experts_per_tok` must not exceed `n_routed_experts`")
        for name in ("csa_ratio", "hca_ratio", "sliding_window", "hc_mult", "hc_sinkhorn_iters", "index_topk"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"`{name}` must be positive")

    # ---- derived -------------------------------------------------------------------------------------------------
    @property
    def layer_ratios(self) -> tuple[int, ...]:
        """Compress ratio per layer: 0 (sliding only), `csa_ratio`, or `hca_ratio`."""
        by_type = {SLIDING: 0, CSA: self.csa_ratio, HCA: self.hca_ratio}
        return tuple(by_type[t] for t in self.layer_types)

    @property
    def csa_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == CSA)

    @property
    def hca_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == HCA)

    @property
    def index_rope_dim(self) -> int:
        # The indexer rotates the same number of trailing channels as the main attention.
        return self.rope_dim

    @property
    def hc_mix_dim(self) -> int:
        return (2 + self.hc_mult) * self.hc_mult

    def fingerprint_dict(self) -> dict:
        """The architecture as plain data (no `raw`), for compatibility checks between workers."""
        d = dataclasses.asdict(self)
        d.pop("raw")
        return d

    # ---- parsing -------------------------------------------------------------------------------------------------
    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        cfg_path = Path(path) / "config.json"
        if not cfg_path.is_file():
            raise ConfigError(f"no config.json in {path}")
        return cls.from_dict(json.loads(cfg_path.read_text()))

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        return _parse(d)


_UNSUPPORTED_FLAGS = {
    # key: allowed values (anything else changes the math in ways this engine does not implement)
    "num_key_value_heads": (1,),
    "hidden_act": ("silu",),
    "attention_bias": (False,),
    "mlp_bias": (False,),
    "n_shared_experts": (1,),
    "norm_topk_prob": (True,),
}


def _check_release_quantization(d: dict[str, Any]) -> None:
    """DeepSeek-V4's released format: FP8 e4m3 weights in 128x128 blocks (`quantization_config`), routed experts FP4
    (MXFP4) or FP8 (top-level `expert_dtype`). The loader reads each quantized weight with its scale
    (`model/scaled_weights.py`); any other scheme is refused."""
    q = d.get("quantization_config")
    if q:
        if not isinstance(q, dict) or q.get("quant_method") != "fp8":
            method = q.get("quant_method") if isinstance(q, dict) else q
            raise ConfigError(f"`quantization_config.quant_method` is {method!r}; allowed: 'fp8' (DeepSeek-V4's "
                              "released format) or none (bf16/fp32 weights)")
        check_choice("quantization_config.fmt", q.get("fmt", "e4m3"), ("e4m3",))
        block = q.get("weight_block_size", [128, 128])
        if list(block) != [128, 128]:
            raise ConfigError(f"`quantization_config.weight_block_size` is {block}; allowed: [128, 128]")
        check_choice("quantization_config.scale_fmt", q.get("scale_fmt", "ue8m0"), ("ue8m0", None))
    if d.get("expert_dtype") is not None:
        check_choice("expert_dtype", d["expert_dtype"], ("fp4", "fp8", "bf16"))


def _parse(d: dict[str, Any]) -> ModelConfig:
    model_type = d.get("model_type", "deepseek_v4")
    check_choice("model_type", model_type, ("deepseek_v4",))
    _check_release_quantization(d)
    for key, allowed in _UNSUPPORTED_FLAGS.items():
        if key in d and d[key] is not None:
            check_choice(key, d[key], allowed)

    n_layers = _int(d, "num_hidden_layers")
    head_dim = _int(d, "head_dim")
    csa_ratio, hca_ratio, layer_types = _parse_layer_types(d, n_layers)
    rope_dim = _parse_rope_dim(d, head_dim)
    main_rope, compress_rope = _parse_rope(d)
    hash_layers = _parse_hash_layers(d, n_layers)
    eos = d.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))

    return ModelConfig(
        vocab_size=_int(d, "vocab_size"),
        hidden_size=_int(d, "hidden_size"),
        num_hidden_layers=n_layers,
        num_attention_heads=_int(d, "num_attention_heads"),
        head_dim=head_dim,
        rope_dim=rope_dim,
        q_lora_rank=_int(d, "q_lora_rank"),
        o_groups=_int(d, "o_groups"),
        o_lora_rank=_int(d, "o_lora_rank"),
        sliding_window=_int(d, "sliding_window"),
        layer_types=layer_types,
        csa_ratio=csa_ratio,
        hca_ratio=hca_ratio,
        index_n_heads=_int(d, "index_n_heads"),
        index_head_dim=_int(d, "index_head_dim"),
        index_topk=_int(d, "index_topk"),
        n_routed_experts=_int(d, "n_routed_experts"),
        num_experts_per_tok=_int(d, "num_experts_per_tok"),
        moe_intermediate_size=_int(d, "moe_intermediate_size"),
        hash_layers=hash_layers,
        scoring_func=d.get("scoring_func", "sqrtsoftplus"),
        routed_scaling_factor=float(d.get("routed_scaling_factor", 1.5)),
        swiglu_limit=float(d.get("swiglu_limit", 10.0)),
        hc_mult=int(d.get("hc_mult", 4)),
        hc_sinkhorn_iters=int(d.get("hc_sinkhorn_iters", 20)),
        hc_eps=float(d.get("hc_eps", 1e-6)),
        rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
        main_rope=main_rope,
        compress_rope=compress_rope,
        max_position_embeddings=int(d.get("max_position_embeddings", 1048576)),
        tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
        bos_token_id=d.get("bos_token_id"),
        eos_token_ids=eos_ids,
        num_nextn_predict_layers=int(d.get("num_nextn_predict_layers", 0) or 0),
        raw=dict(d),
    )


def _int(d: dict, key: str) -> int:
    if key not in d or d[key] is None:
        raise ConfigError(f"config.json is missing required key `{key}`")
    return int(d[key])


def _parse_layer_types(d: dict, n_layers: int) -> tuple[int, int, tuple[str, ...]]:
    rates = dict(d.get("compress_rates") or {})
    csa = int(rates.get(CSA, d.get("compress_rate_csa", 4)))
    hca = int(rates.get(HCA, d.get("compress_rate_hca", 128)))
    if d.get("layer_types") is not None:
        types = tuple(d["layer_types"])
    elif d.get("compress_ratios") is not None:
        ratios = [int(r) for r in d["compress_ratios"]]
        if len(ratios) < n_layers:
            raise ConfigError(f"`compress_ratios` has {len(ratios)} entries; need {n_layers} (one per layer)")
        # DeepSeek's list carries the MTP block(s) after the backbone layers; those never compress. As in DeepSeek's
        # reference, ratio 4 is the overlapping (CSA) compressor and any other non-zero ratio the heavy (HCA) one.
        heavy = sorted({r for r in ratios[:n_layers] if r not in (0, 4)})
        if len(heavy) > 1:
            raise ConfigError(f"`compress_ratios` uses heavy ratios {heavy}; allowed: one ratio besides 0 and 4")
        csa = 4
        hca = heavy[0] if heavy else hca
        types = tuple(SLIDING if r == 0 else CSA if r == 4 else HCA for r in ratios[:n_layers])
    else:
        raise ConfigError("config.json needs `layer_types` or `compress_ratios`")
    if len(types) < n_layers:
        raise ConfigError(f"`layer_types` has {len(types)} entries; `num_hidden_layers` is {n_layers}")
    types = types[:n_layers]
    for t in types:
        check_choice("layer_types[]", t, LAYER_TYPES)
    return csa, hca, types


def _parse_rope_dim(d: dict, head_dim: int) -> int:
    if d.get("qk_rope_head_dim") is not None:
        return int(d["qk_rope_head_dim"])
    factor = d.get("partial_rotary_factor")
    if factor is None:
        factor = 64 / 512
    return int(head_dim * float(factor))


def _parse_rope(d: dict) -> tuple[RopeConfig, RopeConfig]:
    rope_theta = float(d.get("rope_theta", 10000.0))
    compress_theta = float(d.get("compress_rope_theta", 160000.0))
    rp = d.get("rope_parameters") or {}
    if isinstance(rp.get("main"), dict) and isinstance(rp.get("compress"), dict):
        return _rope_from(rp["main"], rope_theta), _rope_from(rp["compress"], compress_theta)
    # Flat form (`rope_parameters` or DeepSeek's `rope_scaling`): the scaling applies to compressed layers only.
    flat = {k: v for k, v in (rp or d.get("rope_scaling") or {}).items() if k not in ("main", "compress")}
    compress = _rope_from({**flat, "rope_theta": compress_theta}, compress_theta)
    return RopeConfig(theta=rope_theta), compress


def _rope_from(p: dict, default_theta: float) -> RopeConfig:
    rope_type = p.get("rope_type", p.get("type", "default"))
    theta = float(p.get("rope_theta", default_theta))
    if rope_type == "default":
        return RopeConfig(theta=theta)
    check_choice("rope_parameters.rope_type", rope_type, ROPE_TYPES)
    factor = p.get("factor")
    orig = p.get("original_max_position_embeddings")
    if factor is None or orig is None:
        raise ConfigError("yarn rope needs `factor` and `original_max_position_embeddings`")
    if p.get("mscale") or p.get("mscale_all_dim"):
        raise ConfigError("unsupported yarn keys `mscale`/`mscale_all_dim`; allowed: absent (DSV4 uses none)")
    attention_factor = p.get("attention_factor")
    return RopeConfig(
        theta=theta,
        rope_type="yarn",
        factor=float(factor),
        original_max_position_embeddings=int(orig),
        beta_fast=float(p.get("beta_fast") or 32),
        beta_slow=float(p.get("beta_slow") or 1),
        # DSV4 does not scale cos/sin by YaRN's mscale; transformers pins 1.0 the same way.
        attention_factor=1.0 if attention_factor is None else float(attention_factor),
    )


def _parse_hash_layers(d: dict, n_layers: int) -> tuple[bool, ...]:
    if d.get("mlp_layer_types") is not None:
        types = list(d["mlp_layer_types"])[:n_layers]
        if len(types) != n_layers:
            raise ConfigError(f"`mlp_layer_types` has {len(types)} entries; need {n_layers}")
        for t in types:
            check_choice("mlp_layer_types[]", t, MLP_LAYER_TYPES)
        return tuple(t == "hash_moe" for t in types)
    n_hash = int(d.get("num_hash_layers", 3))
    if not 0 <= n_hash <= n_layers:
        raise ConfigError(f"`num_hash_layers` must be within [0, {n_layers}]")
    return tuple(i < n_hash for i in range(n_layers))


def yarn_ramp_bounds(rope: RopeConfig, rope_dim: int) -> tuple[float, float]:
    """Channel-pair range over which YaRN blends interpolated and extrapolated frequencies."""

    def correction_dim(num_rotations: float) -> float:
        return (rope_dim * math.log(rope.original_max_position_embeddings / (num_rotations * 2 * math.pi))) / (
            2 * math.log(rope.theta)
        )

    low = math.floor(correction_dim(rope.beta_fast))
    high = math.ceil(correction_dim(rope.beta_slow))
    return max(low, 0), min(high, rope_dim - 1)
