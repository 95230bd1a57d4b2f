"""Checkpoint loading: one explicit name map from checkpoint tensors to `DSV4Model` parameters.

Two spellings are accepted, both per layer and at the top level:
- DeepSeek's own (`embed.weight`, `layers.3.attn.wq_a.weight`, `layers.3.ffn.experts.7.w1.weight`,
  `layers.3.hc_attn_fn`, `hc_head_fn`, ...);
- what transformers' `DeepseekV4ForCausalLM.save_pretrained` writes: the same per-layer names under `model.`, with
  `model.embed_tokens.weight`, `model.hc_head.hc_fn`, `model.layers.N.attn.norm.weight` (the KV norm) and a bare
  `head.weight`.
Routed experts are stacked into `w13 [E, 2I, D]` (w1 rows then w3 rows) and `w2 [E, D, I]`; a compressor's
`wkv` and `wgate` become the two halves of `wkv_gate`. `mtp.*` tensors (the
speculative draft) are returned aside, untouched.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
from safetensors import SafetensorError, safe_open

from pdspark.errors import CheckpointError
from pdspark.model.dsv4 import DSV4Model
from pdspark.model.scaled_weights import Scaled, ScaledWeights, scale_owner
from pdspark.model.tensor_inventory import stored_spec
from pdspark.quant.scheme import QuantDescription

# checkpoint name (after an optional leading "model.") -> parameter name, or (parameter, row half)
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
    "attn.compressor.wkv.weight": ("attn.compressor.wkv_gate", 0),
    "attn.compressor.wgate.weight": ("attn.compressor.wkv_gate", 1),
    "attn.compressor.ape": "attn.compressor.ape",
    "attn.compressor.norm.weight": "attn.compressor.norm.weight",
    "attn.indexer.wq_b.weight": "attn.indexer.wq_b",
    "attn.indexer.weights_proj.weight": "attn.indexer.weights_proj",
    "attn.indexer.compressor.wkv.weight": ("attn.indexer.compressor.wkv_gate", 0),
    "attn.indexer.compressor.wgate.weight": ("attn.indexer.compressor.wkv_gate", 1),
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
# Routed experts: w1 (gate) and w3 (up) stack as the two halves of w13; w2 (down) stands alone.
_EXPERT_PARTS = {"w1": ("ffn.w13", 0), "w3": ("ffn.w13", 1), "w2": ("ffn.w2", None)}


@dataclass(frozen=True)
class Piece:
    """Where a checkpoint tensor goes: a whole parameter, or one expert's and/or one half's rows of it."""

    param: str
    expert: int | None = None
    half: int | None = None  # 0: first half of the rows, 1: second half

    def view(self, dest: torch.Tensor, first_expert: int = 0) -> torch.Tensor:
        """Its rows of `dest`; `first_expert`: the expert at index 0 of `dest` (expert parallelism)."""
        t = dest if self.expert is None else dest[self.expert - first_expert]
        if self.half is None:
            return t
        n = t.shape[0] // 2
        return t[:n] if self.half == 0 else t[n:]


def map_name(name: str) -> Piece | None:
    """Map a checkpoint tensor name to its destination; None for names this model does not own."""
    if name.startswith("model."):
        name = name[len("model.") :]
    if name in _TOP_LEVEL:
        return Piece(_TOP_LEVEL[name])
    m = _LAYER_RE.match(name)
    if not m:
        return None
    layer, rest = m.group(1), m.group(2)
    if rest in _PER_LAYER:
        target = _PER_LAYER[rest]
        param, half = target if isinstance(target, tuple) else (target, None)
        return Piece(f"layers.{layer}.{param}", None, half)
    e = _EXPERT_RE.match(rest)
    if e:
        param, half = _EXPERT_PARTS[e.group(2)]
        return Piece(f"layers.{layer}.{param}", int(e.group(1)), half)
    return None


def expected_pieces(params: dict[str, torch.Tensor], experts: range) -> set[Piece]:
    pieces = set()
    for name in params:
        if name.endswith("ffn.w13"):
            pieces |= {Piece(name, e, h) for e in experts for h in (0, 1)}
        elif name.endswith("ffn.w2"):
            pieces |= {Piece(name, e) for e in experts}
        elif name.endswith("wkv_gate"):
            pieces |= {Piece(name, None, 0), Piece(name, None, 1)}
        else:
            pieces.add(Piece(name))
    return pieces


def describe(piece: Piece) -> str:
    """The DeepSeek-style checkpoint name of a piece, for error messages."""
    if piece.expert is not None:
        layer = piece.param.split(".")[1]
        part = "w2" if piece.param.endswith("w2") else ("w1", "w3")[piece.half or 0]
        return f"layers.{layer}.ffn.experts.{piece.expert}.{part}.weight"
    for key, target in {**_PER_LAYER, **_TOP_LEVEL}.items():
        param, half = target if isinstance(target, tuple) else (target, None)
        if piece.param.endswith(param) and half == piece.half:
            prefix = piece.param[: -len(param)]
            return prefix + key
    return piece.param


@dataclass
class LoadReport:
    extra: dict[str, torch.Tensor | Scaled]  # mtp.* tensors, for the speculative decoder (`Scaled`: kept compact)
    num_tensors: int
    quantized: dict[str, torch.Tensor] | None = None  # a ModelSlim checkpoint's quantized linears' tensors
    filled: set[Piece] | None = None  # the pieces loaded as float


def checkpoint_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / n for n in names]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no *.safetensors files in {path}")
    return files


class KeepsCompact(Protocol):
    """Where a released checkpoint's quantized weights go when they stay compact (`compact_weights.CompactWeights`)."""

    def take(self, name: str, piece: Piece, tensor: Scaled) -> bool: ...


