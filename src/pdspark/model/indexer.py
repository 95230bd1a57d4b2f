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

from pdspark.engine.forward_batch import CompressedIndex, ForwardBatch
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

    def scores(self, x: torch.Tensor, qr: torch.Tensor, rope_at: RopeAt, keys: torch.Tensor) -> torch.Tensor:
        """`keys [T, V, dim]` (each query's candidate keys) -> index scores `[T, V]` fp32."""
        T = x.shape[0]
        q = rope_at.apply(F.linear(qr, self.wq_b).view(T, self.n_heads, self.dim))
        dots = torch.bmm(q.float(), keys.float().transpose(1, 2))  # [T, H, V]
        dots = F.relu(dots) * self.dim**-0.5
        w = F.linear(x, self.weights_proj).float() * self.n_heads**-0.5  # [T, H]
        return (dots * w[:, :, None]).sum(dim=1)

    def select(
        self, x: torch.Tensor, qr: torch.Tensor, batch: ForwardBatch, index_kv: torch.Tensor, rope_at: RopeAt
    ) -> CompressedIndex:
        """The compressed entries each query attends to (all visible ones when at most `topk` are visible)."""
        csa = batch.csa
        assert csa is not None
        if csa.max_visible <= self.topk:
            return csa
        scores = self.scores(x, qr, rope_at, index_kv[csa.rows])
        cols, valid = select_topk(scores, csa.valid, self.topk)
        return CompressedIndex(csa.rows.gather(1, cols), valid, self.topk)
