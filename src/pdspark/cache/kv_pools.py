"""`KVPools`: every tensor of the DSV4 cache, laid out as below.

| pool         | rows addressed by                                   | row content                         |
|--------------|-----------------------------------------------------|-------------------------------------|
| swa_kv       | SWA slot (`swa_page * page_size + pos % page_size`) | raw K=V latent, every layer         |
| c4_kv        | `full_slot // csa_ratio`                            | compressed KV, CSA layers           |
| c4_index     | `full_slot // csa_ratio`                            | compressed indexer key, CSA layers  |
| c128_kv      | `c128_page * c128_page_size + g % c128_page_size`   | compressed KV, HCA layers           |
| c4_state     | `swa_page * csa_ring + pos % csa_ring`              | fp32 `[kv | score]`, page-scoped    |
| c4_index_state | same as c4_state                                  | indexer compressor state            |
| c128_state   | `req_slot * hca_ring + pos % hca_ring`              | fp32 `[kv | score]`, request-scoped |
| draft_kv     | SWA slot (same geometry as swa_kv)                  | DSpark stage K=V rows (injected)    |

An fp32 cache keeps c4_index's rows in blocks of 8, channel-major within a block, where every page holds whole
blocks (`model/blocked_rows.py`: what the indexer's C pick reads in place); a page is one span of bytes either way.

Every pool ends with a dummy row (the SWA pool with a dummy page) that padded or invalid positions map to, so
gathers never see a negative index. State dummy rows hold `kv = 0, score = -inf`, which gives them zero weight in
the compressor softmax.

Layout: row-major over layers ("page-major"). Each pool's storage is `[rows, layers, width]`: one row of every
layer is contiguous, so one page (a run of rows) of every layer is one contiguous span, and a run of pages too. A
transfer then moves one span per pool kind per run of pages, not one per layer (the transfer engine's cost is per
entry). The attributes below are the per-layer views `[layers, rows, width]` of that storage (`storage.permute`):
`pools.swa_kv[layer]` is a `[rows, width]` view with a row stride of `layers * width`, so the attention code
indexes rows exactly as it would a contiguous per-layer tensor.
"""

from __future__ import annotations

import torch

from pdspark.cache.pool_sizes import PoolSizes
from pdspark.errors import ConfigError
from pdspark.hardware.cpu.kernel_abi import ROW_BLOCK
from pdspark.model.batch import LayerCache
from pdspark.model.blocked_rows import BlockedRows, blocks_fit
from pdspark.model.model_config import ModelConfig
from pdspark.model.packed_rows import PackedRows, RowPack
from pdspark.quant.kv_fp8 import IndexRowPack, KvRowPack

KV_CACHE_DTYPES = ("auto", "fp8_e4m3")


