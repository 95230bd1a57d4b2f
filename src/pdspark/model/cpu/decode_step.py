"""`DecodeStep`: the layers of a small decode step in C (`hardware.cpu.kernels.decode_layer`, `decode_layers`).

A decode token's layer is ~40 small operations in PyTorch, each costing more in dispatch than in arithmetic. Here
each layer's weights are laid out once as a table of pointers (the weights are final after `prepare_inference`),
the step's indices once per step (shared by every layer), and a layer is one call with the same steps in the same
order as `DecoderLayer.forward` (its BLAS matmuls become GEMV loops). Two entry points, each returning None where
it does not apply (the package's contract, `model.cpu`): `try_run` over a built `ForwardBatch` (one C call per
layer), and `try_run_indexed`, which builds the step's indices in C from the page tables and runs every layer in one
more call. A projection's weights may be fp32, bf16 or a released checkpoint's FP8/MXFP4 weights as stored, segment by
segment (`projection_table`). Steps they do not cover (prefill chunks, more than `MAX_TOKENS` tokens, other devices,
ModelSlim int8 weights, the multi-stream prepare) keep the module path.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from pdspark.hardware.cpu import kernel_abi
from pdspark.hardware.cpu import kernels as cpu_kernels
from pdspark.model.attention import Attention
from pdspark.model.batch import CompressPlan, ForwardBatch, LayerCaches
from pdspark.model.blocked_rows import BlockedRows
from pdspark.model.compact_experts import CompactExperts
from pdspark.model.cpu.projection_table import ProjectionTable, Segment, expert_segment, projection_table, segment_of
from pdspark.model.decoder_layer import DecoderLayer
from pdspark.model.model_config import CSA, HCA, ModelConfig
from pdspark.model.moe import MoE
from pdspark.model.packed_rows import PackedRows
from pdspark.model.rope import RotaryTable
from pdspark.parallel.slot_exchange import SlotExchange, exchange_errors
from pdspark.parallel.token_exchange import TokenExchange
from pdspark.quant.kv_fp8 import IndexRowPack, KvRowPack

# Decode/verify steps up to this many tokens run through the C layer (the C index's limit, `INDEX_MAX_TOKENS`): a
# DSpark verify step of 8 requests x 6 rows is 48. Its GEMMs share each weight read across a step's rows
# (`gemm_exact`); measured against the module path on dsv4-tiny (Zen 4, 2 threads): 48 rows 10.5 ms vs 23.1 ms, 12
# rows 2.7 ms vs 11.3 ms.
MAX_TOKENS = kernel_abi.INDEX_MAX_TOKENS


class StepOutput(NamedTuple):
    """`DecodeStep.try_run`'s step."""

    hidden: torch.Tensor  # [T, hc, D] final streams
    features: torch.Tensor | None  # [T, D * len(capture)]: mean over streams after each captured layer


class IndexedOutput(NamedTuple):
    """`DecodeStep.try_run_indexed`'s step: views of buffers the next step overwrites (use them before it runs)."""

    hidden: torch.Tensor  # [T, hc, D] final streams
    features: torch.Tensor | None  # [T, D * len(capture)] drafter features (None: nothing captured)
    positions: torch.Tensor  # [T] int64, as `ForwardBatch.positions`
    swa_slots: torch.Tensor  # [T] int64, as `ForwardBatch.swa_slots`


class LayerTable(NamedTuple):
    """One layer's arrays for `decode_layer`, in the slots of `kernel_abi.DECODE_WEIGHTS/SIZES/SCALARS`."""

    weights: torch.Tensor  # [len(DECODE_WEIGHTS)] int64 data pointers (0: absent)
    sizes: torch.Tensor  # int32
    scalars: torch.Tensor  # fp32
    keep: tuple[torch.Tensor, ...]  # the tensors behind the pointers, held while the table lives
    formats: dict[str, tuple[str, ...]]  # each projection's storages (`kernel_abi.PROJ_FORMATS`), segment by segment


def _fp32(t: object) -> torch.Tensor | None:
    """`t` when it is a contiguous fp32 CPU tensor (what the C loops read), else None."""
    if isinstance(t, torch.Tensor) and t.is_cpu and t.dtype is torch.float32 and t.is_contiguous():
        return t.detach()
    return None


