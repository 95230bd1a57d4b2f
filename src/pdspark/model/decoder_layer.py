"""`DecoderLayer`: attention then MoE, each read from and written back to the mHC streams."""

from __future__ import annotations

import torch
from torch import nn

from pdspark.model.attention import Attention
from pdspark.model.batch import ForwardBatch, LayerCache
from pdspark.model.hyper_connection import HyperConnection
from pdspark.model.model_config import ModelConfig
from pdspark.model.moe import MoE, SharedExpert
from pdspark.model.norm import RMSNorm
from pdspark.model.rope import RopeAt, RotaryTable
from pdspark.parallel.expert_shard import ExpertShard


class DecoderLayer(nn.Module):
    """The mHC frame around an attention and an FFN (the DSpark draft's stages reuse it with their own parts)."""

    def __init__(self, cfg: ModelConfig, attn: Attention, ffn: MoE | SharedExpert):
        super().__init__()
        D = cfg.hidden_size
        self.attn_hc = HyperConnection(cfg.hc_mult, D, cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.rms_norm_eps)
        self.ffn_hc = HyperConnection(cfg.hc_mult, D, cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.rms_norm_eps)
        self.attn_norm = RMSNorm(D, cfg.rms_norm_eps)
        self.ffn_norm = RMSNorm(D, cfg.rms_norm_eps)
        self.attn = attn
        self.ffn = ffn

    @classmethod
    def target(cls, cfg: ModelConfig, layer_type: str, is_hash: bool, rope: RotaryTable,
               experts: ExpertShard | None = None) -> DecoderLayer:
        return cls(cfg, Attention(cfg, layer_type, rope), MoE(cfg, is_hash, experts))

    def forward(self, h: torch.Tensor, batch: ForwardBatch, cache: LayerCache, rope_at: RopeAt) -> torch.Tensor:
        """`h [T, hc, D]` -> `[T, hc, D]`."""
        x, post, comb = self.attn_hc.collapse(h, self.attn_norm)  # x: the normalised sublayer input
        h = HyperConnection.expand(self.attn(x, batch, cache, rope_at), h, post, comb)
        x, post, comb = self.ffn_hc.collapse(h, self.ffn_norm)
        return HyperConnection.expand(self.ffn(x, batch.input_ids), h, post, comb)
