"""`Indexer`: CSA's lightning indexer, which picks the compressed entries each query attends to.

`I[t, g] = sum_h relu(q_idx[t, h] . K_idx[g]) * dim^-0.5 * w[t, h]`, `w = weights_proj(x) * heads^-0.5`, over the
entries visible to the query (`g < (pos + 1) // ratio`). The indexer keeps its own compressed keys, made by its
own overlapping compressor.

Tie rule: entries are ranked by score, highest first; equal scores rank the lower (older) entry first. ReLU makes
exact ties at 0 common, so the rule is part of the model's definition here (a stable descending sort).

NOTE: one scoring routine, `index_scores`, serves every path (a prefill chunk sharing its keys, decode tokens
gathering their own), and its arithmetic does not depend on how many queries or entries a call holds. A BLAS
matmul picks its kernel (and so its rounding) by shape, and a near-tie at the top-k cut then went one way in a
one-shot prefill and the other way when the same position was decoded.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from pdspark.hardware.cpu import kernels as cpu_kernels
from pdspark.model.batch import CompressedIndex, ForwardBatch, Segment, gather_rows
from pdspark.model.blocked_rows import BlockedRows
from pdspark.model.compressor import Compressor
from pdspark.model.model_config import ModelConfig
from pdspark.model.packed_rows import PackedRows
from pdspark.model.rope import RopeAt, RotaryTable
from pdspark.quant.kv_fp8 import IndexRowPack
from pdspark.quant.quant_linear import linear


class TopK(NamedTuple):
    """The `k` best-ranked columns of each row of a score matrix."""

    columns: torch.Tensor  # [T, k] column indices, best first
    valid: torch.Tensor  # [T, k] bool: the column is a real entry (rows with fewer than k entries pad with invalid)


def select_topk(scores: torch.Tensor, valid: torch.Tensor, k: int) -> TopK:
    """Top-`k` columns of `scores [T, V]` under the tie rule, among the `valid [T, V]` ones."""
    masked = scores.masked_fill(~valid, float("-inf"))
    order = torch.sort(masked, dim=-1, descending=True, stable=True).indices[:, :k]
    return TopK(order, valid.gather(1, order))


def index_scores(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, scale: float) -> torch.Tensor:
    """`out[t, g] = sum_h relu(q[t, h] . keys[t, g]) * scale * w[t, h]` -> `[T, V]` fp32.

    `q [T, H, D]` and `w [T, H]` fp32; `keys [T, V, D]` (each query its own candidates) or `[V, D]` (shared by all
    queries). Each dot product is summed in channel order and the heads in head order, with plain fp32 adds: a
    score depends only on its own query and key, never on the shapes around them. The C kernel does exactly these
    operations, faster.
    """
    if not torch.is_grad_enabled():
        fused = cpu_kernels.index_scores(q, w, keys, scale)
        if fused is not None:
            return fused
    T, H, D = q.shape
    keys_t = keys.transpose(-1, -2)  # [T, D, V] or [D, V]
    if keys_t.dim() == 2:
        keys_t = keys_t[None]
    dots = q.new_zeros(T, H, keys.shape[-2])  # [T, H, V]
    for d in range(D):  # one elementwise product and add per channel: no reduction kernel chooses the order
        dots = dots + q[:, :, d, None] * keys_t[:, None, d, :]
    terms = torch.where(dots > 0, dots, 0.0) * scale * w[:, :, None]  # [T, H, V]
    out = q.new_zeros(T, keys.shape[-2])
    for h in range(H):
        out = out + terms[:, h]
    return out


class Indexer(nn.Module):
    mm = staticmethod(F.linear)  # the float matmul (`DSV4Model.prepare_inference`: batch-invariant mode)

    def __init__(self, cfg: ModelConfig, rope: RotaryTable):
        super().__init__()
        self.n_heads, self.dim, self.topk = cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk
        self.wq_b = nn.Parameter(torch.zeros(self.n_heads * self.dim, cfg.q_lora_rank))
        self.weights_proj = nn.Parameter(torch.zeros(self.n_heads, cfg.hidden_size))
        self.compressor = Compressor(cfg.hidden_size, self.dim, cfg.csa_ratio, True, cfg.rms_norm_eps, rope)

    def scores(self, head_w: torch.Tensor, qr: torch.Tensor, rope_at: RopeAt, batch: ForwardBatch,
               index_kv: torch.Tensor) -> torch.Tensor:
        """Index scores `[T, V]` fp32 of every query against its request's entries (-inf beyond the entries).
        `head_w = x @ weights_proj.T [T, Hi]`."""
        csa = batch.csa
        assert csa is not None
        T = qr.shape[0]
        q, w = self._queries(head_w, qr, rope_at)  # [T, Hi, Di], [T, Hi]
        scale = self.dim**-0.5
        out = torch.full((T, csa.max_visible), float("-inf"), device=q.device)
        g = batch.gather_rows if batch.segments else None
        if g is None or g.numel():
            rows = csa.rows if g is None else csa.rows[g]
            keys = gather_rows(index_kv, rows).float()  # [Tg, V, Di]: each query's candidates
            part = index_scores(q if g is None else q[g], w if g is None else w[g], keys, scale)
            if g is None:
                out = part
            else:
                out[g] = part
        for seg in batch.segments:
            sl, last, V = self._segment_entries(csa, seg)
            keys = gather_rows(index_kv, csa.rows[last, :V]).float()  # [V, Di]: shared by the whole segment
            out[sl, :V] = index_scores(q[sl], w[sl], keys, scale)
        return out

    def _segment_entries(self, csa: CompressedIndex, seg: Segment) -> tuple[slice, int, int]:
        """A prefill segment's token rows, its last row (whose entry rows the segment shares) and how many entries
        its queries may see at most (its last query's visible count)."""
        last = seg.offset + seg.length - 1
        visible = min(csa.max_visible, (seg.start + seg.length) // self.compressor.ratio)
        return slice(seg.offset, last + 1), last, visible

    def _queries(self, head_w: torch.Tensor, qr: torch.Tensor, rope_at: RopeAt) -> tuple[torch.Tensor, torch.Tensor]:
        """Index queries `[T, Hi, Di]` and head weights `[T, Hi]`, fp32."""
        q = rope_at.apply(linear(qr, self.wq_b, self.mm).view(qr.shape[0], self.n_heads, self.dim)).float()
        return q, head_w.float() * self.n_heads**-0.5

    def _pick_in_c(self, head_w: torch.Tensor, qr: torch.Tensor, rope_at: RopeAt, batch: ForwardBatch,
                   index_kv: torch.Tensor) -> CompressedIndex | None:
        """`select`'s picked entries in C (the same scores and tie rule), keys read in place from the pool; None where
        the C path does not apply. Tokens that gather their own entries (decode, verify) pick one by one into a mask
        (`picked_entries` makes it rows); the queries of a prefill segment share their entries and pick together,
        straight into rows (`index_pick_shared`: no `[T, V]` scores or mask, on every kernel thread)."""
        csa = batch.csa
        assert csa is not None
        q, w = self._queries(head_w, qr, rope_at)
        w, scale, k = w.contiguous(), self.dim**-0.5, self.topk
        keys, layout = pool_keys(index_kv)
        if not batch.segments:
            picked = cpu_kernels.index_pick(q, w, keys, csa.rows, csa.valid, scale, k, layout=layout)
            return None if picked is None else picked_entries(csa, picked, k)
        T = q.shape[0]
        rows, valid = torch.zeros(T, k, dtype=torch.int64), torch.zeros(T, k, dtype=torch.bool)
        g = batch.gather_rows  # (with segments: the other tokens' rows)
        if g is not None and g.numel():
            picked = cpu_kernels.index_pick(q[g], w[g], keys, csa.rows[g], csa.valid[g], scale, k, layout=layout)
            if picked is None:
                return None
            few = picked_entries(CompressedIndex(csa.rows[g], csa.valid[g], csa.max_visible), picked, k)
            rows[g], valid[g] = few.rows, few.valid
        for seg in batch.segments:
            sl, last, V = self._segment_entries(csa, seg)
            part = cpu_kernels.index_pick_shared(q[sl], w[sl], keys, csa.rows[last, :V].contiguous(),
                                                 csa.valid[sl, :V].contiguous(), scale, k, layout=layout)
            if part is None:
                return None
            rows[sl], valid[sl] = part
        return CompressedIndex(rows, valid, k, picked=True)

    def select(
        self, head_w: torch.Tensor, qr: torch.Tensor, batch: ForwardBatch, index_kv: torch.Tensor, rope_at: RopeAt
    ) -> CompressedIndex:
        """The compressed entries each query attends to: all visible ones when at most `topk` are; else its `topk`
        picked ones (`picked_entries`), for decode and verify tokens and prefill segments alike (a prefill query
        then attends to `topk` compressed rows instead of a mask over every visible one: O(topk), not O(context))."""
        csa = batch.csa
        assert csa is not None
        if csa.max_visible <= self.topk:
            return csa
        if not torch.is_grad_enabled():
            fast = self._pick_in_c(head_w, qr, rope_at, batch, index_kv)
            if fast is not None:
                return fast
        scores = self.scores(head_w, qr, rope_at, batch, index_kv)
        # (In C: the same picks in O(V) a query; a sort of every query's scores dominated long prefills.)
        picked = None if torch.is_grad_enabled() else cpu_kernels.topk_mask(scores, csa.valid, self.topk)
        if picked is None:
            top = select_topk(scores, csa.valid, self.topk)
            picked = torch.zeros_like(csa.valid).scatter_(1, top.columns, top.valid)
        return picked_entries(csa, picked, self.topk)


def pool_keys(index_kv: torch.Tensor) -> tuple[torch.Tensor, str]:
    """What the C picks read of a layer's key pool, and how it holds its rows (`kernels.index_pick`'s layout): the
    FP8 cache's packed rows (decoded as the C pick reads them: the same floats), fp32 rows in blocks (`BlockedRows`),
    or the rows themselves."""
    if isinstance(index_kv, PackedRows) and isinstance(index_kv.pack, IndexRowPack):
        return index_kv.storage, "packed"
    if isinstance(index_kv, BlockedRows):
        return index_kv.blocks, "blocked"
    return index_kv, "rows"


def picked_entries(csa: CompressedIndex, picked: torch.Tensor, k: int) -> CompressedIndex:
    """Each query's picked entries (`picked [T, V]`, at most `k` a row) as entries of their own `[T, k]`, in entry
    order (the order attention reads a mask in), invalid padding after them: a decode token's attention then reads
    `k` compressed rows whatever the context, instead of masking all `V` visible ones."""
    fast = cpu_kernels.picked_rows(csa.rows, picked, k)
    if fast is not None:
        return CompressedIndex(fast[0], fast[1], k, picked=True)
    order = torch.sort(picked.to(torch.uint8), dim=1, descending=True, stable=True).indices[:, :k]  # [T, k]
    return CompressedIndex(csa.rows.gather(1, order), picked.gather(1, order), k, picked=True)