def _projection_parts(layer: DecoderLayer) -> dict[str, list[object]] | str:
    """Each projection `decode_layer` reads through its GEMMs (`kernel_abi.DECODE_WEIGHTS` names) as its parts in row
    order: the stacked float matrix `fuse` built where there is one, else the layer's own weights and linears (a
    compact model keeps no stacked copy), or why the C step cannot read them."""
    attn, moe = layer.attn, layer.ffn
    if not (isinstance(attn, Attention) and isinstance(moe, MoE)):
        return f"{type(attn).__name__}/{type(moe).__name__} modules"
    fused_x = attn.fused_x
    if fused_x is None:
        return "projections not laid out for inference (`prepare_inference` not run)"
    stacked = fused_x.groups[0][1] if len(fused_x.groups) == 1 else None
    wx: list[object] = [stacked] if isinstance(stacked, torch.Tensor) else [attn.wq_a, attn.wkv]
    if not isinstance(stacked, torch.Tensor):
        if attn.compressor is not None:
            wx.append(attn.compressor.wkv_gate)
        if attn.indexer is not None:
            wx += [attn.indexer.compressor.wkv_gate, attn.indexer.weights_proj]
    parts: dict[str, list[object]] = {"wx": wx, "wq_b": [attn.wq_b], "wo_a": [attn.wo_a], "wo_b": [attn.wo_b]}
    if attn.indexer is not None:
        parts["i_wq_b"] = [attn.indexer.wq_b]
    if moe.c_decode is not None:  # float experts: the router and shared gate/up stacked by `fuse`
        parts |= {"moe_in": [moe.c_decode[0]], "w2s": [moe.c_decode[1]], "w13": [moe.w13], "w2": [moe.w2]}
    elif isinstance(moe.experts, CompactExperts):
        parts |= {"moe_in": [moe.gate, moe.shared.w1, moe.shared.w3], "w2s": [moe.shared.w2],
                  "w13": [(moe.experts, "w13")], "w2": [(moe.experts, "w2")]}
    else:
        what = "no C layout" if moe.experts is None else type(moe.experts).__name__
        return f"routed experts of {what} (ModelSlim int8 experts, or a MoE `fuse` did not lay out)"
    return parts


def _projection(parts: list[object], rows: int, inputs: int, name: str) -> ProjectionTable | str:
    """One projection's table from its parts (`_projection_parts`), checked to hold the `rows` rows of `inputs`
    values the C loops will read (they trust their sizes)."""
    segments: list[Segment] = []
    for part in parts:
        seg = expert_segment(*part) if isinstance(part, tuple) else segment_of(part, bf16_copy=True)
        if isinstance(seg, str):
            return f"weight {name}: {seg}"
        if seg.inputs != inputs:
            return f"weight {name} has rows of {seg.inputs} inputs where the layer's sizes give {inputs}"
        segments.append(seg)
    if sum(s.rows for s in segments) != rows:
        return f"weight {name} has {sum(s.rows for s in segments)} rows where the layer's sizes give {rows}"
    return projection_table(segments)


