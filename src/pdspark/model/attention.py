"""`Attention`: DSV4 multi-query attention on one shared K=V latent, over the paged cache.

A query at position p attends to the raw latents of its window `[p - W + 1, p]` and, on compressed layers, to
compressed entries (HCA: every visible one; CSA: the indexer's pick), with a per-head sink logit that takes
probability mass but adds no value. The output's rope channels are rotated back by `-p` before the grouped
low-rank output projection.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from pdspark.hardware.cpu import kernels as cpu_kernels
from pdspark.hardware.prepare_streams import PrepareStreams
from pdspark.model.batch import CompressedIndex, ForwardBatch, LayerCache, Segment, WindowIndex, gather_rows
from pdspark.model.compressor import Compressor
from pdspark.model.indexer import Indexer
from pdspark.model.model_config import CSA, HCA, ModelConfig
from pdspark.model.norm import RMSNorm, rms_norm
from pdspark.model.rope import RopeAt, RotaryTable
from pdspark.quant.fused_linear import FusedLinear
from pdspark.quant.quant_linear import linear


class XProjection(NamedTuple):
    """Every projection of a layer's input `x`: q_a, the raw latent, and (on compressed layers) the compressors'
    kv+gate rows and the indexer's head weights (before their scale)."""

    qa: torch.Tensor
    kv: torch.Tensor
    comp: torch.Tensor | None
    idx_comp: torch.Tensor | None
    idx_w: torch.Tensor | None


class QProjection(NamedTuple):
    """The attention queries of a layer's input and the low-rank query latent they came from."""

    q: torch.Tensor  # [T, H, d] normalised and rotated
    qr: torch.Tensor  # [T, q_lora] normalised q_a latent (the indexer's queries start from it)


# Queries of a long chunk are processed in blocks this long: a block reads its own window union (block + W - 1
# rows) rather than one union for the whole chunk, so little of the score matrix is masked away.
_QUERY_BLOCK = 128
# Up to this many tokens the output projection runs as C GEMVs in one call (decode); more use BLAS matmuls.
_C_OUT_MAX_TOKENS = 4


