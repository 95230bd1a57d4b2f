"""`inspect_model`: what a checkpoint (or a bare config) asks of a deployment, read without loading any weight: the
architecture, whether every tensor of the checkpoint maps to the model (from its index and file headers only), the
bytes each rank of an expert-parallel group holds by dtype, the KV bytes each token of context takes, and how many
tokens fit in a memory budget. `pdspark inspect` prints it (`render`).

Bytes per rank: routed experts split evenly over the ranks (`--ep-size`); everything else (attention, shared experts,
embedding, head, the MTP/draft tensors) is on every rank, in DP-attention and replicated groups alike.
KV per token (context-proportional pools): a CSA layer keeps one compressed entry per `csa_ratio` tokens (its KV row
and its indexer key), an HCA layer one per `hca_ratio`; the sliding window (every layer's last `sliding_window` rows)
is a fixed cost per request, not per token. Row bytes by `kv_cache_dtype`: `head_dim` values of bfloat16/float32, or
SGLang's FP8 pack (FP8 nope dims, bf16 rope dims, one ue8m0 scale per 64 nope dims, padded to 8 bytes: 584 B for
DSV4's 512 = 448 + 64) with FP8 indexer keys plus one f32 scale per 128 dims.
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from pdspark.errors import ConfigError
from pdspark.model.model_config import CSA, HCA, SLIDING, ModelConfig
from pdspark.model.scaled_weights import scale_owner
from pdspark.model.tensor_inventory import TensorSpec, released_tensors, stored_tensors
from pdspark.model.weights import checkpoint_files, map_name

KV_CACHE_DTYPES = ("bfloat16", "float32", "fp8_e4m3")
_GIB = 2**30


@dataclass(frozen=True)
class Coverage:
    files: int
    tensors: int
    unknown: list[str]  # names that map to nothing in the model
    missing: list[str]  # the model's tensors the checkpoint lacks
    draft: int  # mtp.* tensors (the MTP / DSpark draft)


@dataclass(frozen=True)
class RankBytes:
    ep_size: int
    by_dtype: dict[str, int]  # on each rank
    experts: int  # of which routed experts (each rank's share)

    @property
    def total(self) -> int:
        return sum(self.by_dtype.values())


@dataclass(frozen=True)
class KvBytes:
    dtype: str
    per_token: dict[str, float]  # context-proportional pools: bytes per token
    per_request: dict[str, int]  # the sliding window's rows

    @property
    def token(self) -> float:
        return sum(self.per_token.values())


@dataclass(frozen=True)
class Inspection:
    cfg: ModelConfig
    source: str  # "checkpoint" (file headers) or "config" (the released format predicted)
    tensors: list[TensorSpec]
    coverage: Coverage | None
    ranks: list[RankBytes]
    kv: KvBytes
    memory_gib: float | None = None
    dp_attention: bool = False

    def tokens_in_budget(self, rank: RankBytes) -> int | None:
        """Tokens of context whose KV fits beside one rank's weights in `memory_gib` (None without a budget)."""
        if self.memory_gib is None:
            return None
        room = self.memory_gib * _GIB - rank.total
        return max(0, int(room // self.kv.token)) if self.kv.token else None


def inspect_model(path: str | Path | None = None, config_file: str | Path | None = None,
                  ep_sizes: tuple[int, ...] = (1,), kv_cache_dtype: str = "bfloat16",
                  memory_gib: float | None = None, dp_attention: bool = False) -> Inspection:
    """Inspect the checkpoint directory `path`, or the config at `config_file` alone (its tensors are then the
    released format's, predicted from the config)."""
    if (path is None) == (config_file is None):
        raise ConfigError("inspect needs a checkpoint directory or --config FILE; allowed: exactly one of them")
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ConfigError(f"`kv_cache_dtype` is {kv_cache_dtype!r}; allowed: {list(KV_CACHE_DTYPES)}")
    where = Path(config_file) if config_file is not None else Path(str(path)) / "config.json"
    try:
        raw = json.loads(where.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"cannot read the config {str(where)!r}: {e}") from e
    cfg = ModelConfig.from_dict(raw)
    for ep in ep_sizes:
        if ep < 1 or cfg.n_routed_experts % ep:
            raise ConfigError(f"`ep_size` is {ep}; allowed: a divisor of the model's {cfg.n_routed_experts} routed "
                              "experts")
    predicted = released_tensors(cfg, raw.get("expert_dtype", "fp4") if raw.get("quantization_config") else "bf16")
    coverage = None
    if path is not None:
        files = checkpoint_files(Path(path))
        tensors = stored_tensors(files)
        coverage = _coverage(len(files), tensors, predicted)
        source = "checkpoint"
    else:
        tensors, source = predicted, "config"
    ranks = [_rank_bytes(tensors, cfg.n_routed_experts, ep) for ep in ep_sizes]
    return Inspection(cfg, source, tensors, coverage, ranks, kv_bytes(cfg, kv_cache_dtype), memory_gib, dp_attention)


def kv_bytes(cfg: ModelConfig, dtype: str) -> KvBytes:
    hd, ih = cfg.head_dim, cfg.index_head_dim
    if dtype == "fp8_e4m3":
        nope = hd - cfg.rope_dim
        row = -(-(nope + 2 * cfg.rope_dim + -(-nope // 64)) // 8) * 8
        index_row = ih + 4 * -(-ih // 128)
    else:
        width = 2 if dtype == "bfloat16" else 4
        row, index_row = hd * width, ih * width
    csa, hca = cfg.layer_types.count(CSA), cfg.layer_types.count(HCA)
    per_token = {"c4_kv": csa * row / cfg.csa_ratio, "c4_index": csa * index_row / cfg.csa_ratio,
                 "c128_kv": hca * row / cfg.hca_ratio}
    swa_layers = len(cfg.layer_types) + cfg.num_nextn_predict_layers
    return KvBytes(dtype, per_token, {"swa_window": swa_layers * cfg.sliding_window * row})


def _coverage(files: int, tensors: list[TensorSpec], predicted: list[TensorSpec]) -> Coverage:
    """The checkpoint's tensors against the model's, by destination (either naming maps): scales belong to their
    weights, `mtp.*` to the draft."""
    own = [t.name for t in tensors if not t.name.removeprefix("model.").startswith("mtp.")]
    weights = [n for n in own if scale_owner(n) is None]
    unknown = sorted(n for n in weights if map_name(n) is None)
    have = {map_name(n) for n in weights} - {None}
    want = {t.name for t in predicted if scale_owner(t.name) is None and not t.name.startswith("mtp.")}
    missing = sorted(n for n in want if map_name(n) not in have)
    return Coverage(files, len(tensors), unknown, missing, len(tensors) - len(own))


def _rank_bytes(tensors: list[TensorSpec], n_experts: int, ep: int) -> RankBytes:
    """Each rank's bytes: every non-expert tensor, and 1/ep of the routed experts' (they are uniform, and ep divides
    their count, so the share is exact)."""
    shared: dict[str, int] = defaultdict(int)
    experts: dict[str, int] = defaultdict(int)
    for t in tensors:
        (shared if t.expert is None else experts)[t.dtype] += t.nbytes
    by_dtype = {d: shared[d] + experts[d] // ep for d in sorted(set(shared) | set(experts))}
    return RankBytes(ep, by_dtype, sum(experts.values()) // ep)


def render(r: Inspection) -> str:
    c = r.cfg
    kinds = {SLIDING: "sliding", CSA: "CSA", HCA: "HCA"}
    counts = ", ".join(f"{c.layer_types.count(k)} {name}" for k, name in kinds.items())
    lines = [
        f"model: {len(c.layer_types)} layers ({counts}; {sum(c.hash_layers)} hash-routed), "
        f"{c.num_nextn_predict_layers} MTP block(s); hidden {c.hidden_size}, {c.num_attention_heads} heads x "
        f"{c.head_dim} (rope {c.rope_dim}), q_lora {c.q_lora_rank}, o {c.o_groups} groups x {c.o_lora_rank}; "
        f"{c.n_routed_experts} routed experts ({c.num_experts_per_tok} active) x {c.moe_intermediate_size}; "
        f"vocab {c.vocab_size}; mHC x{c.hc_mult}; window {c.sliding_window}, C4 / C{c.hca_ratio}, indexer "
        f"{c.index_n_heads} heads x {c.index_head_dim}, top-{c.index_topk}",
    ]
    if r.coverage is not None:
        cov = r.coverage
        state = ("every tensor mapped: none unknown, none missing" if not cov.unknown and not cov.missing else
                 f"{len(cov.unknown)} unknown ({', '.join(cov.unknown[:5])}), {len(cov.missing)} missing "
                 f"({', '.join(cov.missing[:5])})")
        lines.append(f"tensors: {cov.tensors} in {cov.files} file(s) ({cov.draft} of the MTP/draft): {state}")
    else:
        lines.append(f"tensors: {len(r.tensors)} (the released format, predicted from the config)")
    lines.append("weights per rank (GiB):")
    dtypes = sorted({d for rank in r.ranks for d in rank.by_dtype})
    lines.append("  " + f"{'ep':>4} " + " ".join(f"{d:>9}" for d in dtypes) + f" {'experts':>9} {'total':>9}"
                 + (f" {'tokens':>12}" if r.memory_gib is not None else ""))
    for rank in r.ranks:
        row = " ".join(f"{rank.by_dtype.get(d, 0) / _GIB:9.3f}" for d in dtypes)
        tokens = r.tokens_in_budget(rank)
        budget = f" {tokens:>12,}" if tokens is not None else ""
        lines.append(f"  {rank.ep_size:>4} {row} {rank.experts / _GIB:9.3f} {rank.total / _GIB:9.3f}{budget}")
    kv = r.kv
    parts = ", ".join(f"{k} {v:.1f}" for k, v in kv.per_token.items())
    lines.append(f"KV ({kv.dtype}): {kv.token:.1f} B per token of context ({parts}); per request "
                 f"{kv.per_request['swa_window'] / 2**20:.2f} MiB for the sliding window")
    if r.memory_gib is not None:
        whose = ("each rank its own requests' (DP-attention): the group holds ep times this" if r.dp_attention else
                 "every rank the same (a replicated group): the group holds this")
        lines.append(f"tokens: the context whose KV fits beside one rank's weights in {r.memory_gib:g} GiB; "
                     f"{whose}")
    if kv.dtype == "fp8_e4m3":
        lines.append("note: the FP8 KV cache is not built yet: these are the figures of SGLang's pack")
    return "\n".join(lines)

