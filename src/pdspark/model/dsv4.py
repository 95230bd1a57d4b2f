"""`DSV4Model`: the DeepSeek-V4 backbone and LM head over the paged cache."""

from __future__ import annotations

import contextlib
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from pdspark.hardware.cpu import kernels as cpu_kernels
from pdspark.model.batch import ForwardBatch, LayerCaches
from pdspark.model.cpu.decode_step import MAX_TOKENS, DecodeStep, IndexedOutput
from pdspark.model.decoder_layer import DecoderLayer
from pdspark.model.hyper_connection import HyperHead
from pdspark.model.model_config import SLIDING, ModelConfig
from pdspark.model.moe import MoE
from pdspark.model.norm import RMSNorm
from pdspark.model.rope import RotaryTable
from pdspark.model.row_exact import use_row_exact
from pdspark.parallel.expert_shard import ExpertShard
from pdspark.parallel.slot_exchange import SlotExchange
from pdspark.parallel.token_exchange import TokenExchange
from pdspark.quant.fused_linear import FusedLinear

# Up to this many rows (any step the C decode step takes: decode, and verify up to 64 rows) the head runs in one C
# call whose rows share each read of the head (the same bits per row as one row alone, so a verify row's logits are a
# plain decode step's at every batch); more share it in a BLAS matmul. Measured on a Zen 4 VM, 2 threads, dsv4-tiny:
# 6 rows 0.12 ms in C against 0.45 ms in BLAS, 48 rows (a batch-8 verify) 0.63 against 0.92 alone and 1.35 inside
# the verify step (the limit was 8 rows before: 0.38-0.45 ms in C against 0.9 ms with one torch thread for 6 rows).
_C_HEAD_MAX_ROWS = MAX_TOKENS


class ForwardOutput(NamedTuple):
    hidden: torch.Tensor  # [T, hc, D] final streams
    features: torch.Tensor | None  # [T, D * len(capture)]: mean over streams after each captured layer


