"""`Attention`: DSV4 multi-query attention on one shared K=V latent, over the paged cache.

A query at position p attends to the raw latents of its window `[p - W + 1, p]` and, on compressed layers, to
compressed entries (HCA: every visible one; CSA: the indexer's pick), with a per-head sink logit that takes
probability mass but adds no value. The output's rope channels are rotated back by `-p` before the grouped
low-rank output projection.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pdspark.cache.kv_pools import LayerCache
from pdspark.engine.forward_batch import CompressedIndex, ForwardBatch
from pdspark.model.compressor import Compressor
from pdspark.model.indexer import Indexer
from pdspark.model.model_config import CSA, HCA, ModelConfig
from pdspark.model.norm import RMSNorm, rms_norm
from pdspark.model.rope import RopeAt, RotaryTable


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_type: str, rope: RotaryTable):
        super().__init__()
        D, H, d = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim
        self.n_heads, self.head_dim, self.o_groups = H, d, cfg.o_groups
        self.eps = cfg.rms_norm_eps
        self.scale = d**-0.5
        self.layer_type = layer_type
        self.wq_a = nn.Parameter(torch.zeros(cfg.q_lora_rank, D))
        self.q_norm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
        self.wq_b = nn.Parameter(torch.zeros(H * d, cfg.q_lora_rank))
        self.wkv = nn.Parameter(torch.zeros(d, D))
        self.kv_norm = RMSNorm(d, cfg.rms_norm_eps)
        # Grouped output projection: each of `o_groups` head groups maps `H*d/G -> o_lora_rank` on its own.
        self.wo_a = nn.Parameter(torch.zeros(cfg.o_groups * cfg.o_lora_rank, H * d // cfg.o_groups))
        self.wo_b = nn.Parameter(torch.zeros(D, cfg.o_groups * cfg.o_lora_rank))
        self.attn_sink = nn.Parameter(torch.zeros(H))
        self.compressor: Compressor | None = None
        self.indexer: Indexer | None = None
        if layer_type == CSA:
            self.compressor = Compressor(D, d, cfg.csa_ratio, True, cfg.rms_norm_eps, rope)
            self.indexer = Indexer(cfg, rope)
        elif layer_type == HCA:
            self.compressor = Compressor(D, d, cfg.hca_ratio, False, cfg.rms_norm_eps, rope)

    def project_kv(self, x: torch.Tensor, rope_at: RopeAt) -> torch.Tensor:
        """The raw K=V latent `[T, d]` of each token (normalised and rotated), as written to the SWA pool."""
        return rope_at.apply(self.kv_norm(F.linear(x, self.wkv)))

    def forward(self, x: torch.Tensor, batch: ForwardBatch, cache: LayerCache, rope_at: RopeAt) -> torch.Tensor:
        """`x [T, D]` -> `[T, D]`. `rope_at` holds this layer's rotation factors at the batch positions."""
        q, qr = self.project_q(x, rope_at)
        cache.swa_kv[batch.swa_slots] = self.project_kv(x, rope_at)
        compressed = self._update_compressed(x, qr, batch, cache, rope_at)
        return self.project_out(self.attend(q, cache, batch, compressed), rope_at)

    def project_q(self, x: torch.Tensor, rope_at: RopeAt) -> tuple[torch.Tensor, torch.Tensor]:
        """`x [T, D]` -> `(q [T, H, d] normalised and rotated, qr [T, q_lora] (the indexer reuses it))`."""
        qr = self.q_norm(F.linear(x, self.wq_a))
        q = rms_norm(F.linear(qr, self.wq_b).view(x.shape[0], self.n_heads, self.head_dim), None, self.eps)
        return rope_at.apply(q), qr

    def project_out(self, o: torch.Tensor, rope_at: RopeAt) -> torch.Tensor:
        """Un-rotate `o [T, H, d]` and apply the grouped output projection -> `[T, D]`."""
        T = o.shape[0]
        o = rope_at.apply(o, inverse=True)
        # [T, H, d] -> [G, T, H*d/G] @ [G, H*d/G, o_lora] -> [T, G * o_lora]
        grouped = o.reshape(T, self.o_groups, -1).transpose(0, 1)
        w = self.wo_a.view(self.o_groups, -1, grouped.shape[-1]).transpose(1, 2)
        o = torch.bmm(grouped, w).transpose(0, 1).reshape(T, -1)
        return F.linear(o, self.wo_b)

    def _update_compressed(
        self, x: torch.Tensor, qr: torch.Tensor, batch: ForwardBatch, cache: LayerCache, rope_at: RopeAt
    ) -> CompressedIndex | None:
        """Write this step's closed groups and return the compressed entries each query attends to."""
        if self.compressor is None:
            return None
        if self.indexer is not None:
            assert batch.csa_plan is not None
            self.compressor.run(x, batch.positions, batch.csa_plan, cache.comp_state, cache.comp_kv)
            self.indexer.compressor.run(x, batch.positions, batch.csa_plan, cache.index_state, cache.index_kv)
            return self.indexer.select(x, qr, batch, cache.index_kv, rope_at)
        assert batch.hca_plan is not None
        self.compressor.run(x, batch.positions, batch.hca_plan, cache.comp_state, cache.comp_kv)
        return batch.hca

    def attend(
        self, q: torch.Tensor, cache: LayerCache, batch: ForwardBatch, compressed: CompressedIndex | None
    ) -> torch.Tensor:
        """Each query over its window and compressed entries: `q [T, H, d]` -> `[T, H, d]`."""
        kv = cache.swa_kv[batch.window.rows]  # [T, W, d]
        valid = batch.window.valid
        if compressed is not None and compressed.max_visible:
            kv = torch.cat([kv, cache.comp_kv[compressed.rows]], dim=1)  # [T, W + K, d]
            valid = torch.cat([valid, compressed.valid], dim=1)
        return sink_attention(q, kv, valid, self.attn_sink, self.scale)


def sink_attention(
    q: torch.Tensor, kv: torch.Tensor, valid: torch.Tensor, sink: torch.Tensor, scale: float
) -> torch.Tensor:
    """Softmax attention on a shared K=V latent with a per-row sink logit that takes mass but adds no value.

    Args:
        q: `[M, Q, d]` query rows of M independent groups (a token's heads, or a draft block's rows x heads).
        kv: `[M, K, d]` keys (= values) each group sees.
        valid: `[M, K]` which keys are real.
        sink: `[Q]` sink logit per query row.
    Returns:
        `[M, Q, d]`.
    """
    scores = torch.bmm(q, kv.transpose(1, 2)) * scale  # [M, Q, K]
    scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
    sinks = sink.to(scores.dtype).view(1, -1, 1).expand(q.shape[0], -1, 1)
    logits = torch.cat([scores, sinks], dim=-1)
    logits = logits - logits.amax(dim=-1, keepdim=True)
    probs = torch.softmax(logits, dim=-1)[..., :-1]
    return torch.bmm(probs.to(kv.dtype), kv)
