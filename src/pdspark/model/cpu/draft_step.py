"""`DraftStep`: a DSpark proposal's draft forward (every stage and the head) as one C call
(`hardware.cpu.kernels.draft_block`).

The prepared module path (`DSparkDraft.block_hidden` + `base_logits`) is ~180 small ATen ops and ~26 C calls per
proposal, each costing more in dispatch than in arithmetic at a block of gamma rows. Here the weights of every stage
and of the head are laid out once as a table of pointers (they are final after `prepare_inference`), and a proposal
is one call with the same steps in the same order as `DraftStage.forward_prepared`; its matmuls become loops that
read each weight row once for all the block's rows (fused multiply-adds where the CPU has them). Summation orders
differ from BLAS, so the logits match the module path to ~1e-6 of their scale, not bit for bit
(`tests/unit/test_draft_step.py`); verification keeps the committed tokens the target's either way. Two entry
points, each returning None where it does not apply (the package's contract, `model.cpu`): `try_logits` (a
proposal's base logits) and `try_inject` (context rows written to the draft's pool; True where it wrote them).
Drafts it does not cover (routed-MoE stages, other dtypes or devices, quantized weights) keep the module path: the
drafter logs why once and counts each such forward (`pdspark_engine_fast_path_fallback_steps_total{reason="draft"}`).
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import numpy as np
import torch

from pdspark.hardware.cpu import kernel_abi
from pdspark.hardware.cpu import kernels as cpu_kernels
from pdspark.model.dspark import DraftStage, DSparkDraft
from pdspark.model.moe import SharedExpert


class DraftTable(NamedTuple):
    """The draft's arrays for `draft_block`, in the slots of `kernels.DRAFT_*`."""

    weights: torch.Tensor  # [stages * len(DRAFT_STAGE_WEIGHTS) + len(DRAFT_HEAD_WEIGHTS)] int64 data pointers
    sizes: torch.Tensor  # int32
    scalars: torch.Tensor  # fp32
    keep: tuple[torch.Tensor, ...]  # the tensors behind the pointers, held while the table lives
    injects: bool  # the context rows' weights are in the table too (`draft_inject`; not for a quantized main_proj)


def _fp32(t: object) -> torch.Tensor | None:
    """`t` when it is a contiguous fp32 CPU tensor (what the C loops read), else None."""
    if isinstance(t, torch.Tensor) and t.is_cpu and t.dtype is torch.float32 and t.is_contiguous():
        return t.detach()
    return None


def _single(fused: object) -> torch.Tensor | None:
    """The one stacked fp32 matrix of a `FusedLinear` (None: not fused, or in more than one group)."""
    groups = getattr(fused, "groups", None)
    if groups is None or len(groups) != 1:
        return None
    return _fp32(groups[0][1])


def _stage_weights(stage: DraftStage) -> dict[str, torch.Tensor | None] | str:
    attn, ffn = stage.attn, stage.ffn
    frozen = (stage.attn_hc._frozen, stage.ffn_hc._frozen)
    if not isinstance(ffn, SharedExpert):
        return "its stages have routed experts (the C draft block runs one shared expert a stage)"
    if None in frozen:
        return "its stages are not prepared for inference (`prepare_inference` not run)"
    if attn.compressor is not None:
        return "its stages compress their context (the C draft block attends a sliding window only)"
    return {
        "attn_fn": frozen[0][0], "attn_scale": frozen[0][1], "attn_base": frozen[0][2],  # type: ignore[index]
        "ffn_fn": frozen[1][0], "ffn_scale": frozen[1][1], "ffn_base": frozen[1][2],  # type: ignore[index]
        "attn_norm": stage.attn_norm.weight, "ffn_norm": stage.ffn_norm.weight,
        "wx": _single(attn.fused_x), "q_norm": attn.q_norm.weight, "wq_b": attn.wq_b,
        "kv_norm": attn.kv_norm.weight, "sink": attn.attn_sink, "wo_a": attn.wo_a, "wo_b": attn.wo_b,
        "gate_up": _single(stage.gate_up), "down": ffn.w2,
    }