def has_scaled_weights(path: Path) -> bool:
    """The checkpoint at `path` holds FP8/MXFP4 weights with scales (the released format), from the index or the
    files' headers alone."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        names = list(json.loads(index.read_text())["weight_map"])
    else:
        names = [n for f in checkpoint_files(path) for n in _open(f).keys()]  # noqa: SIM118 (a safetensors handle)
    return any(scale_owner(n) is not None for n in names)


def load_weights(model: DSV4Model, path: str | Path, progress: bool = False,
                 quant: QuantDescription | None = None, check: bool = True,
                 compact: KeepsCompact | None = None, read_draft: bool = True) -> LoadReport:
    """Copy every tensor of the checkpoint at `path` into `model`; raises `CheckpointError` on any mismatch.

    With `quant` (a ModelSlim checkpoint's description), the tensors of quantized linears are returned aside in
    `LoadReport.quantized` (see `quant_weights.QuantizedWeights`), and `check` False leaves the completeness check
    to the caller (which knows the pieces they stand for). With `compact`, a released checkpoint's FP8/MXFP4
    weights go to it as stored (those it takes), and BF16 matrices stay BF16 (`Assigner`); `check` as above.
    `read_draft` False: the `mtp.*` tensors are not read (no speculative decoding)."""
    files = checkpoint_files(Path(path))
    handles = {f: _open(f) for f in files}
    names = [(f, n) for f, h in handles.items() for n in h.keys()]  # noqa: SIM118 (a safetensors handle)
    extra: dict[str, torch.Tensor | Scaled] = {}
    quantized: dict[str, torch.Tensor] = {}
    shard = model.experts  # with expert parallelism, other ranks' experts are never read
    # Each tensor goes into its parameter as it is read (never the whole checkpoint in memory beside the model).
    into = Assigner(model, map_name, shard.first, keep_bf16=compact is not None)
    if quant is not None and not shard.is_whole:
        raise CheckpointError("expert parallelism (`ep_size` > 1) with a ModelSlim-quantized checkpoint is not "
                              "supported yet; allowed: `ep_size` 1 for quantized checkpoints")
    # The released format's FP8/FP4 weights are read with their scales and decoded to float (`scaled_weights.py`).
    weights = ScaledWeights(handles, names, _open)
    skipped: set[str] = set()
    sizes = {name: stored_spec(name, handles[f].get_slice(name)).nbytes for f, name in names}
    bar = _progress(sum(sizes.values()), progress)
    last = {f: name for f, name in names}  # each file's last tensor
    for f, name in names:
        bar.update(sizes[name])
        if weights.is_scale(name):
            pass  # (read with its weight)
        elif not shard.is_whole and (piece := map_name(name)) is not None and piece.expert is not None \
                and not shard.holds(piece.expert) or name.startswith(("mtp.", "model.mtp.")) and not read_draft:
            skipped.add(name)
        elif quant is not None and quant.quantized_linear(name) is not None:
            # A copy: kept as is (not copied into a parameter), a view of the mapped file would keep all of it
            # resident for the life of the model. A quantized draft linear goes aside with the other `mtp.*`.
            is_draft = name.startswith(("mtp.", "model.mtp."))
            (extra if is_draft else quantized)[name.removeprefix("model.")] = handles[f].get_tensor(name).clone()
        elif name.startswith(("mtp.", "model.mtp.")):  # (copies: not views of the mapped file)
            if compact is not None:  # kept as stored, for the draft's own compact build (`dspark_weights`)
                stored = weights.read(name)
                extra[name.removeprefix("model.")] = Scaled(stored.weight.clone(),
                                                            None if stored.scale is None else stored.scale.clone())
            else:
                extra[name.removeprefix("model.")] = weights.get(name).clone()
        elif compact is not None and weights.has_scale(name) and (piece := map_name(name)) is not None:
            stored = weights.read(name)
            if not compact.take(name, piece, stored):
                into.put(name, stored.decoded())
        else:
            into.put(name, weights.get(name))
        if last[f] == name:
            # The file is done: closed, so that the pages of it the process mapped stop counting in its resident
            # memory (what was read from it is copied, or a view that is gone).
            weights.release(f)
    bar.close()
    weights.check_all_used(skipped)
    filled = into.filled
    if Piece("head") not in filled and model.cfg.tie_word_embeddings and Piece("embed") in filled:
        if model.head.is_meta:  # (a model built on the meta device: the head is the embedding, not a copy of it)
            model.head = model.embed
        else:
            with torch.no_grad():
                model.head.copy_(model.embed)
        filled.add(Piece("head"))
    if check:
        check_complete(model, filled, range(shard.first, shard.first + shard.count))
    check_expert_ids(model, model.cfg.n_routed_experts)
    return LoadReport(extra=extra, num_tensors=len(names), quantized=quantized if quant else None, filled=filled)



def _open(f: Path):
    """A checkpoint file, opened (its header read); a missing or damaged file is a `CheckpointError` naming it."""
    try:
        return safe_open(str(f), "pt")
    except (OSError, SafetensorError) as e:
        raise CheckpointError(f"checkpoint file {f.name!r} cannot be read: {type(e).__name__}: {e}") from e


class Assigner:
    """Copies checkpoint tensors into `module`'s parameters through `mapper(name) -> Piece | None`, one at a time;
    `first_expert`: the expert at index 0 of the stacked expert parameters (expert parallelism).

    A parameter still on the meta device (a model built without memory) gets its tensor when its first piece
    arrives: of the parameter's dtype, or, with `keep_bf16`, bf16 for a matrix the checkpoint stores in BF16 (the
    embedding, the head, the router, the compressors; vectors such as norms widen to the parameter's dtype)."""

    def __init__(self, module: torch.nn.Module, mapper, first_expert: int = 0, keep_bf16: bool = False):
        self.module = module
        self.params: dict[str, torch.Tensor] = dict(module.named_parameters())
        self.params.update(dict(module.named_buffers()))
        self.mapper = mapper
        self.first_expert = first_expert
        self.keep_bf16 = keep_bf16
        self.filled: set[Piece] = set()  # the pieces filled so far

    def put(self, name: str, tensor: torch.Tensor) -> None:
        piece = self.mapper(name)
        if piece is None or piece.param not in self.params:
            raise CheckpointError(f"unexpected tensor {name!r} (not part of this model's config)")
        if self.params[piece.param].is_meta:
            self._materialize(piece.param, tensor.dtype)
        with torch.no_grad():
            _copy(piece.view(self.params[piece.param], self.first_expert), tensor, name)
        self.filled.add(piece)

    def _materialize(self, param: str, stored: torch.dtype) -> None:
        """Give meta parameter `param` its memory (never touched before its pieces are copied in)."""
        meta = self.params[param]
        dtype = torch.bfloat16 if self.keep_bf16 and stored is torch.bfloat16 and meta.dim() >= 2 else meta.dtype
        real = torch.empty(meta.shape, dtype=dtype)
        owner, _, attr = param.rpartition(".")
        module = self.module.get_submodule(owner)
        if isinstance(meta, torch.nn.Parameter):
            setattr(module, attr, torch.nn.Parameter(real, requires_grad=False))
        else:
            module.register_buffer(attr, real)
        self.params[param] = real


def assign(module: torch.nn.Module, tensors: dict[str, torch.Tensor], mapper, first_expert: int = 0) -> set[Piece]:
    """Copy `tensors` into `module` (`Assigner`); returns the pieces filled."""
    into = Assigner(module, mapper, first_expert)
    for name, tensor in tensors.items():
        into.put(name, tensor)
    return into.filled


def check_complete(module: torch.nn.Module, filled: set[Piece], experts: int | range,
                   skip: tuple[str, ...] = ()) -> None:
    """Every piece of `module` was filled; `experts`: the routed experts it holds (a count: all of them)."""
    params = {n: p for n, p in list(module.named_parameters()) + list(module.named_buffers()) if n not in skip}
    held = range(experts) if isinstance(experts, int) else experts
    missing = sorted(describe(p) for p in expected_pieces(params, held) - filled)
    if missing:
        shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
        raise CheckpointError(f"checkpoint is missing {len(missing)} tensor(s): {shown}")


def check_expert_ids(module: torch.nn.Module, n_experts: int) -> None:
    """Every hash-routing table (`tid2eid`) names experts in [0, n_experts): the MoE kernels index the expert weights
    with these ids unchecked, so one out of range would read another tensor's memory."""
    for name, table in module.named_buffers():
        if name.endswith("tid2eid") and table.numel() and not table.is_meta:
            low, high = int(table.min()), int(table.max())
            if low < 0 or high >= n_experts:
                raise CheckpointError(f"tensor {name!r} holds expert ids in [{low}, {high}]; allowed: "
                                      f"[0, {n_experts - 1}] (`n_routed_experts` is {n_experts})")


def _copy(dest: torch.Tensor, src: torch.Tensor, name: str) -> None:
    if tuple(dest.shape) != tuple(src.shape):
        raise CheckpointError(f"tensor {name!r} has shape {tuple(src.shape)}; the config implies {tuple(dest.shape)}")
    if src.dtype == torch.int8 and dest.is_floating_point():
        # A quantized weight read as float would be cast silently, scales ignored.
        raise CheckpointError(f"tensor {name!r} is int8 but stands for a float parameter: a packed MXFP4 weight needs "
                              "its `.scale` beside it, a ModelSlim linear its scheme in quant_model_description.json")
    dest.copy_(src.to(dest.dtype))


class _NoBar:
    def update(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass


def _progress(total: int, enabled: bool):
    if not enabled:
        return _NoBar()
    from tqdm import tqdm

    return tqdm(total=total, desc="loading weights", unit="B", unit_scale=True, unit_divisor=1024)
