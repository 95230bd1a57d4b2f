"""`QuantizedWeights`: the quantized linears of a ModelSlim checkpoint, mapped onto `DSV4Model` through the one name
map (`weights.map_name`), and installed in place of the float parameters they stand for. A DSpark draft's quantized
`mtp.*` linears go the same way through its own map (`dspark_weights.map_draft_name`) onto `DSparkDraft`.

A linear is quantized when its own `.weight` entry in `quant_model_description.json` says so; its tensors are
`<prefix>.weight` plus the scheme's scales (`weight_scale`, `input_scale`, ...). Routed experts are stored per expert
and projection and stacked here (`w1`/`w3` rows into w13, `w2`); every expert of a layer must have expert 0's scheme.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from pdspark.errors import CheckpointError
from pdspark.model.weights import Piece, map_name
from pdspark.quant.quant_experts import QuantExperts
from pdspark.quant.quant_linear import QuantLinear
from pdspark.quant.scheme import DYNAMIC_SCHEMES, QuantDescription

_EXPERT_RE = re.compile(r"^((?:layers|mtp)\.\d+)\.ffn\.experts\.\d+\.w[123]$")  # target layer or draft stage
# The parameters the model runs through `quant_linear.linear` (the others are plain `F.linear`s or lookups: a
# quantized module there would fail at run time, far from the checkpoint entry that caused it).
_RUNS_QUANTIZED = re.compile(r"(^|\.)(attn\.wq_a|attn\.wq_b|attn\.wkv|attn\.indexer\.wq_b|ffn\.shared\.w[123]|"
                             r"ffn\.w[123]|main_proj)$")
_EXPERT_PROJ = {("ffn.w13", 0): "w1", ("ffn.w13", 1): "w3", ("ffn.w2", None): "w2"}


@dataclass
class QuantizedWeights:
    """Quantized modules by the model path they replace: `layers.3.attn.wq_a` (a `QuantLinear`), `layers.3.ffn`
    (its routed experts, a `QuantExperts`)."""

    linears: dict[str, QuantLinear] = field(default_factory=dict)
    experts: dict[str, QuantExperts] = field(default_factory=dict)
    filled: set[Piece] = field(default_factory=set)  # the float pieces they stand for

    @classmethod
    def build(cls, tensors: dict[str, torch.Tensor], desc: QuantDescription, n_experts: int,
              mapper: Callable[[str], Piece | None] = map_name) -> QuantizedWeights:
        """From every quantized tensor of the checkpoint (by its full name); `mapper` is the model's name map
        (the target's, or the draft's with `n_experts` its routed experts per stage)."""
        by_prefix: dict[str, dict[str, torch.Tensor]] = {}
        for name, t in tensors.items():
            prefix = desc.quantized_linear(name)
            assert prefix is not None, name
            by_prefix.setdefault(prefix, {})[name[len(prefix) + 1 :]] = t
        for layer in {m.group(1) for p in by_prefix if (m := _EXPERT_RE.match(p))}:
            _check_experts_agree(layer, desc, n_experts)
        out = cls()
        per_expert: dict[str, dict[tuple[int, str], QuantLinear]] = {}  # "layers.3.ffn" -> {(e, "w1"): ...}
        for prefix, parts in by_prefix.items():
            piece = mapper(f"{prefix}.weight")
            if piece is None:
                raise CheckpointError(f"unexpected quantized tensor {prefix}.weight (not part of this model)")
            if piece.expert is None and piece.half is None and not _RUNS_QUANTIZED.search(piece.param):
                raise CheckpointError(f"{prefix}.weight is {desc.scheme_of(prefix)} in the description; pdspark "
                                      "runs it in float only (FLOAT in ModelSlim's DSV4 recipes)")
            q = QuantLinear.from_tensors(prefix, desc.scheme_of(prefix), parts)
            if piece.expert is not None:
                layer = piece.param.rsplit(".", 1)[0]  # layers.N.ffn (stages.N.ffn in a draft)
                proj = _EXPERT_PROJ[("ffn." + piece.param.rsplit(".", 1)[1], piece.half)]
                per_expert.setdefault(layer, {})[(piece.expert, proj)] = q
            elif piece.half is not None:
                raise CheckpointError(f"{prefix} is quantized ({q.scheme}); pdspark runs compressors in float")
            else:
                out.linears[piece.param] = q
                out.filled.add(piece)
        for layer, experts in per_expert.items():
            out.experts[layer] = _stack(layer, experts, n_experts)
            out.filled |= {Piece(f"{layer}.w13", e, h) for e in range(n_experts) for h in (0, 1)}
            out.filled |= {Piece(f"{layer}.w2", e) for e in range(n_experts)}
        return out

    def install(self, model: nn.Module) -> None:
        """Replace the float parameters by the quantized modules (after the model is moved and cast: the int8
        weights and fp32 scales keep their dtypes)."""
        device = next(model.parameters()).device
        for path, q in self.linears.items():
            owner, _, name = path.rpartition(".")  # owner "" for a top-level weight (a draft's main_proj)
            module = model.get_submodule(owner)
            delattr(module, name)
            setattr(module, name, q.to(device))
        for path, experts in self.experts.items():
            moe = model.get_submodule(path)
            del moe.w13, moe.w2
            moe.experts = experts.to(device)


def _check_experts_agree(layer: str, desc: QuantDescription, n_experts: int) -> None:
    """Every routed expert of `layer` (`layers.N`, or a draft's `mtp.N`) has expert 0's scheme, as the description
    says (loaders pick the kernel by expert 0: a disagreeing expert would silently run the wrong math)."""
    first = desc.scheme_of(f"{layer}.ffn.experts.0.w1")
    for e in range(n_experts):
        for proj in ("w1", "w3", "w2"):
            name = f"{layer}.ffn.experts.{e}.{proj}"
            scheme = desc.scheme_of(name)
            if scheme != first:
                raise CheckpointError(f"{name} is {scheme} but expert 0 is {first}: every routed expert of a layer "
                                      "must share one scheme")
    if first not in DYNAMIC_SCHEMES:
        raise CheckpointError(f"{layer}.ffn.experts are {first}: routed experts must be one of "
                              f"{list(DYNAMIC_SCHEMES)}")


def _stack(layer: str, experts: dict[tuple[int, str], QuantLinear], n_experts: int) -> QuantExperts:
    """One layer's routed experts (`layer` is `layers.N.ffn`), stacked."""
    for e in range(n_experts):
        for proj in ("w1", "w3", "w2"):
            if (e, proj) not in experts:
                raise CheckpointError(f"checkpoint is missing {layer}.experts.{e}.{proj}.weight")
    return QuantExperts.stack([experts[(e, "w1")] for e in range(n_experts)],
                              [experts[(e, "w3")] for e in range(n_experts)],
                              [experts[(e, "w2")] for e in range(n_experts)])