def _stage_numbers(stage: DraftStage, draft: DSparkDraft) -> tuple[dict[str, int], dict[str, float]]:
    cfg, attn = draft.cfg, stage.attn
    assert isinstance(stage.ffn, SharedExpert)
    hh = draft.hc_head
    sizes = {
        "stages": len(draft.draft_stages), "gamma": draft.dcfg.gamma, "mask_id": draft.dcfg.mask_token_id,
        "hc": cfg.hc_mult, "iters": stage.attn_hc.sinkhorn_iters, "hidden": cfg.hidden_size,
        "q_lora": attn.wq_b.shape[1], "heads": attn.n_heads, "head_dim": attn.head_dim, "o_groups": attn.o_groups,
        "o_lora": attn.wo_a.shape[0] // attn.o_groups, "inter": stage.ffn.w2.shape[1],
        "vocab": draft.vocab[1].shape[0], "rope_dim": draft.rope.cos.shape[1],
        "features": draft.main_proj.shape[1] if isinstance(draft.main_proj, torch.Tensor) else 0,
    }
    scalars = {
        "hc_eps": stage.attn_hc.hc_eps, "hc_norm_eps": stage.attn_hc.norm_eps, "attn_norm_eps": stage.attn_norm.eps,
        "ffn_norm_eps": stage.ffn_norm.eps, "q_eps": attn.q_norm.eps, "head_eps": attn.eps,
        "kv_eps": attn.kv_norm.eps, "scale": attn.scale, "limit": stage.ffn.limit, "head_hc_eps": hh.hc_eps,
        "head_norm_eps": hh.norm_eps, "norm_eps": draft.norm.eps, "main_norm_eps": draft.main_norm.eps,
    }
    return sizes, scalars


# The matrices `draft_block` and `draft_inject` read through `gemm_rows`.
_STAGE_MATRICES = ("wx", "wq_b", "wo_a", "wo_b", "gate_up", "down")
_HEAD_MATRICES = ("head", "main_proj", "latents")


def draft_table(draft: DSparkDraft) -> DraftTable | str:
    """The table of a prepared draft, or why it has none: some weight is not a plain fp32 CPU tensor (a compact
    draft's FP8 linears), a stage the C block does not run, the stages' numbers differ (the C call reads one set of
    sizes and scalars for every stage)."""
    stages = draft.draft_stages
    if not stages or len(stages) != len(draft.stages):
        return "it has no draft stages laid out for inference"
    per_stage = [_stage_weights(s) for s in stages]
    odd = next((w for w in per_stage if isinstance(w, str)), None)
    if odd is not None:
        return odd
    if not all(isinstance(w, torch.Tensor) for s in stages for w in (s.attn.wq_b, s.attn.wo_a, s.attn.wo_b)):
        return "its attention projections are FP8 linears (a released checkpoint's draft held compact)"
    numbers = [_stage_numbers(s, draft) for s in stages]
    if any(n != numbers[0] for n in numbers) or stages[0].ffn_hc.hc_eps != stages[0].attn_hc.hc_eps or \
            stages[0].ffn_hc.norm_eps != stages[0].attn_hc.norm_eps:
        return "its stages differ in sizes or epsilons (the C block reads one set for every stage)"
    hh = draft.hc_head
    head: dict[str, object] = {
        "embed": draft.vocab[0], "hc_fn": hh.fn, "hc_scale": hh.scale, "hc_base": hh.base,
        "norm": draft.norm.weight, "head": draft.vocab[1], "rope_cos": draft.rope.cos, "rope_sin": draft.rope.sin,
    }
    checked = [{k: _fp32(v) for k, v in w.items()} for w in per_stage]  # type: ignore[union-attr]
    checked_head = {k: _fp32(v) for k, v in head.items()}
    tensors = [v for w in checked for v in w.values()] + list(checked_head.values())
    if any(v is None for v in tensors):
        return "some weight is not a contiguous fp32 CPU tensor (fused bf16 or FP8 matrices, another device)"
    inject = {"main_proj": _fp32(draft.main_proj), "main_norm": _fp32(draft.main_norm.weight),
              "latents": _single(draft._stage_latents)}
    injects = None not in inject.values()
    if injects:
        tensors += list(inject.values())
        checked_head |= inject
    else:  # (a quantized main_proj): the context rows keep the module path
        checked_head |= dict.fromkeys(inject, torch.empty(0))
    # The matrices as bf16 bits when every one holds bf16 numbers (a checkpoint's do): `gemm_rows`'s arithmetic on
    # half the bytes (`gemm.c`, `gemm_rows_h`). The embedding, norms, mixes, sinks and rotary tables stay fp32.
    halves = [{k: cpu_kernels.bf16_copy(v) for k, v in w.items() if k in _STAGE_MATRICES and v is not None}
              for w in checked]
    head_halves = {k: cpu_kernels.bf16_copy(v) for k, v in checked_head.items()
                   if k in _HEAD_MATRICES and v is not None and v.numel()}
    bf16 = all(v is not None for h in [*halves, head_halves] for v in h.values())
    if bf16:
        checked = [w | h for w, h in zip(checked, halves)]
        checked_head |= head_halves
        tensors += [v for h in [*halves, head_halves] for v in h.values()]
    pointers = [w[n].data_ptr() for w in checked for n in kernel_abi.DRAFT_STAGE_WEIGHTS]  # type: ignore[union-attr]
    pointers += [checked_head[n].data_ptr() for n in kernel_abi.DRAFT_HEAD_WEIGHTS]  # type: ignore[union-attr]
    sizes, scalars = numbers[0]
    sizes = {**sizes, "bf16": int(bf16)}
    return DraftTable(
        torch.tensor(pointers, dtype=torch.int64),
        torch.tensor([sizes[n] for n in kernel_abi.DRAFT_SIZES], dtype=torch.int32),
        torch.tensor([scalars[n] for n in kernel_abi.DRAFT_SCALARS], dtype=torch.float32),
        tuple(v for v in tensors if v is not None),
        injects,
    )