class DSV4Model(nn.Module):
    mm = staticmethod(F.linear)  # the float matmul (`DSV4Model.prepare_inference`: batch-invariant mode)

    def __init__(self, cfg: ModelConfig, max_len: int, experts: ExpertShard | None = None, meta: bool = False):
        """`experts`: with expert parallelism, the routed experts this rank holds (None: all of them). `meta`: the
        weights are built on the meta device (no memory: the loader gives each its tensor, `weights.Assigner`);
        the rotary tables are real either way."""
        super().__init__()
        self.cfg = cfg
        self.experts = experts if experts is not None else ExpertShard.whole(cfg.n_routed_experts)
        assert self.experts.n_experts == cfg.n_routed_experts, (self.experts, cfg.n_routed_experts)
        # A group's digests of every routed expert, pooled from its ranks at load (`model.fingerprint`); None: this
        # model holds them all.
        self.group_expert_digests: list[tuple[str, int, str]] | None = None
        # Sliding-only layers rotate with the plain `rope_theta` table; compressed layers (their window branch
        # included) with the `compress_rope_theta` table (YaRN when configured).
        self.rope_main = RotaryTable(cfg.main_rope, cfg.rope_dim, max_len)
        self.rope_compress = RotaryTable(cfg.compress_rope, cfg.rope_dim, max_len)
        with torch.device("meta") if meta else contextlib.nullcontext():
            self._build_weights(cfg)
        self._decode_step: DecodeStep | None = None  # set by `prepare_inference`
        self.decode_step_off: str | None = None  # why `prepare_inference` built no decode step (None: it did)
        self._row_exact = False  # batch-invariant mode (`prepare_inference(row_exact=True)`)
        self._head_bf16: torch.Tensor | None = None  # set by `prepare_inference`
        # The activations' dtype (None: the embedding's). Compact weights (`prepare_inference(compact=True)`) keep
        # bf16 embeddings and compute in fp32.
        self.act_dtype: torch.dtype | None = None

    def _build_weights(self, cfg: ModelConfig) -> None:
        D = cfg.hidden_size
        self.embed = nn.Parameter(torch.zeros(cfg.vocab_size, D))
        self.layers = nn.ModuleList(
            DecoderLayer.target(cfg, t, cfg.hash_layers[i], self.rope_main if t == SLIDING else self.rope_compress,
                                self.experts)
            for i, t in enumerate(cfg.layer_types)
        )
        self.hc_head = HyperHead(cfg.hc_mult, D, cfg.hc_eps, cfg.rms_norm_eps)
        self.norm = RMSNorm(D, cfg.rms_norm_eps)
        self.head = nn.Parameter(torch.zeros(cfg.vocab_size, D))

    def forward(self, batch: ForwardBatch, pools: LayerCaches, capture: tuple[int, ...] = ()) -> ForwardOutput:
        """Run every layer over the step's tokens; `capture` lists layers whose output (the mean over the mHC
        streams) becomes a feature for the speculative drafter."""
        exchange = self.expert_exchange
        if isinstance(exchange, TokenExchange):  # DP-attention: every rank's MoE layers take part in this pass
            exchange.begin_forward(batch.num_tokens)
        if self._decode_step is not None:  # a small step: one C call per layer, where it applies
            fast = self._decode_step.try_run(batch, pools, self.embed, (self.rope_main, self.rope_compress), capture)
            if fast is not None:
                return ForwardOutput(fast.hidden, fast.features)
        x = F.embedding(batch.input_ids, self.embed)
        if self.act_dtype is not None:
            x = x.to(self.act_dtype)
        h = x.unsqueeze(1).expand(-1, self.cfg.hc_mult, -1).contiguous()  # [T, hc, D]
        # Rotation factors at this step's positions, gathered once per table and shared by every layer.
        rope_at = {SLIDING: self.rope_main.at(batch.positions)}
        compress_at = self.rope_compress.at(batch.positions)
        captured: dict[int, torch.Tensor] = {}
        for i, layer in enumerate(self.layers):
            h = layer(h, batch, pools.layer(i), rope_at.get(self.cfg.layer_types[i], compress_at))
            if i in capture:
                captured[i] = h.mean(dim=1)
        features = torch.cat([captured[i] for i in capture], dim=-1) if capture else None
        return ForwardOutput(h, features)

    def forward_indexed(self, req: list[int], cache_layout: tuple[int, ...], pools: LayerCaches,
                        capture: tuple[int, ...] = ()) -> IndexedOutput | None:
        """`forward(...)` of a step of short chunks, its indices built in C straight from the page tables (no
        `ForwardBatch`): `req` is `[n, (slot, start, length) per chunk, the token ids]`, `cache_layout` the cache's
        part of `kernel_abi.DECODE_LAYOUT`. The streams `[T, hc, D]`, the features of the `capture` layers `[T, D *
        len(capture)]`, the positions and SWA slots `[T]` are views the next step overwrites; None where the C path
        does not apply (the caller then builds a `ForwardBatch`)."""
        if self._decode_step is None:
            return None
        return self._decode_step.try_run_indexed(req, cache_layout, pools, self.embed,
                                                 (self.rope_main, self.rope_compress), capture)

    @property
    def expert_exchange(self) -> SlotExchange | TokenExchange | None:
        """The MoE layers' exchange (expert parallelism; None: one process)."""
        moe = self.layers[0].ffn if len(self.layers) else None
        return moe.exchange if isinstance(moe, MoE) else None

    def use_expert_exchange(self, exchange: SlotExchange | TokenExchange) -> None:
        """Expert parallelism: every MoE layer takes the other ranks' slots through `exchange` (call after
        `prepare_inference`). A `SlotExchange` (every rank runs the same batch): the C decode step is rebuilt to
        call it. A `TokenExchange` (DP-attention): every forward is the module path (the C step does not exchange
        token rows yet)."""
        for layer in self.layers:
            assert isinstance(layer, DecoderLayer) and isinstance(layer.ffn, MoE)
            layer.ffn.use_exchange(exchange)
        if isinstance(exchange, TokenExchange):
            self._decode_step = None
            self.decode_step_off = "DP-attention: the C decode step does not exchange token rows between ranks yet"
            return
        built = DecodeStep.build(list(self.layers), self.cfg)  # type: ignore[arg-type]
        self._decode_step, self.decode_step_off = (None, built) if isinstance(built, str) else (built, None)

    def finish_group_step(self) -> None:
        """DP-attention: this rank's engine step is over; join the other ranks' remaining forwards (with no tokens
        of its own) until every rank's step is. Nothing to do otherwise."""
        exchange = self.expert_exchange
        if isinstance(exchange, TokenExchange):
            # In the engine's mode (`ModelRunner.run`): the MoE paths depend on it, and other ranks' rows must get
            # the bits their own process would give them.
            with torch.inference_mode():
                exchange.finish_step([layer.ffn for layer in self.layers])  # type: ignore[misc]  # (MoE layers)

    def prepare_inference(self, row_exact: bool = False, compact: bool = False) -> None:
        """Fuse the projections that read the same input and freeze the mHC mix parameters for the C collapse
        (call once the weights are final). `row_exact`: batch-invariant mode (`row_exact.py`), for a quantized
        checkpoint's reference path: every float matmul of the module path through a row-exact kernel. `compact`:
        the weights stay in their checkpoint's dtypes (FP8/MXFP4 modules, bf16 matrices; see `loader`): fp32
        activations, no stacked copies, and the row-exact kernels (which read bf16 and FP8 weights)."""
        row_exact = row_exact or compact
        self.act_dtype = torch.float32 if compact else None
        for layer in self.layers:
            assert isinstance(layer, DecoderLayer) and isinstance(layer.ffn, MoE)  # target layers: attention + MoE
            layer.attn.fuse(stack=not compact)
            layer.ffn.fuse(stack=not compact)
            layer.ffn.act_dtype = self.act_dtype or self.embed.dtype
            layer.attn_hc.freeze()
            layer.ffn_hc.freeze()
        # Small decode steps: each layer as one C call over these weights (None where they do not allow it).
        built = DecodeStep.build(list(self.layers), self.cfg)  # type: ignore[arg-type]
        self._decode_step, self.decode_step_off = (None, built) if isinstance(built, str) else (built, None)
        # The head for the C path's rows, as bf16 bits when its values are bf16 numbers (the same logits).
        self._head_bf16 = self.head if self.head.dtype is torch.bfloat16 else cpu_kernels.bf16_copy(self.head)
        self._row_exact = row_exact
        if row_exact:
            use_row_exact(self, FusedLinear)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Streams `[N, hc, D]` -> fp32 logits `[N, vocab]`."""
        # A decode step's rows: one C call. In batch-invariant mode every row count: the C head computes each row
        # alone, where the module path's `torch.sigmoid` gives a row's last elements other bits by their position.
        if (h.shape[0] <= _C_HEAD_MAX_ROWS or self._row_exact) and not torch.is_grad_enabled():
            hh = self.hc_head
            fused = cpu_kernels.lm_head(h.contiguous(), hh.fn, hh.scale, hh.base, hh.hc_eps, hh.norm_eps,
                                        self.norm.weight, self.norm.eps, self.head, self._head_bf16)
            if fused is not None:
                return fused
        return self.mm(self.norm(self.hc_head(h)), self.head).float()  # (row-exact `mm` reads a bf16 head)