class KVPools:
    def __init__(
        self,
        model: ModelConfig,
        sizes: PoolSizes,
        dtype: torch.dtype,
        device: torch.device | str,
        draft_stages: int = 0,
        kv_cache_dtype: str = "auto",
    ):
        """`kv_cache_dtype`: "auto" (rows of `dtype`) or "fp8_e4m3" (the main KV and indexer key rows packed,
        `quant/kv_fp8.py`: uint8 pools whose layer views are `PackedRows`; states and the draft's rows stay `dtype`)."""
        if kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(f"`kv_cache_dtype` is {kv_cache_dtype!r}; allowed: {list(KV_CACHE_DTYPES)}")
        self.model = model
        self.sizes = sizes
        P = sizes.page_size
        d, di = model.head_dim, model.index_head_dim
        n_csa, n_hca = len(model.csa_layers), len(model.hca_layers)
        c4_rows = sizes.num_full_slots // model.csa_ratio
        c128_rows = sizes.num_c128_pages * sizes.c128_page_size
        self.kv_pack: KvRowPack | None = None
        self.index_pack: IndexRowPack | None = None
        row, index_row, row_dtype = d, di, dtype  # each main/indexer row: width and element dtype
        if kv_cache_dtype == "fp8_e4m3":
            self.kv_pack, self.index_pack = KvRowPack(d, model.rope_dim), IndexRowPack(di)
            row, index_row, row_dtype = self.kv_pack.width, self.index_pack.width, torch.uint8
        self.kv_dtype = str(dtype).removeprefix("torch.") if kv_cache_dtype == "auto" else kv_cache_dtype
        self.rows_dtype = dtype  # what the model reads and writes, packed or not
        # [layers, (num_swa_pages + 1 dummy page) * page_size, head_dim]
        self.swa_kv = _page_major(model.num_hidden_layers, (sizes.num_swa_pages + 1) * P, row, row_dtype, device)
        # [draft stages, same rows as swa_kv, head_dim]: the drafter's context, at the target's SWA slots
        self.draft_kv = _page_major(draft_stages, (sizes.num_swa_pages + 1) * P, d, dtype, device)
        # [csa layers, c4 rows + 1, head_dim] and [csa layers, c4 rows + 1, index_head_dim]
        self.c4_kv = _page_major(n_csa, c4_rows + 1, row, row_dtype, device)
        # The indexer's float keys in blocks of ROW_BLOCK rows (its C pick reads them in place: `BlockedRows`) where
        # every page holds whole blocks; the dummy row then has a block of its own (7 rows unused). `c4_index` stays
        # the storage's `[layers, rows, width]` view, which transfers and the dummy check read as bytes: a page's
        # rows are its span of bytes in either layout.
        rows_per_page = P // model.csa_ratio if n_csa else 0
        self.index_blocked = kv_cache_dtype == "auto" and n_csa > 0 and blocks_fit(rows_per_page)
        index_rows = c4_rows + (ROW_BLOCK if self.index_blocked else 1)
        self.c4_index = _page_major(n_csa, index_rows, index_row, row_dtype, device)
        # [hca layers, c128 rows + 1, head_dim]
        self.c128_kv = _page_major(n_hca, c128_rows + 1, row, row_dtype, device)
        # Compressor states: [layers, rows + 1, 2 * coff * dim]; CSA overlaps (coff 2), HCA does not (coff 1).
        self.c4_state = _state(n_csa, sizes.num_swa_pages * sizes.csa_ring, 2 * d, device)
        self.c4_index_state = _state(n_csa, sizes.num_swa_pages * sizes.csa_ring, 2 * di, device)
        self.c128_state = _state(n_hca, sizes.num_req_slots * sizes.hca_ring, d, device)
        self._csa_pos = {layer: i for i, layer in enumerate(model.csa_layers)}
        self._hca_pos = {layer: i for i, layer in enumerate(model.hca_layers)}

    # ---- dummy rows -----------------------------------------------------------------------------------------------
    @property
    def swa_dummy_page(self) -> int:
        return self.sizes.num_swa_pages

    @property
    def swa_dummy_slot(self) -> int:
        return self.sizes.num_swa_pages * self.sizes.page_size

    @property
    def c4_dummy_row(self) -> int:
        return self.c4_kv.shape[1] - 1

    @property
    def c128_dummy_row(self) -> int:
        return self.c128_kv.shape[1] - 1

    @property
    def c4_state_dummy_row(self) -> int:
        return self.c4_state.shape[1] - 1

    @property
    def c128_state_dummy_row(self) -> int:
        return self.c128_state.shape[1] - 1

    def layer(self, layer_id: int) -> LayerCache:
        swa = self._rows(self.swa_kv[layer_id])
        if layer_id in self._csa_pos:
            i = self._csa_pos[layer_id]
            index = self._index_blocks(i) if self.index_blocked else self._rows(self.c4_index[i], self.index_pack)
            return LayerCache(swa, self._rows(self.c4_kv[i]), self.c4_state[i], index,  # type: ignore[arg-type]
                              self.c4_index_state[i])
        if layer_id in self._hca_pos:
            i = self._hca_pos[layer_id]
            return LayerCache(swa, self._rows(self.c128_kv[i]), self.c128_state[i], None, None)
        return LayerCache(swa, None, None, None, None)

    def _rows(self, view: torch.Tensor, pack: RowPack | None = None) -> torch.Tensor:
        """A layer's view of a main KV pool (or, with `pack`, of the indexer keys), as the model reads it: the view
        itself, or its `PackedRows` in an FP8 cache (read and written as rows of the compute dtype)."""
        chosen: RowPack | None = pack if pack is not None else self.kv_pack
        return view if chosen is None else PackedRows(view, chosen, self.rows_dtype)  # type: ignore[return-value]

    def _index_blocks(self, i: int) -> BlockedRows:
        """CSA layer `i`'s indexer keys as blocks `[B, width, ROW_BLOCK]` of the storage `[B * ROW_BLOCK, layers,
        width]`: block b of layer i is the `width * ROW_BLOCK` elements at `(b * layers + i) * width * ROW_BLOCK`."""
        layers, rows, width = self.c4_index.shape
        blocks = self.c4_index.as_strided((rows // ROW_BLOCK, width, ROW_BLOCK),
                                          (layers * width * ROW_BLOCK, ROW_BLOCK, 1), i * width * ROW_BLOCK)
        return BlockedRows(blocks)

    def index_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """Every CSA layer's indexer keys of `rows [n]` -> `[csa layers, n, width]` (fp32 rows, decoded where packed),
        whatever the pool's layout."""
        views = [v for v in (self.layer(layer).index_kv for layer in self.model.csa_layers) if v is not None]
        return torch.stack([v.index_select(0, rows) for v in views]) if views else self.c4_index[:, rows]

    def clear_c128_state_rows(self, rows: torch.Tensor) -> None:
        """Reset request-ring rows to the empty state (kv = 0, score = -inf)."""
        if self.c128_state.shape[0] and rows.numel():
            self.c128_state[:, rows] = _cleared_like(self.c128_state[:, rows])

    def check_dummy_rows(self) -> None:
        """The dummy rows must never be written; a non-empty dummy row means an index escaped its mask."""
        P = self.sizes.page_size
        assert not self.swa_kv[:, self.swa_dummy_slot : self.swa_dummy_slot + P].any(), "SWA dummy page written"
        assert not self.draft_kv[:, self.swa_dummy_slot : self.swa_dummy_slot + P].any(), "draft dummy page written"
        dummy = self.c4_dummy_row  # (and, where the keys are in blocks, the 7 unused rows of its block)
        assert not self.c4_kv[:, -1].any() and not self.c4_index[:, dummy:].any(), "C4 dummy row written"
        assert not self.c128_kv[:, -1].any(), "C128 dummy row written"
        for state in (self.c4_state, self.c4_index_state, self.c128_state):
            if state.shape[0]:
                half = state.shape[-1] // 2
                assert not state[:, -1, :half].any(), "state dummy row kv written"
                assert torch.isneginf(state[:, -1, half:]).all(), "state dummy row score written"


def _page_major(n_layers: int, rows: int, width: int, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """Zeroed storage `[rows, layers, width]` (one row of every layer contiguous), returned as the per-layer view
    `[layers, rows, width]`. `transfer_plan.cache_buffers` relies on this layout (it checks the strides)."""
    return torch.zeros(rows, n_layers, width, dtype=dtype, device=device).permute(1, 0, 2)


def _state(n_layers: int, rows: int, kv_width: int, device: torch.device | str) -> torch.Tensor:
    # [layers, rows + 1 dummy, kv_width (kv) + kv_width (score)], fp32 as DSV4 keeps compressor state; page-major.
    state = _page_major(n_layers, rows + 1, 2 * kv_width, torch.float32, device)
    _clear(state)
    return state


def _clear(state: torch.Tensor) -> None:
    half = state.shape[-1] // 2
    state[..., :half] = 0.0
    state[..., half:] = float("-inf")


def _cleared_like(rows: torch.Tensor) -> torch.Tensor:
    out = torch.zeros_like(rows)
    _clear(out)
    return out