class DraftStep:
    """The draft's table and the C paths that use it (`try_logits`, `try_inject`)."""

    def __init__(self, table: DraftTable, gamma: int, vocab: int, max_len: int):
        self.table = table
        self.gamma, self.vocab, self.max_len = gamma, vocab, max_len
        self.scratch = torch.empty(0)

    @classmethod
    def build(cls, draft: DSparkDraft) -> DraftStep | str:
        """The draft's C step, or why there is none (see `draft_table`, or no C kernels here)."""
        if cpu_kernels.load() is None:
            return "no C kernels (PDSPARK_NO_C_KERNELS=1, or they could not be built: see the log above)"
        table = draft_table(draft)
        if isinstance(table, str):
            return table
        return cls(table, draft.dcfg.gamma, draft.vocab[1].shape[0], draft.rope.cos.shape[0])

    @staticmethod
    def pool_table(pool: torch.Tensor) -> np.ndarray | None:
        """`[stages, 2]` int64: each stage's context pool pointer and row stride (floats), from the draft's pool
        `[stages, rows, d]`; None where a stage's rows are not fp32 row-major CPU rows."""
        if not (pool.is_cpu and pool.dtype is torch.float32 and pool.dim() == 3 and pool.stride(2) == 1):
            return None
        return np.array([[pool[s].data_ptr(), pool.stride(1)] for s in range(pool.shape[0])], dtype=np.int64)

    def try_inject(self, features: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                   pools: np.ndarray | None) -> Literal[True] | None:
        """Write the context rows of `features [N, F]` at `positions [N]` to the rows `slots [N]` of the pools
        (`pool_table`) -> True; None (nothing written) where the C path does not apply: no pool table, a quantized
        `main_proj`, features or indices not what the C loop reads, positions outside the rotary table."""
        ok = (self.table.injects and _fp32(features) is not None and features.dim() == 2
              and features.shape[1] == int(self.table.sizes[kernel_abi.DRAFT_SIZES.index("features")]))
        for t in (positions, slots):
            ok = ok and t.is_cpu and t.dtype is torch.int64 and t.is_contiguous() and t.shape == features.shape[:1]
        if not ok or pools is None or int(positions.max()) >= self.max_len or int(positions.min()) < 0:
            return None
        sizes = self.table.sizes.tolist()
        r, D, HD, S = (sizes[kernel_abi.DRAFT_SIZES.index(n)] for n in ("rope_dim", "hidden", "head_dim", "stages"))
        need = features.shape[0] * (2 * r + D + S * HD) + HD + 80
        if self.scratch.numel() < need:
            self.scratch = torch.empty(2 * need)
        cpu_kernels.draft_inject(self.table.weights, self.table.sizes, self.table.scalars, features, positions,
                                 pools.ctypes.data, slots, self.scratch)
        return True

    def try_logits(self, anchors: np.ndarray, anchor_pos: np.ndarray, pools: np.ndarray | None, rows: np.ndarray,
                   valid: np.ndarray) -> torch.Tensor | None:
        """Base logits `[M, G, V]` fp32 of M blocks: `anchors`, `anchor_pos [M]`; block m's context rows
        `rows [M, W]` of the pools (`pool_table`) where `valid [M, W]`. None where there is no pool table or no
        block, or a block runs past the rotary table (the module path raises the error)."""
        M, W = rows.shape
        if pools is None or M == 0 or int(anchor_pos.max()) + self.gamma > self.max_len or int(anchor_pos.min()) < 0:
            return None
        host = [np.ascontiguousarray(anchors, dtype=np.int64), np.ascontiguousarray(anchor_pos, dtype=np.int64),
                np.ascontiguousarray(rows, dtype=np.int64), np.ascontiguousarray(valid, dtype=np.bool_)]
        need = cpu_kernels.draft_scratch_floats(self.table.sizes, M, W)
        if self.scratch.numel() < need:
            self.scratch = torch.empty(2 * need)  # persistent: reused by every proposal
        out = torch.empty(M * self.gamma, self.vocab)
        t = self.table
        cpu_kernels.draft_block(t.weights, t.sizes, t.scalars, host[0].ctypes.data, host[1].ctypes.data, M,
                                pools.ctypes.data, host[2].ctypes.data, host[3].ctypes.data, W, self.scratch, out)
        return out.view(M, self.gamma, self.vocab)
