"""Loading a DSpark drafter from the `mtp.*` tensors beside the target: one explicit name map.

| checkpoint                                  | `DSparkDraft` parameter                     |
|---------------------------------------------|---------------------------------------------|
| `mtp.{s}.<layer tensor>` (attn, hc, norms,   | `stages.{s}.<same mapping as target layers>` |
|   routed `ffn.gate/experts.*`)              |                                             |
| `mtp.{s}.ffn.w{1,2,3}.weight` (dense MLP)    | `stages.{s}.ffn.w{1,2,3}`                   |
| `mtp.0.main_proj.weight`, `mtp.0.main_norm.weight` | `main_proj`, `main_norm.weight`       |
| `mtp.{last}.norm.weight`, `mtp.{last}.hc_head_{fn,base,scale}` | `norm.weight`, `hc_head.*`  |
| `mtp.markov_head.{w1,embed}.weight`          | `markov_w1` `[V, r]`                        |
| `mtp.markov_head.{w2,head}.weight`           | `markov_w2` `[V, r]`                        |
| `mtp.embed.weight`, `mtp.head.weight`        | `embed`, `head` (drafts with their own vocab modules) |
| `mtp.confidence_head.*`                      | not loaded (no confidence-scheduled verify)  |

In a ModelSlim checkpoint a draft linear listed as quantized in `quant_model_description.json` loads as the
target's do (`quant_weights.QuantizedWeights`, through this map).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping

import torch

from pdspark.model.compact_weights import CompactWeights
from pdspark.model.dspark import DSparkDraft
from pdspark.model.quant_weights import QuantizedWeights
from pdspark.model.scaled_weights import Scaled
from pdspark.model.weights import Assigner, Piece, assign, check_complete, map_name
from pdspark.parallel.expert_shard import ExpertShard
from pdspark.quant.scheme import QuantDescription

logger = logging.getLogger(__name__)

_TOP = {
    "markov_head.w1.weight": "markov_w1",
    "markov_head.embed.weight": "markov_w1",
    "markov_head.w2.weight": "markov_w2",
    "markov_head.head.weight": "markov_w2",
    "embed.weight": "embed",
    "head.weight": "head",
}
_STAGE_EXTRA = {
    "main_proj.weight": "main_proj",
    "main_norm.weight": "main_norm.weight",
    "norm.weight": "norm.weight",
    "hc_head_fn": "hc_head.fn",
    "hc_head_base": "hc_head.base",
    "hc_head_scale": "hc_head.scale",
}
CONFIDENCE_HEAD = "mtp.confidence_head."
_DENSE_MLP = re.compile(r"^ffn\.(w[123])\.weight$")
_STAGE = re.compile(r"^(\d+)\.(.+)$")


def map_draft_name(name: str) -> Piece | None:
    if not name.startswith("mtp."):
        return None
    rest = name[len("mtp.") :]
    if rest in _TOP:
        return Piece(_TOP[rest])
    m = _STAGE.match(rest)
    if not m:
        return None
    stage, tail = m.group(1), m.group(2)
    if tail in _STAGE_EXTRA:
        return Piece(_STAGE_EXTRA[tail])
    dense = _DENSE_MLP.match(tail)
    if dense:
        return Piece(f"stages.{stage}.ffn.{dense.group(1)}")
    layer_piece = map_name(f"layers.{stage}.{tail}")
    if layer_piece is None:
        return None
    return Piece("stages." + layer_piece.param.removeprefix("layers."), layer_piece.expert, layer_piece.half)


def load_draft_weights(draft: DSparkDraft, tensors: Mapping[str, torch.Tensor | Scaled],
                       quant: QuantDescription | None = None, compact: bool = False) -> QuantizedWeights | None:
    """Fill `draft` from the checkpoint's `mtp.*` tensors; raises `CheckpointError` on any mismatch.

    With `quant` (a ModelSlim checkpoint's description), the linears it lists as quantized are returned as
    `QuantizedWeights`, to install once the draft is moved and cast. A draft tensor the description does not list is
    FLOAT: old ModelSlim output left the MTP entries out (vllm-ascend adds them by hand as FLOAT); an int8 one among
    them still fails, in `assign`. `compact`: a released checkpoint's draft read as stored (`Scaled` tensors: the
    loader's `weight_format="compact"`), built as the target is: FP8/MXFP4 weights installed as stored
    (`compact_weights.CompactWeights`), BF16 matrices kept BF16, into a draft built on the meta device."""
    # DSpark checkpoints trained with the confidence head carry it (`mtp.confidence_head.*`): it only feeds a
    # confidence-scheduled (ragged) verify, which pdspark does not run; every verify takes all the drafts.
    unused = sorted(n for n in tensors if n.startswith(CONFIDENCE_HEAD))
    if unused:
        logger.info("the draft's confidence head (%d tensors) is not used: every verify step takes all the drafts",
                    len(unused))
        tensors = {n: t for n, t in tensors.items() if not n.startswith(CONFIDENCE_HEAD)}
    skip = () if draft.dcfg.uses_own_vocab_modules else ("embed", "head")
    if compact:
        _load_compact(draft, tensors, skip)
        return None
    plain: dict[str, torch.Tensor] = {n: t for n, t in tensors.items() if isinstance(t, torch.Tensor)}
    quantized = None
    if quant is not None:
        names = {n for n in plain if quant.quantized_linear(n) is not None}
        quantized = QuantizedWeights.build({n: plain[n] for n in names}, quant, draft.dcfg.n_routed_experts,
                                           map_draft_name)
        plain = {n: t for n, t in plain.items() if n not in names}
    filled = assign(draft, plain, map_draft_name)
    check_complete(draft, filled | (quantized.filled if quantized else set()), draft.dcfg.n_routed_experts, skip=skip)
    return quantized


def _load_compact(draft: DSparkDraft, tensors: Mapping[str, torch.Tensor | Scaled], skip: tuple[str, ...]) -> None:
    compact = CompactWeights(ExpertShard.whole(max(draft.dcfg.n_routed_experts, 1)))
    into = Assigner(draft, map_draft_name, keep_bf16=True)
    for name, t in tensors.items():
        stored = t if isinstance(t, Scaled) else Scaled(t, None)
        piece = map_draft_name(name)
        if piece is None or not compact.take(name, piece, stored):
            into.put(name, stored.decoded())
    check_complete(draft, into.filled | compact.filled, draft.dcfg.n_routed_experts, skip=skip)
    compact.install(draft)
    for name, p in list(draft.named_parameters()):  # what `skip` let through: zeros, as a float draft starts
        if p.is_meta:
            owner, _, attr = name.rpartition(".")
            setattr(draft.get_submodule(owner), attr, torch.nn.Parameter(torch.zeros(p.shape, dtype=p.dtype),
                                                                         requires_grad=False))


def draft_state_dict(draft: DSparkDraft) -> dict[str, torch.Tensor]:
    """The draft's tensors under their checkpoint names (inverse of `map_draft_name`), for saving."""
    out: dict[str, torch.Tensor] = {}
    last = draft.dcfg.num_stages - 1
    inverse_top = {"markov_w1": "mtp.markov_head.w1.weight", "markov_w2": "mtp.markov_head.w2.weight",
                   "embed": "mtp.embed.weight", "head": "mtp.head.weight", "main_proj": "mtp.0.main_proj.weight",
                   "main_norm.weight": "mtp.0.main_norm.weight", "norm.weight": f"mtp.{last}.norm.weight",
                   "hc_head.fn": f"mtp.{last}.hc_head_fn", "hc_head.base": f"mtp.{last}.hc_head_base",
                   "hc_head.scale": f"mtp.{last}.hc_head_scale"}
    layer_names = _layer_checkpoint_names()
    for name, tensor in draft.state_dict().items():
        t = tensor.detach().contiguous()
        if name in inverse_top:
            out[inverse_top[name]] = t
            continue
        stage, tail = name.split(".", 2)[1:]
        prefix = f"mtp.{stage}."
        if not draft.dcfg.n_routed_experts and tail in ("ffn.w1", "ffn.w2", "ffn.w3"):
            out[f"{prefix}{tail}.weight"] = t  # dense MLP
        elif tail in ("ffn.w13", "ffn.w2") or tail.endswith("wkv_gate"):
            out.update(_split_stacked(prefix, tail, t))
        else:
            out[prefix + layer_names[tail]] = t
    return out


def _layer_checkpoint_names() -> dict[str, str]:
    from pdspark.model.weights import _PER_LAYER

    names = {}
    for ckpt, target in _PER_LAYER.items():
        if isinstance(target, str) and target not in names:
            names[target] = ckpt
    return names


def _split_stacked(prefix: str, tail: str, t: torch.Tensor) -> dict[str, torch.Tensor]:
    if tail.endswith("wkv_gate"):
        base = tail.removesuffix("wkv_gate")
        w = t.shape[0] // 2
        return {f"{prefix}{base}wkv.weight": t[:w].clone(), f"{prefix}{base}wgate.weight": t[w:].clone()}
    out = {}
    for e in range(t.shape[0]):
        if tail == "ffn.w2":
            out[f"{prefix}ffn.experts.{e}.w2.weight"] = t[e].clone()
        else:
            inter = t.shape[1] // 2
            out[f"{prefix}ffn.experts.{e}.w1.weight"] = t[e, :inter].clone()
            out[f"{prefix}ffn.experts.{e}.w3.weight"] = t[e, inter:].clone()
    return out