class Attention(nn.Module):
    mm = staticmethod(F.linear)  # the float matmul (`DSV4Model.prepare_inference`: batch-invariant mode)

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
        # Every projection of the layer input in one matmul (`fuse`, inference only); None until then.
        self.fused_x: FusedLinear | None = None

    def project_kv(self, x: torch.Tensor, rope_at: RopeAt) -> torch.Tensor:
        """The raw K=V latent `[T, d]` of each token (normalised and rotated), as written to the SWA pool."""
        return rope_at.apply(self.kv_norm(linear(x, self.wkv, self.mm)))

    def forward(self, x: torch.Tensor, batch: ForwardBatch, cache: LayerCache, rope_at: RopeAt) -> torch.Tensor:
        """`x [T, D]` -> `[T, D]`. `rope_at` holds this layer's rotation factors at the batch positions."""
        xp = self._project_x(x)
        if batch.prepare_streams is not None:
            proj, compressed = self._prepare_on_streams(xp, batch, cache, rope_at, batch.prepare_streams)
        else:
            proj = self._q_from(xp.qa, rope_at)
            self._write_kv(xp.kv, batch, cache, rope_at)
            compressed = self._update_compressed(xp, proj.qr, batch, cache, rope_at)
        return self.project_out(self.attend(proj.q, cache, batch, compressed), rope_at)

    def _prepare_on_streams(
        self, xp: XProjection, batch: ForwardBatch, cache: LayerCache, rope_at: RopeAt, streams: PrepareStreams
    ) -> tuple[QProjection, CompressedIndex | None]:
        """The same work as the one-stream prepare, split (decode/verify steps, see `pdspark.hardware.
        prepare_streams`): the KV write on one side stream, the query heads on another, the compressors and the
        indexer on the current stream, which then waits for both. Each piece reads only what the others do not
        write, so the results are those of the one-stream path."""
        qr = self.q_norm(xp.qa)  # [T, q_lora] on the current stream: the q side and the indexer both read it
        streams.fork()
        with streams.on_kv():
            self._write_kv(xp.kv, batch, cache, rope_at)
        with streams.on_q():
            q = self._q_heads(qr, rope_at)
        compressed = self._update_compressed(xp, qr, batch, cache, rope_at)
        streams.join(q)
        return QProjection(q, qr), compressed

    def _write_kv(self, kv: torch.Tensor, batch: ForwardBatch, cache: LayerCache, rope_at: RopeAt) -> None:
        """Normalise and rotate the raw latents `kv [T, d]` and write them at the step's SWA slots."""
        if not torch.is_grad_enabled() and cpu_kernels.norm_rope(kv, 1, self.kv_norm.weight, self.kv_norm.eps,
                                                                 rope_at.cos, rope_at.sin, cache.swa_kv,
                                                                 batch.swa_slots) is not None:
            return  # one C call wrote the rows
        cache.swa_kv[batch.swa_slots] = rope_at.apply(self.kv_norm(kv))

    def fuse(self, stack: bool = True) -> None:
        """Inference only: stack every projection of the layer input into one matrix (one matmul instead of up to
        five; quantized ones into one int8 matmul per scheme). Call after the weights are final (loaded, moved,
        cast, quantized linears installed); training keeps the separate parameters. `stack` False (compact
        weights): each projection alone (a stacked matrix would be a second copy)."""
        parts = [self.wq_a, self.wkv]
        if self.compressor is not None:
            parts.append(self.compressor.wkv_gate)
        if self.indexer is not None:
            parts += [self.indexer.compressor.wkv_gate, self.indexer.weights_proj]
        self.fused_x = FusedLinear(parts, stack)

    def _project_x(self, x: torch.Tensor) -> XProjection:
        fused = self.fused_x
        parts: list[torch.Tensor | None]
        if fused is not None and not torch.is_grad_enabled():
            parts = list(fused(x))
        else:
            parts = [linear(x, self.wq_a, self.mm), linear(x, self.wkv, self.mm)]
            if self.compressor is not None:
                parts.append(linear(x, self.compressor.wkv_gate, self.mm))
            if self.indexer is not None:
                parts += [linear(x, self.indexer.compressor.wkv_gate, self.mm),
                          linear(x, self.indexer.weights_proj, self.mm)]
        parts += [None] * (5 - len(parts))
        qa, kv, comp, idx_comp, idx_w = parts
        assert qa is not None and kv is not None  # every layer projects q_a and the latent
        return XProjection(qa, kv, comp, idx_comp, idx_w)

    def project_q(self, x: torch.Tensor, rope_at: RopeAt) -> QProjection:
        """The queries of `x [T, D]`."""
        return self._q_from(linear(x, self.wq_a, self.mm), rope_at)

    def _q_from(self, qa: torch.Tensor, rope_at: RopeAt) -> QProjection:
        qr = self.q_norm(qa)
        return QProjection(self._q_heads(qr, rope_at), qr)

    def _q_heads(self, qr: torch.Tensor, rope_at: RopeAt) -> torch.Tensor:
        """The normalised q latent `qr [T, q_lora]` -> query heads `[T, H, d]`, head-normalised and rotated."""
        y = linear(qr, self.wq_b, self.mm)
        if not torch.is_grad_enabled():
            fused = cpu_kernels.norm_rope(y, self.n_heads, None, self.eps, rope_at.cos, rope_at.sin)  # one C call
            if fused is not None:
                return fused
        return rope_at.apply(rms_norm(y.view(qr.shape[0], self.n_heads, self.head_dim), None, self.eps))

    def project_out(self, o: torch.Tensor, rope_at: RopeAt) -> torch.Tensor:
        """Un-rotate `o [T, H, d]` and apply the grouped output projection -> `[T, D]`."""
        T = o.shape[0]
        if T <= _C_OUT_MAX_TOKENS and not torch.is_grad_enabled() and isinstance(self.wo_a, torch.Tensor) and \
                isinstance(self.wo_b, torch.Tensor):  # a few tokens: one C call (GEMVs)
            fused = cpu_kernels.attn_out(o, rope_at.cos, rope_at.sin, self.wo_a, self.o_groups, self.wo_b)
            if fused is not None:
                return fused
        o = rope_at.apply(o, inverse=True)
        # [T, H, d] -> [G, T, H*d/G] @ [G, H*d/G, o_lora] -> [T, G * o_lora]
        grouped = o.reshape(T, self.o_groups, -1).transpose(0, 1)
        if self.mm is F.linear:  # one batched matmul over the groups
            w = self.wo_a.view(self.o_groups, -1, grouped.shape[-1]).transpose(1, 2)
            o = torch.bmm(grouped, w).transpose(0, 1).reshape(T, -1)
        else:  # batch-invariant mode (and compact weights): each group's projection through `mm`
            o = torch.cat([linear(grouped[g], self._wo_a_group(g), self.mm) for g in range(self.o_groups)], dim=-1)
        return linear(o, self.wo_b, self.mm)

    def _wo_a_group(self, g: int) -> torch.Tensor | nn.Module:
        """Group g's rows of the output projection `wo_a` (`[o_lora, H*d/G]`: a view, or a compact FP8 linear's)."""
        rows = self.wo_a.shape[0] // self.o_groups if isinstance(self.wo_a, torch.Tensor) else \
            self.wo_a.out_features // self.o_groups
        if isinstance(self.wo_a, torch.Tensor):
            return self.wo_a[g * rows : (g + 1) * rows]
        return self.wo_a.rows(g * rows, (g + 1) * rows)

    def _update_compressed(
        self, xp: XProjection, qr: torch.Tensor, batch: ForwardBatch, cache: LayerCache, rope_at: RopeAt
    ) -> CompressedIndex | None:
        """Write this step's closed groups and return the compressed entries each query attends to."""
        if self.compressor is None:
            return None
        # A compressed layer has its compressor's projection and pools (None only on sliding layers).
        assert xp.comp is not None and cache.comp_state is not None and cache.comp_kv is not None
        if self.indexer is not None:
            assert batch.csa_plan is not None and xp.idx_comp is not None and xp.idx_w is not None
            assert cache.index_state is not None and cache.index_kv is not None
            self.compressor.run(xp.comp, batch.positions, batch.csa_plan, cache.comp_state, cache.comp_kv)
            self.indexer.compressor.run(xp.idx_comp, batch.positions, batch.csa_plan, cache.index_state,
                                        cache.index_kv)
            return self.indexer.select(xp.idx_w, qr, batch, cache.index_kv, rope_at)
        assert batch.hca_plan is not None
        self.compressor.run(xp.comp, batch.positions, batch.hca_plan, cache.comp_state, cache.comp_kv)
        return batch.hca

    def attend(
        self, q: torch.Tensor, cache: LayerCache, batch: ForwardBatch, compressed: CompressedIndex | None
    ) -> torch.Tensor:
        """Each query over its window and compressed entries: `q [T, H, d]` -> `[T, H, d]`."""
        if not batch.segments:
            return self._attend_gathered(q, cache, batch.window, compressed, None)
        out = torch.empty_like(q)
        g = batch.gather_rows
        if g is not None and g.numel():
            out[g] = self._attend_gathered(q[g], cache, batch.window, compressed, g)
        for seg in batch.segments:
            rows = slice(seg.offset, seg.offset + seg.length)
            if compressed is not None and compressed.picked:
                out[rows] = self._attend_segment_picked(q[rows], cache, seg, compressed, rows)
            else:
                out[rows] = self._attend_segment(q[rows], cache, seg, compressed)
        return out

    def _attend_segment_picked(self, q, cache: LayerCache, seg: Segment, compressed: CompressedIndex,
                               rows: slice) -> torch.Tensor:
        """A long chunk of a CSA layer whose queries each attend to their own picked entries: every query over its
        own window (the union's rows i .. i + W - 1) and its `topk` compressed rows, as decode tokens attend, in
        blocks of queries (the PyTorch path gathers each block's rows)."""
        n = seg.length
        W = seg.window_rows.shape[0] - n + 1
        picked_rows, picked_valid = compressed.rows[rows], compressed.valid[rows]  # [n, topk]
        out = torch.empty_like(q)
        for b0 in range(0, n, _QUERY_BLOCK):
            b1 = min(n, b0 + _QUERY_BLOCK)
            # [m, W]: query i's window is union rows i .. i + W - 1, valid where its band says so
            span = torch.arange(b0, b1)[:, None] + torch.arange(W)
            window = WindowIndex(seg.window_rows[span], seg.band[b0:b1].gather(1, span))
            picks = CompressedIndex(picked_rows[b0:b1], picked_valid[b0:b1], compressed.max_visible, picked=True)
            out[b0:b1] = self._attend_gathered(q[b0:b1], cache, window, picks, None)
        return out

    def _attend_gathered(self, q, cache: LayerCache, window, compressed: CompressedIndex | None,
                         token_rows: torch.Tensor | None) -> torch.Tensor:
        """Short chunks: every token over its own window `[Tg, W]` rows (and its compressed entries)."""
        rows = ok = None
        if compressed is not None and compressed.max_visible:
            assert cache.comp_kv is not None
            rows, ok = compressed.rows, compressed.valid
            if token_rows is not None:
                rows, ok = rows[token_rows], ok[token_rows]
        if not torch.is_grad_enabled():  # the C kernel reads the rows in place (fp32 CPU pools)
            fused = cpu_kernels.sink_attend(q, cache.swa_kv, window.rows, window.valid,
                                            None if rows is None else cache.comp_kv, rows, ok, self.attn_sink,
                                            self.scale)
            if fused is not None:
                return fused
        kv = gather_rows(cache.swa_kv, window.rows)
        valid = window.valid
        if rows is not None:
            assert cache.comp_kv is not None and ok is not None
            kv = torch.cat([kv, gather_rows(cache.comp_kv, rows)], dim=1)  # [Tg, W + V, d]
            valid = torch.cat([valid, ok], dim=1)
        return sink_attention(q, kv, valid, self.attn_sink, self.scale)

    def _attend_segment(self, q, cache: LayerCache, seg: Segment, compressed: CompressedIndex | None) -> torch.Tensor:
        """A long chunk of one request, in blocks of queries: a block's keys are the union of its queries' windows
        plus the request's compressed entries; masks keep each query to its own window and picks."""
        win_kv = gather_rows(cache.swa_kv, seg.window_rows)  # [n + W - 1, d]
        comp: tuple[torch.Tensor, torch.Tensor] | None = None  # (kv [V, d], valid [n, V]) of compressed entries
        if compressed is not None and compressed.max_visible:
            assert self.compressor is not None and cache.comp_kv is not None
            last = seg.offset + seg.length - 1
            V = min(compressed.max_visible, (seg.start + seg.length) // self.compressor.ratio)
            comp = (gather_rows(cache.comp_kv, compressed.rows[last, :V]), compressed.valid[seg.offset : last + 1, :V])
        n, H, d = q.shape
        W = win_kv.shape[0] - n + 1
        out = torch.empty_like(q)
        for b0 in range(0, n, _QUERY_BLOCK):
            b1 = min(n, b0 + _QUERY_BLOCK)
            kv = win_kv[b0 : b1 + W - 1]  # the block's queries see at most these window rows
            valid = seg.band[b0:b1, b0 : b1 + W - 1]
            if comp is not None:
                kv = torch.cat([kv, comp[0]], dim=0)
                valid = torch.cat([valid, comp[1][b0:b1]], dim=1)
            m = b1 - b0
            rows = q[b0:b1].reshape(m * H, d)
            # (batch-invariant mode: through `mm`, so that a query's bits do not depend on its block's size)
            scores = torch.mm(rows, kv.t()) if self.mm is F.linear else self.mm(rows, kv.contiguous())
            probs = softmax_with_sink(scores.view(m, H, -1) * self.scale, valid, self.attn_sink)
            p = probs.reshape(m * H, -1).to(kv.dtype)
            out[b0:b1] = (torch.mm(p, kv) if self.mm is F.linear else self.mm(p, kv.t().contiguous())).view(m, H, d)
        return out


def softmax_with_sink(scores: torch.Tensor, valid: torch.Tensor, sink: torch.Tensor) -> torch.Tensor:
    """Softmax over the keys of `scores [M, Q, K]` (invalid keys masked) with one extra sink logit per query row
    `sink [Q]` that takes probability mass and is then dropped."""
    scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
    sinks = sink.to(scores.dtype).view(1, -1, 1).expand(scores.shape[0], -1, 1)
    logits = torch.cat([scores, sinks], dim=-1)
    logits = logits - logits.amax(dim=-1, keepdim=True)
    return torch.softmax(logits, dim=-1)[..., :-1]


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
    probs = softmax_with_sink(torch.bmm(q, kv.transpose(1, 2)) * scale, valid, sink)  # [M, Q, K]
    return torch.bmm(probs.to(kv.dtype), kv)
