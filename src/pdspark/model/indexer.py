"""`Indexer`: CSA's lightning indexer, which picks the compressed entries each query attends to.

`I[t, g] = sum_h relu(q_idx[t, h] . K_idx[g]) * dim^-0.5 * w[t, h]`, `w = weights_proj(x) * heads^-0.5`, over the
entries visible to the query (`g < (pos + 1) // ratio`). The indexer keeps its own compressed keys, made by its
own overlapping compressor.

Tie rule: entries are ranked by score, highest first; equal scores rank the lower (older) entry first. ReLU makes
exact ties at 0 common, so the rule is part of the model's definition here (a stable descending sort).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pdspark.model.batch import CompressedIndex, ForwardBatch, gather_rows
from pdspark.model.compressor import Compressor
from pdspark.model.model_config import ModelConfig
from pdspark.model.rope import RopeAt, RotaryTable


def select_topk(scores: torch.Tensor, valid: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-`k` columns of `scores [T, V]` under the tie rule; returns `(columns [T, k], valid [T, k])`."""
    masked = scores.masked_fill(~valid, float("-inf"))
    order = torch.sort(masked, dim=-1, descending=True, stable=True).indices[:, :k]
    return order, valid.gather(1, order)


class Indexer(nn.Module):
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
        q = rope_at.apply(F.linear(qr, self.wq_b).view(T, self.n_heads, self.dim)).float()  # [T, Hi, Di]
        w = head_w.float() * self.n_heads**-0.5  # [T, Hi]
        out = torch.full((T, csa.max_visible), float("-inf"))
        g = batch.gather_rows if batch.segments else None
        if g is None or g.numel():
            rows = csa.rows if g is None else csa.rows[g]
            keys = gather_rows(index_kv, rows).float()  # [Tg, V, Di]: each query's candidates
            dots = torch.bmm(q if g is None else q[g], keys.transpose(1, 2))  # [Tg, Hi, V]
            part = (F.relu(dots) * self.dim**-0.5 * (w if g is None else w[g])[:, :, None]).sum(dim=1)
            if g is None:
                out = part
            else:
                out[g] = part
        for seg in batch.segments:
            last = seg.offset + seg.length - 1
            V = min(csa.max_visible, (seg.start + seg.length) // self.compressor.ratio)
            keys = gather_rows(index_kv, csa.rows[last, :V]).float()  # [V, Di]: shared by the whole segment
            sl = slice(seg.offset, last + 1)
            dots = torch.mm(q[sl].reshape(-1, self.dim), keys.t()).view(seg.length, self.n_heads, V)
            out[sl, :V] = (F.relu(dots) * self.dim**-0.5 * w[sl][:, :, None]).sum(dim=1)
        return out

    def select(
        self, head_w: torch.Tensor, qr: torch.Tensor, batch: ForwardBatch, index_kv: torch.Tensor, rope_at: RopeAt
    ) -> CompressedIndex:
        """The compressed entries each query attends to, as a mask over its visible entries (all of them when at
        most `topk` are visible)."""
        csa = batch.csa
        assert csa is not None
        if csa.max_visible <= self.topk:
            return csa
        cols, ok = select_topk(self.scores(head_w, qr, rope_at, batch, index_kv), csa.valid, self.topk)
        picked = torch.zeros_like(csa.valid).scatter_(1, cols, ok)
        return CompressedIndex(csa.rows, picked, csa.max_visible)
