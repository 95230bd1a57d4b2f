"""`CompactWeights`: a released checkpoint's FP8 and MXFP4 weights kept as stored, mapped onto `DSV4Model` through the
one name map (`weights.map_name`) and installed in place of the float parameters they stand for.

- An FP8 projection that the model runs through `quant_linear.linear` (q/kv/output projections, the indexer's query
  projection, the shared expert) becomes an `Fp8Linear`: a byte per weight and one fp32 scale per 128x128 tile.
- A layer's routed experts (MXFP4, or FP8 in V4-Flash-Base) become one `CompactExperts` holding this rank's experts.
  Its stacks are allocated when the layer's first expert arrives and each expert is copied in as it is read, so a
  layer's experts are never in memory twice.
- Any other quantized weight (a compressor's, say, should a checkpoint quantize one) is decoded to float by the caller.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch
from torch import nn

from pdspark.errors import CheckpointError
from pdspark.model.compact_experts import FP8, MXFP4, PROJECTIONS, CompactExperts
from pdspark.model.fp8_linear import Fp8Linear
from pdspark.model.scaled_weights import Scaled
from pdspark.model.weights import Piece, describe
from pdspark.parallel.expert_shard import ExpertShard
from pdspark.quant.release_formats import scale_values

# The parameters the model runs through `quant_linear.linear` (a module there works; elsewhere it would not).
_RUNS_COMPACT = re.compile(r"(^|\.)(attn\.(wq_a|wq_b|wkv|wo_a|wo_b)|attn\.indexer\.wq_b|ffn\.shared\.w[123])$")
_PROJ = {("ffn.w13", 0): "w1", ("ffn.w13", 1): "w3", ("ffn.w2", None): "w2"}


@dataclass
class _ExpertStacks:
    """One layer's held experts, filled as they are read."""

    fmt: str
    weights: dict[str, torch.Tensor] = field(default_factory=dict)  # w13 / w2 -> [E_held, ...] (`CompactExperts`)
    scales: dict[str, torch.Tensor] = field(default_factory=dict)
    filled: set[tuple[int, str]] = field(default_factory=set)  # (held index, projection)


class CompactWeights:
    def __init__(self, shard: ExpertShard):
        self.shard = shard
        self.linears: dict[str, Fp8Linear] = {}  # model path (`layers.3.attn.wq_a`) -> its linear
        self.experts: dict[str, _ExpertStacks] = {}  # `layers.3.ffn` -> its experts
        self.filled: set[Piece] = set()  # the float pieces they stand for

    def take(self, name: str, piece: Piece, tensor: Scaled) -> bool:
        """Keep checkpoint tensor `name` (a quantized weight, mapped to `piece`) compact; False: the caller decodes
        it into its float parameter instead."""
        if tensor.scale is None:
            return False
        if piece.expert is not None:
            self._add_expert(name, piece, tensor)
            return True
        if piece.half is None and tensor.weight.dtype is torch.float8_e4m3fn and _RUNS_COMPACT.search(piece.param):
            # Copies: what the file gives may be a view of its mapping, which must not outlive the load.
            self.linears[piece.param] = Fp8Linear(tensor.weight.clone(), tensor.scale.clone())
            self.filled.add(piece)
            return True
        return False

    def _add_expert(self, name: str, piece: Piece, tensor: Scaled) -> None:
        layer, param = piece.param.rsplit(".", 2)[0], "ffn." + piece.param.rsplit(".", 1)[1]
        proj = _PROJ[(param, piece.half)]
        fmt = FP8 if tensor.weight.dtype is torch.float8_e4m3fn else MXFP4
        stacks = self.experts.setdefault(layer, _ExpertStacks(fmt))
        if stacks.fmt != fmt:
            raise CheckpointError(f"tensor {name!r} is {fmt} but {layer}'s other routed experts are {stacks.fmt}: "
                                  "every routed expert of a layer must share one format")
        weight = tensor.weight.view(torch.uint8) if fmt == MXFP4 else tensor.weight
        assert tensor.scale is not None
        scale = tensor.scale.view(torch.uint8) if fmt == MXFP4 else scale_values(tensor.scale)
        stack = "w2" if proj == "w2" else "w13"
        if stack not in stacks.weights:  # gate (w1) and up (w3) rows in one stack, each half as it comes
            n = 1 if proj == "w2" else 2
            stacks.weights[stack] = torch.empty(self.shard.count, n * weight.shape[0], *weight.shape[1:],
                                                dtype=weight.dtype)
            stacks.scales[stack] = torch.empty(self.shard.count, n * scale.shape[0], *scale.shape[1:],
                                               dtype=scale.dtype)
        held = piece.expert - self.shard.first  # type: ignore[operator]  # (an expert piece)
        for what, stacked, src in (("weight", stacks.weights[stack], weight), ("scale", stacks.scales[stack], scale)):
            rows = stacked.shape[1] // (1 if proj == "w2" else 2)
            if (rows, *stacked.shape[2:]) != tuple(src.shape):
                raise CheckpointError(f"tensor {name!r}'s {what} has shape {tuple(src.shape)}; expert "
                                      f"{self.shard.first}'s has {(rows, *stacked.shape[2:])}")
            stacked[held, rows if proj == "w3" else 0 :][:rows].copy_(src)
        stacks.filled.add((held, proj))
        self.filled.add(piece)

    def install(self, model: nn.Module) -> None:
        """Replace the float parameters by the compact modules; every held expert of a layer must have been read."""
        for path, linear in self.linears.items():
            owner, _, attr = path.rpartition(".")
            module = model.get_submodule(owner)
            delattr(module, attr)
            setattr(module, attr, linear)
        for layer, stacks in self.experts.items():
            for e in range(self.shard.count):
                for proj in PROJECTIONS:
                    if (e, proj) not in stacks.filled:
                        half = {"w1": 0, "w3": 1}.get(proj)
                        piece = Piece(f"{layer}.ffn.{'w2' if proj == 'w2' else 'w13'}", self.shard.first + e, half)
                        raise CheckpointError(f"checkpoint is missing {describe(piece)}")
            moe = model.get_submodule(f"{layer}.ffn")
            del moe.w13, moe.w2
            moe.experts = CompactExperts(stacks.fmt, self.shard.first, stacks.weights, stacks.scales)
