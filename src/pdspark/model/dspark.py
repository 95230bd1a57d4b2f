"""`DSparkDraft`: DSpark's drafter. Stacked sliding-window DSV4 stages over injected target features, plus a
low-rank Markov head.

Data flow for one draft block of a request whose next token (the anchor) sits at position `a`:
- context: for every committed position `p < a`, the target's features (the mean over the mHC streams after each
  `target_layer_ids` layer, concatenated) become `main_x = main_norm(main_proj(features))`, and each stage's K=V
  latent `rope(kv_norm(wkv_s(main_x)), p)`. These rows are *injected* into the draft's SWA pool; the draft never
  runs on prompt tokens itself.
- block: `[anchor, MASK x (gamma - 1)]` at positions `a .. a + gamma - 1`, replicated over the mHC streams, runs
  through the stages. Every block row attends to the last `sliding_window` context rows (`a - W .. a - 1`) and to
  all block rows (bidirectional inside the block).
- logits: `head(norm(hc_head(h)))` of the last stage gives base logits for every block row; row k proposes the token
  at `a + k + 1`. The Markov head adds `w2(w1[prev])` while the tokens are picked left to right.
"""

from __future__ import annotations

import contextlib
from dataclasses import replace
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from pdspark.model.attention import Attention, sink_attention
from pdspark.model.decoder_layer import DecoderLayer
from pdspark.model.dspark_config import DSparkConfig
from pdspark.model.hyper_connection import HyperConnection, HyperHead
from pdspark.model.model_config import SLIDING, ModelConfig
from pdspark.model.moe import MoE, SharedExpert, swiglu
from pdspark.model.norm import RMSNorm, rms_norm
from pdspark.model.rope import RopeAt, RotaryTable
from pdspark.model.row_exact import row_exact_linear, use_row_exact
from pdspark.quant.fused_linear import FusedLinear
from pdspark.quant.quant_linear import QuantLinear, linear


class BlockInputs(NamedTuple):
    """What every stage reads in one prepared `block_hidden` call, built once per call, not per stage."""

    ids: torch.Tensor  # [M*G] block token ids: the anchor, then MASKs
    rope_at: RopeAt  # rotation factors at the block positions
    masked: torch.Tensor  # [M, 1, W + G] bool: True where a key is not valid (context rows, then the block's)