def layer_table(layer: DecoderLayer, cfg: ModelConfig) -> LayerTable | str:
    """The table of one target layer, or why it has none (a weight the C loops cannot read: off the CPU, a format
    without a C kernel, a vector that is not fp32)."""
    if isinstance(getattr(layer.ffn, "exchange", None), TokenExchange):
        return "DP-attention: the C decode step does not exchange token rows between ranks yet"
    parts = _projection_parts(layer)
    if isinstance(parts, str):
        return parts
    attn, moe = layer.attn, layer.ffn
    assert isinstance(attn, Attention) and isinstance(moe, MoE)  # (`_projection_parts` checked)
    frozen = (layer.attn_hc._frozen, layer.ffn_hc._frozen)
    if None in frozen:
        return "the hyper-connection mixes are not frozen (`prepare_inference` not run)"
    w: dict[str, torch.Tensor | None] = {
        "attn_fn": frozen[0][0], "attn_scale": frozen[0][1], "attn_base": frozen[0][2],  # type: ignore[index]
        "ffn_fn": frozen[1][0], "ffn_scale": frozen[1][1], "ffn_base": frozen[1][2],  # type: ignore[index]
        "attn_norm": layer.attn_norm.weight, "ffn_norm": layer.ffn_norm.weight,
        "q_norm": attn.q_norm.weight, "kv_norm": attn.kv_norm.weight, "sink": attn.attn_sink,
    }
    if attn.compressor is not None:
        w |= {"c_ape": attn.compressor.ape, "c_norm": attn.compressor.norm.weight}
    if attn.indexer is not None:
        w |= {"i_ape": attn.indexer.compressor.ape, "i_norm": attn.indexer.compressor.norm.weight}
    if not moe.is_hash:
        w["bias"] = moe.bias
    checked = {k: _fp32(v) for k, v in w.items()}
    if any(v is None for v in checked.values()):
        odd = next(k for k, v in checked.items() if v is None)
        t = w[odd]
        what = f"{t.dtype} on {t.device}" if isinstance(t, torch.Tensor) else type(t).__name__
        return f"weight {odd} is {what}, not a contiguous fp32 CPU tensor"
    tid2eid = moe.get_buffer("tid2eid") if moe.is_hash else None
    if tid2eid is not None:
        if not (tid2eid.dtype is torch.int64 and tid2eid.is_contiguous() and tid2eid.is_cpu):
            return f"tid2eid is {tid2eid.dtype} on {tid2eid.device}, not contiguous int64 on the CPU"
        checked["tid2eid"] = tid2eid
    kind = {CSA: kernel_abi.DECODE_CSA, HCA: kernel_abi.DECODE_HCA}.get(attn.layer_type, kernel_abi.DECODE_SLIDING)
    comp = attn.compressor
    idx = attn.indexer
    inter = moe.experts.inter if isinstance(moe.experts, CompactExperts) else moe.w2.shape[2]
    sizes = {
        "kind": kind, "hc": cfg.hc_mult, "iters": cfg.hc_sinkhorn_iters, "hidden": cfg.hidden_size,
        "q_lora": cfg.q_lora_rank, "heads": attn.n_heads, "head_dim": attn.head_dim, "o_groups": attn.o_groups,
        "o_lora": cfg.o_lora_rank, "c_ratio": 0 if comp is None else comp.ratio,
        "c_dim": 0 if comp is None else comp.dim,
        "i_heads": 0 if idx is None else idx.n_heads, "i_dim": 0 if idx is None else idx.dim,
        "i_topk": 0 if idx is None else idx.topk, "experts": moe.n_experts, "inter": inter,
        "top_k": moe.top_k, "sqrtsoftplus": int(moe.scoring_func == "sqrtsoftplus"),
        "expert0": moe.shard.first, "experts_held": moe.shard.count,
    }
    # The rows and inputs of each projection (decode_layer.c reads these many).
    D, QL, L, G = cfg.hidden_size, cfg.q_lora_rank, cfg.o_lora_rank, attn.o_groups
    cw = 0 if comp is None else comp.dim * (2 if kind == kernel_abi.DECODE_CSA else 1)
    iw = 0 if idx is None else 2 * idx.dim
    shapes = {"wx": (QL + attn.head_dim + 2 * cw + (0 if idx is None else 2 * iw + idx.n_heads), D),
              "wq_b": (attn.n_heads * attn.head_dim, QL), "wo_a": (G * L, attn.n_heads * attn.head_dim // G),
              "wo_b": (D, G * L), "i_wq_b": (0 if idx is None else idx.n_heads * idx.dim, QL),
              "moe_in": (moe.n_experts + 2 * inter, D), "w13": (moe.shard.count * 2 * inter, D),
              "w2": (moe.shard.count * D, inter), "w2s": (D, inter)}
    projections: dict[str, ProjectionTable] = {}
    for name, ps in parts.items():
        table = _projection(ps, *shapes[name], name)
        if isinstance(table, str):
            return table
        projections[name] = table
    scalars = {
        "hc_eps": layer.attn_hc.hc_eps, "hc_norm_eps": layer.attn_hc.norm_eps, "attn_norm_eps": layer.attn_norm.eps,
        "ffn_norm_eps": layer.ffn_norm.eps, "q_eps": attn.q_norm.eps, "head_eps": attn.eps,
        "kv_eps": attn.kv_norm.eps, "scale": attn.scale, "c_eps": 0.0 if comp is None else comp.norm.eps,
        "i_eps": 0.0 if idx is None else idx.compressor.norm.eps,
        "i_wscale": 0.0 if idx is None else idx.n_heads**-0.5, "i_scale": 0.0 if idx is None else idx.dim**-0.5,
        "scaling": moe.scaling, "limit": moe.limit,
    }
    if layer.attn_hc.hc_eps != layer.ffn_hc.hc_eps or layer.attn_hc.norm_eps != layer.ffn_hc.norm_eps:
        return "the attention and FFN hyper-connections have different epsilons"
    pointers = {n: v.data_ptr() for n, v in checked.items() if v is not None}
    pointers |= {n: p.words.data_ptr() for n, p in projections.items()}
    # Expert parallelism: the C function that sums the (token, slot) outputs over the group (0: one process).
    assert not isinstance(moe.exchange, TokenExchange)  # (refused above)
    pointers["exchange"] = 0 if moe.exchange is None else moe.exchange.c_pointer
    return LayerTable(
        torch.tensor([pointers.get(n, 0) for n in kernel_abi.DECODE_WEIGHTS], dtype=torch.int64),
        torch.tensor([sizes[n] for n in kernel_abi.DECODE_SIZES], dtype=torch.int32),
        torch.tensor([scalars[n] for n in kernel_abi.DECODE_SCALARS], dtype=torch.float32),
        (*(v for v in checked.values() if v is not None),
         *(t for p in projections.values() for t in (p.words, *p.keep))),
        {n: p.formats for n, p in projections.items()},
    )


def _plan_pointers(plan: CompressPlan | None) -> list[int]:
    if plan is None:
        return [0] * 7
    return [t.data_ptr() for t in (plan.out_rows, plan.positions, plan.use_cur, plan.cur_rows, plan.hist_rows,
                                   plan.write_tokens, plan.write_rows)]


class DecodeStep:
    """Every layer's table, and the step paths that use them (`try_run`, `try_run_indexed`)."""

    def __init__(self, tables: list[LayerTable], cfg: ModelConfig, exchange: SlotExchange | None = None):
        self.tables = tables
        self.cfg = cfg
        self.exchange = exchange  # expert parallelism: the layers' exchange (it holds a failure's cause)
        self.scratch = torch.empty(0)
        self.ids = torch.empty(max(cfg.num_experts_per_tok, 1), dtype=torch.int64)
        self._pools: tuple[list[int], list[torch.Tensor]] | None = None  # (layer 0's pointers, every layer's table)
        self._indexed: _IndexedStep | None = None  # the indexed path's arrays (built on its first step)
        self._not_indexed: tuple[tuple[int, ...], int] | None = None  # (layout, pools id) it cannot serve
        # The captured layers of the indexed path: (capture, int32 [layers] column block per layer or -1,
        # fp32 [MAX_TOKENS, D * len(capture)] features buffer), rebuilt when the capture changes.
        self._capture: tuple[tuple[int, ...], torch.Tensor, torch.Tensor] | None = None

    @classmethod
    def build(cls, layers: list[DecoderLayer], cfg: ModelConfig) -> DecodeStep | str:
        """The step path, or why there is none (some layer has no table, or no C kernels here)."""
        if cpu_kernels.load() is None:
            return "no C kernels (PDSPARK_NO_C_KERNELS=1, or they could not be built: see the log above)"
        tables: list[LayerTable] = []
        for i, layer in enumerate(layers):
            table = layer_table(layer, cfg)
            if isinstance(table, str):
                return f"layer {i}: {table}"
            tables.append(table)
        moes = [layer.ffn for layer in layers if isinstance(layer.ffn, MoE)]
        exchange = moes[0].exchange if moes else None
        assert not isinstance(exchange, TokenExchange)  # (`layer_table` refused it)
        return cls(tables, cfg, exchange)

    @staticmethod
    def _applies(batch: ForwardBatch) -> bool:
        """A step of a few tokens, each gathering its own window, with every index on the CPU."""
        return (batch.num_tokens <= MAX_TOKENS and not batch.segments and batch.prepare_streams is None
                and batch.positions.is_cpu and not torch.is_grad_enabled())

    def try_run(self, batch: ForwardBatch, pools: LayerCaches, embed: torch.Tensor,
                ropes: tuple[RotaryTable, RotaryTable], capture: tuple[int, ...] = ()) -> StepOutput | None:
        """Every layer of a small step (one C call each) -> its final streams and the features of the `capture`
        layers, as `DSV4Model.forward`'s; None where the step or the pools are not what the C loops read (a
        long or multi-stream step, grad mode, indices or pools off the CPU, pools neither fp32 row-major nor the FP8
        cache's packed rows).
        `ropes`: the sliding and compressed rotary tables."""
        if not self._applies(batch):
            return None
        pool_tables = self.pool_tables(pools)
        if pool_tables is None:
            return None
        rope_main, rope_compress = ropes
        x = F.embedding(batch.input_ids, embed).float()  # (a compact model's embedding is bf16: exact)
        h = x.unsqueeze(1).expand(-1, self.cfg.hc_mult, -1).contiguous()  # [T, hc, D]
        # The rotation factors at the step's positions, held in locals: the step table points into them.
        main_at, comp_at = rope_main.at(batch.positions), rope_compress.at(batch.positions)
        step = self.step_table(batch, rope_compress, main_at, comp_at, self.pools_packed)
        captured: dict[int, torch.Tensor] = {}
        for i in range(len(self.tables)):
            h = self.run_layer(i, h, pool_tables[i], step)  # one C call
            if i in capture:
                captured[i] = h.mean(dim=1)
        features = torch.cat([captured[i] for i in capture], dim=-1) if capture else None
        return StepOutput(h, features)

    def step_table(self, batch: ForwardBatch, rope_compress: RotaryTable,
                   main_at: tuple[torch.Tensor, torch.Tensor], comp_at: tuple[torch.Tensor, torch.Tensor],
                   packed: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's pointer and size arrays (`kernel_abi.DECODE_STEP/STEP_SIZES`), shared by every layer. They
        point into `batch`, `main_at` and `comp_at`: the caller keeps those alive while the step runs. `packed`: the
        pools hold the FP8 cache's packed rows (the scratch is sized for their staging)."""
        csa, hca = batch.csa, batch.hca
        ptrs = [batch.positions.data_ptr(), batch.input_ids.data_ptr(), batch.swa_slots.data_ptr(),
                batch.window.rows.data_ptr(), batch.window.valid.data_ptr(),
                0 if csa is None else csa.rows.data_ptr(), 0 if csa is None else csa.valid.data_ptr(),
                0 if hca is None else hca.rows.data_ptr(), 0 if hca is None else hca.valid.data_ptr(),
                main_at[0].data_ptr(), main_at[1].data_ptr(), comp_at[0].data_ptr(), comp_at[1].data_ptr(),
                rope_compress.cos.data_ptr(), rope_compress.sin.data_ptr(),
                *_plan_pointers(batch.csa_plan), *_plan_pointers(batch.hca_plan)]
        sizes = [batch.num_tokens, batch.window.rows.shape[1], rope_compress.cos.shape[1],
                 0 if csa is None else csa.max_visible, 0 if hca is None else hca.max_visible,
                 0 if batch.csa_plan is None else batch.csa_plan.num_groups,
                 0 if batch.csa_plan is None else int(batch.csa_plan.write_tokens.shape[0]),
                 0 if batch.hca_plan is None else batch.hca_plan.num_groups,
                 0 if batch.hca_plan is None else int(batch.hca_plan.write_tokens.shape[0])]
        V = max(0 if csa is None else csa.max_visible, 0 if hca is None else hca.max_visible)
        need = self.scratch_floats(batch.num_tokens, V, batch.window.rows.shape[1], packed)
        if self.scratch.numel() < need:
            self.scratch = torch.empty(2 * need)  # persistent: reused by every layer of every step
        return torch.tensor(ptrs, dtype=torch.int64), torch.tensor(sizes, dtype=torch.int32)

    def scratch_floats(self, T: int, V: int, W: int, packed: bool = False) -> int:
        """What `decode_layer` carves from its scratch for `T` tokens, `V` visible compressed entries and a window
        of `W` (over the FP8 cache's packed rows or not), at the most demanding layer (the C library's own formula:
        the two cannot drift apart)."""
        return max(cpu_kernels.decode_layer_scratch_floats(t.sizes, T, V, W, packed) for t in self.tables)

    @property
    def pools_packed(self) -> bool:
        """Whether the pools `pool_tables` last accepted hold the FP8 cache's packed rows."""
        return self._pools is not None and any(bool(t[-1]) or bool(t[-2]) for t in self._pools[1])

    def pool_tables(self, pools: LayerCaches) -> list[torch.Tensor] | None:
        """Each layer's pool pointers and row strides (`kernel_abi.DECODE_POOLS`), or None where the pools are neither
        fp32 row-major CPU tensors nor the FP8 cache's packed rows. Cached: the pools never move, and layer 0's views
        identify them."""
        first = self._pool_pointers(pools, 0)
        if first is None:
            return None
        if self._pools is None or self._pools[0] != first:
            tables = [self._pool_pointers(pools, i) for i in range(len(self.tables))]
            if any(t is None for t in tables):
                return None
            self._pools = (first, [torch.tensor(t, dtype=torch.int64) for t in tables])
        return self._pools[1]

    def _pool_pointers(self, pools: LayerCaches, i: int) -> list[int] | None:
        """Layer `i`'s `kernel_abi.DECODE_POOLS`: fp32 row-major pools, or the FP8 cache's packed rows
        (`PackedRows`: main KV rows of this model's head and rope widths, indexer key rows of its index width; the
        SWA and compressed pools both packed or both not), and the indexer's fp32 keys in blocks (`BlockedRows`);
        None otherwise."""
        cache = pools.layer(i)
        ptrs: list[int] = []
        for kind, v in (("kv", cache.swa_kv), ("kv", cache.comp_kv), ("state", cache.comp_state),
                        ("index", cache.index_kv), ("state", cache.index_state)):
            if v is None:
                ptrs += [0, 0]
                continue
            if isinstance(v, BlockedRows):
                if not (v.is_cpu and v.dtype is torch.float32 and v.blocks.shape[1] == self.cfg.index_head_dim):
                    return None
                ptrs += [v.data_ptr(), v.block_stride()]
                continue
            rows = self._c_rows(kind, v)
            if rows is None:
                return None
            ptrs += [rows.data_ptr(), rows.stride(0)]
        kv_packed = isinstance(cache.swa_kv, PackedRows)
        if cache.comp_kv is not None and isinstance(cache.comp_kv, PackedRows) != kv_packed:
            return None  # (not a cache this engine builds)
        keys = "packed" if isinstance(cache.index_kv, PackedRows) else "blocked" if isinstance(
            cache.index_kv, BlockedRows) else "rows"
        return [*ptrs, int(kv_packed), kernel_abi.INDEX_KEYS.index(keys)]

    def _c_rows(self, kind: str, v: torch.Tensor | PackedRows) -> torch.Tensor | None:
        """What the C step reads of a pool of `kind` (kv, index, state): an fp32 row-major CPU tensor as it is, or a
        `PackedRows`' uint8 storage in a format `packed_rows.c` reads (states are never packed); None otherwise."""
        if isinstance(v, PackedRows):
            if kind == "state" or v.rows_dtype is not torch.float32 or not self._packs_as_c_reads(kind, v.pack):
                return None
            rows, dtype = v.storage, torch.uint8
        else:
            rows, dtype = v, torch.float32
        return rows if rows.is_cpu and rows.dtype is dtype and rows.dim() == 2 and rows.stride(1) == 1 else None

    def _packs_as_c_reads(self, kind: str, pack: object) -> bool:
        """The row format `packed_rows.c` reads for this model: main KV rows of `head_dim` with `rope_dim` bf16
        channels, indexer key rows of `index_head_dim`."""
        cfg = self.cfg
        if kind == "kv":
            return isinstance(pack, KvRowPack) and (pack.dim, pack.rope) == (cfg.head_dim, cfg.rope_dim)
        return isinstance(pack, IndexRowPack) and pack.dim == cfg.index_head_dim

    def run_layer(self, i: int, h: torch.Tensor, pools: torch.Tensor, step: tuple[torch.Tensor, torch.Tensor]
                  ) -> torch.Tensor:
        """Layer `i` on the streams `h [T, hc, D]` (`pools`: its entry of `pool_tables`)."""
        t = self.tables[i]
        with exchange_errors(self.exchange):
            return cpu_kernels.decode_layer(t.weights, t.sizes, t.scalars, step[0], step[1], pools, h, self.scratch,
                                            self.ids)

    # ---- the indexed path: the step's indices built in C from the page tables, every layer in one more call ----
    def try_run_indexed(self, req: list[int], cache_layout: tuple[int, ...], pools: LayerCaches,
                        embed: torch.Tensor, ropes: tuple[RotaryTable, RotaryTable], capture: tuple[int, ...] = ()
                        ) -> IndexedOutput | None:
        """Every layer of a step of short chunks -> its streams, its drafter features (the output of each layer in
        `capture` averaged over the streams, as `DSV4Model.forward`'s) and its positions and SWA slots, all views
        of buffers the next step reuses; None for a step of more than `MAX_TOKENS` tokens, in grad mode, where the
        pools or tables are not what the C loops read, or where a layer is captured twice or does not exist.

        `req`: `[n, (slot, start, length) per chunk, every chunk's token ids]`; `cache_layout`: the cache's part of
        `kernel_abi.DECODE_LAYOUT` (everything before the rotary tables); `ropes`: the sliding and compressed tables.
        The same indices as `build_forward_batch` (`kernels.decode_index`), without a `ForwardBatch`."""
        if len(req) - 1 - 3 * req[0] > MAX_TOKENS or torch.is_grad_enabled():
            return None
        st = self._indexed
        if st is None or st.cache_layout != cache_layout or st.pools is not pools:
            if self._not_indexed == (cache_layout, id(pools)):
                return None  # (tried for these pools already: not fp32 CPU tables)
            st = self._indexed = _IndexedStep.build(self, cache_layout, pools, embed, ropes)
            if st is None:
                self._not_indexed = (cache_layout, id(pools))
                return None
        if capture and (len(set(capture)) != len(capture) or not all(0 <= i < len(self.tables) for i in capture)):
            return None  # (a layer captured twice or past the last: the module path's cat handles it)
        cap = self._capture_buffers(capture)
        T = cpu_kernels.decode_index(torch.tensor(req, dtype=torch.int64), st.layout, st.step, st.step_sizes,
                                     MAX_TOKENS)
        with exchange_errors(self.exchange):
            k = cpu_kernels.decode_layers(st.layers, st.step, st.step_sizes, embed, st.h, st.scratch, self.ids, cap)
        return IndexedOutput(st.h[k][:T], None if cap is None else cap[1][:T], st.positions[:T], st.swa_slots[:T])

    def _capture_buffers(self, capture: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """`decode_layers`' capture arrays for `capture` (None: nothing captured)."""
        if not capture:
            return None
        if self._capture is None or self._capture[0] != capture:
            cols = [-1] * len(self.tables)
            for c, layer in enumerate(capture):
                cols[layer] = c
            feats = torch.empty(MAX_TOKENS, self.cfg.hidden_size * len(capture))
            self._capture = (capture, torch.tensor(cols, dtype=torch.int32), feats)
        return self._capture[1], self._capture[2]


class _IndexedStep(NamedTuple):
    """The persistent arrays of the indexed path: written in place every step, so the step table never changes."""

    cache_layout: tuple[int, ...]
    pools: LayerCaches  # held: the pool pointers in `layers` stay valid while it lives
    layout: torch.Tensor  # int64 `kernel_abi.DECODE_LAYOUT`
    step: torch.Tensor  # int64 `kernel_abi.DECODE_STEP`: pointers to `buffers`
    step_sizes: torch.Tensor  # int32 `kernel_abi.DECODE_STEP_SIZES`, written by `decode_index`
    layers: torch.Tensor  # [layers, 4] int64: weights, sizes, scalars, pools pointers
    positions: torch.Tensor  # [MAX_TOKENS] int64 (the `positions` buffer of `step`)
    swa_slots: torch.Tensor  # [MAX_TOKENS] int64 (the `swa_slots` buffer of `step`)
    h: tuple[torch.Tensor, torch.Tensor]  # [MAX_TOKENS, hc, D] streams, in and out by turns
    scratch: torch.Tensor
    keep: tuple[torch.Tensor, ...]  # what `step`, `layout` and `layers` point into

    @classmethod
    def build(cls, ds: DecodeStep, cache_layout: tuple[int, ...], pools: LayerCaches, embed: torch.Tensor,
              ropes: tuple[RotaryTable, RotaryTable]) -> _IndexedStep | None:
        tables = ds.pool_tables(pools)
        tabs = [_fp32(t) for r in ropes for t in (r.cos, r.sin)]
        plain_embed = embed.is_cpu and embed.is_contiguous() and embed.dtype in (torch.float32, torch.bfloat16)
        if tables is None or not plain_embed or any(t is None for t in tabs):
            return None
        main_cos, main_sin, comp_cos, comp_sin = tabs
        assert main_cos is not None and main_sin is not None and comp_cos is not None and comp_sin is not None
        cfg, T = ds.cfg, MAX_TOKENS
        names = kernel_abi.DECODE_LAYOUT
        at = dict(zip(names, cache_layout))
        W, r, max_len = at["window"], comp_cos.shape[1], comp_cos.shape[0]
        csa_r, hca_r = at["csa_ratio"], at["hca_ratio"]
        layout = [*cache_layout, main_cos.data_ptr(), main_sin.data_ptr(), comp_cos.data_ptr(), comp_sin.data_ptr(), r]
        assert len(layout) == len(names)

        def longs(n: int) -> torch.Tensor:
            return torch.zeros(max(n, 1), dtype=torch.int64)

        def flags(n: int) -> torch.Tensor:
            return torch.zeros(max(n, 1), dtype=torch.uint8)

        def plan(ratio: int, span: int) -> list[torch.Tensor | None]:
            if ratio == 0:
                return [None] * 7
            return [longs(T), longs(T), flags(T * span), longs(T * span), longs(T * span), longs(T), longs(T)]

        Vc = 0 if csa_r == 0 else max_len // csa_r + 1
        Vh = 0 if hca_r == 0 else max_len // hca_r + 1
        buffers: list[torch.Tensor | None] = [
            longs(T), longs(T), longs(T), longs(T * W), flags(T * W),
            longs(T * Vc) if Vc else None, flags(T * Vc) if Vc else None,
            longs(T * Vh) if Vh else None, flags(T * Vh) if Vh else None,
            torch.empty(T * r), torch.empty(T * r), torch.empty(T * r), torch.empty(T * r), comp_cos, comp_sin,
            *plan(csa_r, 2 * csa_r), *plan(hca_r, hca_r),
        ]
        assert len(buffers) == len(kernel_abi.DECODE_STEP)
        kept = [b for b in buffers if b is not None]
        step = torch.tensor([0 if b is None else b.data_ptr() for b in buffers], dtype=torch.int64)
        layers = torch.tensor([[t.weights.data_ptr(), t.sizes.data_ptr(), t.scalars.data_ptr(), p.data_ptr()]
                               for t, p in zip(ds.tables, tables)], dtype=torch.int64)
        h = (torch.empty(T, cfg.hc_mult, cfg.hidden_size), torch.empty(T, cfg.hc_mult, cfg.hidden_size))
        scratch = torch.empty(ds.scratch_floats(T, max(Vc, Vh), W, ds.pools_packed))
        positions, swa_slots = buffers[0], buffers[2]
        assert positions is not None and swa_slots is not None
        return cls(cache_layout, pools, torch.tensor(layout, dtype=torch.int64), step,
                   torch.zeros(len(kernel_abi.DECODE_STEP_SIZES), dtype=torch.int32), layers, positions, swa_slots,
                   h, scratch, (*kept, *tables))