class DraftAttention(Attention):
    """A draft stage's attention: block rows over injected context rows plus the whole block."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg, SLIDING, rope=None)  # type: ignore[arg-type]  # SWA only: no compressor
        self._block_sinks: torch.Tensor | None = None  # [1, G*H, 1] once prepared

    def forward_block(
        self, x: torch.Tensor, rope_at: RopeAt, ctx_kv: torch.Tensor, ctx_valid: torch.Tensor
    ) -> torch.Tensor:
        """`x [M*G, D]` block rows of M blocks; `ctx_kv [M, W, d]`, `ctx_valid [M, W]` -> `[M*G, D]`."""
        M = ctx_kv.shape[0]
        G = x.shape[0] // M
        q = self.project_q(x, rope_at).q  # [M*G, H, d]
        block_kv = self.project_kv(x, rope_at).view(M, G, -1)
        kv = torch.cat([ctx_kv, block_kv], dim=1)  # [M, W + G, d]
        valid = torch.cat([ctx_valid, ctx_valid.new_ones(M, G)], dim=1)
        o = sink_attention(q.reshape(M, G * self.n_heads, -1), kv, valid, self.attn_sink.repeat(G), self.scale)
        return self.project_out(o.reshape(M * G, self.n_heads, -1), rope_at)

    def prepare_block(self, gamma: int, stack: bool = True) -> None:
        """Inference only: one matmul for q_a and the latent (`Attention.fuse`) and the block's sink logits laid
        out once (`[1, gamma * H, 1]`), not per call. Call once the weights are final."""
        self.fuse(stack)
        self._block_sinks = self.attn_sink.detach().repeat(gamma).view(1, -1, 1)

    def forward_prepared(self, x: torch.Tensor, block: BlockInputs, ctx_kv: torch.Tensor) -> torch.Tensor:
        """`forward_block` with fewer ops, bit for bit: `x [M*G, D]`, `ctx_kv [M, W, d]` -> `[M*G, D]`."""
        M, T, H = ctx_kv.shape[0], x.shape[0], self.n_heads
        assert self._block_sinks is not None, "prepare_block() first"
        assert self.fused_x is not None, "prepare_block() first"
        qa, latent = self.fused_x(x)  # one matmul: the same bits per column as two
        q = self._q_from(qa, block.rope_at).q  # [T, H, d]
        kv = torch.cat([ctx_kv, block.rope_at.apply(self.kv_norm(latent)).view(M, T // M, -1)], dim=1)  # [M, K, d]
        # sink_attention's ops, in place where it allocated, and the mask inverted once per block, not per stage.
        scores = torch.bmm(q.view(M, -1, q.shape[-1]), kv.transpose(1, 2)).mul_(self.scale)  # [M, G*H, K]
        scores.masked_fill_(block.masked, float("-inf"))
        logits = torch.cat([scores, self._block_sinks.to(scores.dtype).expand(M, -1, 1)], dim=-1)
        # NOTE: no `logits - amax` first: softmax subtracts the same maximum itself, so the bits are the same.
        probs = torch.softmax(logits, dim=-1)[..., :-1]
        o = torch.bmm(probs.to(kv.dtype), kv)  # [M, G*H, d]
        return self.project_out(o.view(T, H, -1), block.rope_at)


class DraftStage(DecoderLayer):
    """A sliding-window DSV4 layer of the draft: mHC, draft attention, and a routed MoE or a dense SwiGLU."""

    attn: DraftAttention

    def __init__(self, cfg: ModelConfig, dcfg: DSparkConfig):
        ffn: MoE | SharedExpert
        if dcfg.n_routed_experts:
            moe_cfg = replace(
                cfg,
                n_routed_experts=dcfg.n_routed_experts,
                num_experts_per_tok=dcfg.num_experts_per_tok,
                moe_intermediate_size=dcfg.intermediate_size,
            )
            ffn = MoE(moe_cfg, is_hash=False)
        else:
            ffn = SharedExpert(cfg.hidden_size, dcfg.intermediate_size, cfg.swiglu_limit)
        super().__init__(cfg, DraftAttention(cfg), ffn)
        self.gate_up: FusedLinear | None = None  # a dense SwiGLU's gate and up in one matmul (`prepare_inference`)

    def forward(  # type: ignore[override]
        self, h: torch.Tensor, ids: torch.Tensor, rope_at: RopeAt, ctx_kv: torch.Tensor, ctx_valid: torch.Tensor
    ) -> torch.Tensor:
        x, post, comb = self.attn_hc.collapse(h)
        h = HyperConnection.expand(self.attn.forward_block(self.attn_norm(x), rope_at, ctx_kv, ctx_valid), h, post,
                                   comb)
        x, post, comb = self.ffn_hc.collapse(h)
        y = self.ffn(self.ffn_norm(x), ids) if isinstance(self.ffn, MoE) else self.ffn(self.ffn_norm(x))
        return HyperConnection.expand(y, h, post, comb)

    def prepare_inference(self, gamma: int, stack: bool = True) -> None:
        """Inference only: freeze the mHC mixes for the C collapse, fuse the matmuls that read one input
        (attention: q_a and the latent; a dense SwiGLU: gate and up) and lay out the block's sink logits. `stack`
        False (compact weights): no stacked copies (`FusedLinear`)."""
        self.attn_hc.freeze()
        self.ffn_hc.freeze()
        self.attn.prepare_block(gamma, stack)
        if isinstance(self.ffn, SharedExpert):
            self.gate_up = FusedLinear([self.ffn.w1, self.ffn.w3], stack)

    def forward_prepared(self, h: torch.Tensor, block: BlockInputs, ctx_kv: torch.Tensor) -> torch.Tensor:
        """`forward` with fewer ops (after `prepare_inference`), bit for bit: `h [M*G, hc, D]` -> `[M*G, hc, D]`."""
        x, post, comb = self.attn_hc.collapse(h)
        y = self.attn.forward_prepared(rms_norm(x, self.attn_norm.weight, self.attn_norm.eps), block, ctx_kv)
        h = HyperConnection.expand(y, h, post, comb)
        x, post, comb = self.ffn_hc.collapse(h)
        x = rms_norm(x, self.ffn_norm.weight, self.ffn_norm.eps)
        if isinstance(self.ffn, MoE):
            y = self.ffn(x, block.ids)
        else:
            assert self.gate_up is not None, "prepare_inference() first"
            gate, up = self.gate_up(x)  # one matmul: the same bits per column as two
            y = linear(swiglu(gate, up, self.ffn.limit), self.ffn.w2, self.ffn.mm)
        return HyperConnection.expand(y, h, post, comb)


class DSparkDraft(nn.Module):
    def __init__(self, cfg: ModelConfig, dcfg: DSparkConfig, max_len: int, meta: bool = False):
        """`meta`: the weights are built on the meta device (the loader gives each its tensor); the rotary table
        is real either way."""
        super().__init__()
        self.cfg, self.dcfg = cfg, dcfg
        self.rope = RotaryTable(cfg.main_rope, cfg.rope_dim, max_len)  # stages are sliding-only layers
        with torch.device("meta") if meta else contextlib.nullcontext():
            self._build_weights(cfg, dcfg)
        self._target_vocab: tuple[torch.Tensor, torch.Tensor] | None = None
        self._block_offsets: torch.Tensor | None = None  # [G] 0 .. G-1, set by prepare_inference
        self._stage_latents: FusedLinear | None = None  # every stage's wkv in one matmul, set by prepare_inference

    def _build_weights(self, cfg: ModelConfig, dcfg: DSparkConfig) -> None:
        D, V = cfg.hidden_size, cfg.vocab_size
        self.main_proj = nn.Parameter(torch.zeros(D, D * len(dcfg.target_layer_ids)))
        self.main_norm = RMSNorm(D, cfg.rms_norm_eps)
        self.stages = nn.ModuleList(DraftStage(cfg, dcfg) for _ in range(dcfg.num_stages))
        self.hc_head = HyperHead(cfg.hc_mult, D, cfg.hc_eps, cfg.rms_norm_eps)
        self.norm = RMSNorm(D, cfg.rms_norm_eps)
        r = max(dcfg.markov_rank, 1)
        self.markov_w1 = nn.Parameter(torch.zeros(V, r))  # Embedding(V, r)
        self.markov_w2 = nn.Parameter(torch.zeros(V, r))  # Linear(r -> V)
        if dcfg.uses_own_vocab_modules:
            self.embed = nn.Parameter(torch.zeros(V, D))
            self.head = nn.Parameter(torch.zeros(V, D))

    def bind_target(self, embed: torch.Tensor, head: torch.Tensor) -> None:
        """Share the target's embedding and LM head (unless this draft ships its own)."""
        self._target_vocab = (embed, head)

    def prepare_inference(self, compact: bool = False) -> None:
        """Inference only: prepare every stage (`DraftStage.prepare_inference`); `block_hidden` then runs the
        prepared path when autograd is off. Call once the weights are final and on their device. `compact`: the
        weights keep a released checkpoint's dtypes (FP8/MXFP4 modules, bf16 matrices; `dspark_weights`): fp32
        activations through the row-exact kernels, which read them, and no stacked copies."""
        for stage in self.draft_stages:
            stage.prepare_inference(self.dcfg.gamma, stack=not compact)
        self._block_offsets = torch.arange(self.dcfg.gamma, device=self.markov_w1.device)
        self._stage_latents = FusedLinear([stage.attn.wkv for stage in self.draft_stages], stack=not compact)
        if compact:
            use_row_exact(self, FusedLinear)

    @property
    def draft_stages(self) -> list[DraftStage]:
        return [s for s in self.stages if isinstance(s, DraftStage)]

    @property
    def vocab(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.dcfg.uses_own_vocab_modules:
            return self.embed, self.head
        assert self._target_vocab is not None, "bind_target() first"
        return self._target_vocab

    def context_kv(self, features: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Target features `[N, D*L]` at `positions [N]` -> each stage's injected K=V rows `[stages, N, d]`."""
        if isinstance(self.main_proj, QuantLinear):  # a quantized checkpoint's: int8 math, output in x's dtype
            main_x = self.main_norm(self.main_proj(features))
        elif self.main_proj.dtype != features.dtype:  # a compact draft's bf16 matrix, read as the fp32 it widens to
            main_x = self.main_norm(row_exact_linear(features, self.main_proj))
        else:
            main_x = self.main_norm(F.linear(features.to(self.main_proj.dtype), self.main_proj))
        rope_at = self.rope.at(positions)
        if self._stage_latents is None or torch.is_grad_enabled():
            return torch.stack([stage.attn.project_kv(main_x, rope_at) for stage in self.draft_stages])
        # Prepared: every stage's latent in one matmul (the same bits per column), then each stage's project_kv rest.
        latents = self._stage_latents(main_x)
        return torch.stack([rope_at.apply(stage.attn.kv_norm(latent))
                            for stage, latent in zip(self.draft_stages, latents)])

    def block_hidden(
        self, anchors: torch.Tensor, anchor_pos: torch.Tensor, ctx_kv: torch.Tensor, ctx_valid: torch.Tensor
    ) -> torch.Tensor:
        """Run the draft blocks.

        Args:
            anchors: `[M]` anchor token per block; anchor_pos: `[M]` its position.
            ctx_kv: `[stages, M, W, d]` context rows per stage; ctx_valid: `[M, W]`.
        Returns:
            The last stage's streams `[M, G, hc, D]` (G = gamma).
        """
        if self._block_offsets is not None and not torch.is_grad_enabled():
            return self._block_hidden_prepared(anchors, anchor_pos, ctx_kv, ctx_valid)
        M, G = anchors.shape[0], self.dcfg.gamma
        ids = torch.full((M, G), self.dcfg.mask_token_id, dtype=torch.long, device=anchors.device)
        ids[:, 0] = anchors
        ids = ids.flatten()
        positions = (anchor_pos[:, None] + torch.arange(G, device=anchors.device)[None, :]).flatten()
        x = self._embed(ids)
        h = x.unsqueeze(1).expand(-1, self.cfg.hc_mult, -1).contiguous()  # [M*G, hc, D]
        rope_at = self.rope.at(positions)
        for s, stage in enumerate(self.stages):
            h = stage(h, ids, rope_at, ctx_kv[s], ctx_valid)
        return h.view(M, G, self.cfg.hc_mult, -1)

    def _block_hidden_prepared(
        self, anchors: torch.Tensor, anchor_pos: torch.Tensor, ctx_kv: torch.Tensor, ctx_valid: torch.Tensor
    ) -> torch.Tensor:
        """`block_hidden` after `prepare_inference`, bit for bit: per-call inputs built once for all stages."""
        M, G = anchors.shape[0], self.dcfg.gamma
        assert self._block_offsets is not None
        ids = torch.full((M, G), self.dcfg.mask_token_id, dtype=torch.long, device=anchors.device)
        ids[:, 0] = anchors
        ids = ids.view(-1)  # [M*G]
        masked = F.pad(~ctx_valid, (0, G), value=False).unsqueeze(1)  # [M, 1, W + G]: block rows are all valid
        block = BlockInputs(ids, self.rope.at((anchor_pos[:, None] + self._block_offsets).view(-1)), masked)
        h = self._embed(ids).unsqueeze(1).expand(-1, self.cfg.hc_mult, -1).contiguous()
        for s, stage in enumerate(self.draft_stages):
            h = stage.forward_prepared(h, block, ctx_kv[s])  # [M*G, hc, D]
        return h.view(M, G, self.cfg.hc_mult, -1)

    def base_logits(self, h: torch.Tensor) -> torch.Tensor:
        """Streams `[..., hc, D]` -> fp32 logits `[..., V]`."""
        lead = h.shape[:-2]
        y = self.norm(self.hc_head(h.reshape(-1, *h.shape[-2:])))
        head = self.vocab[1]
        # A compact target's head is bf16: read as the fp32 it widens to (row-exact, as the target reads it).
        logits = F.linear(y, head) if head.dtype == y.dtype else row_exact_linear(y, head)
        return logits.float().view(*lead, -1)

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        """The embedding rows of `ids` in the draft's dtype (a compact target's embedding is bf16)."""
        return F.embedding(ids, self.vocab[0]).to(self.norm.weight.dtype)

    def markov_bias(self, prev: torch.Tensor) -> torch.Tensor:
        """Low-rank bigram logit bias `w2(w1[prev])`: `prev [...]` -> `[..., V]` fp32."""
        if self.dcfg.markov_rank == 0:
            return torch.zeros(*prev.shape, self.cfg.vocab_size, device=self.markov_w1.device)
        return F.linear(self.markov_w1[prev].float(), self.markov_w2.float())
