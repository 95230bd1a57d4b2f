"""`BlockedRows`: the indexer's fp32 keys in blocks of 8 rows, channel-major. Read and written as rows it is the row
pool it replaces; the C picks over it pick what they pick over the same keys as rows, whether a group of 8 entries is
a whole block (read in place) or not (copied out); and a page is still one span of bytes, so a transfer of a page
moves its rows of every layer."""

from __future__ import annotations

import pytest
import torch

from pdspark.cache.kv_pools import KVPools
from pdspark.cache.pool_sizes import PoolSizes
from pdspark.config import CacheConfig, SchedulerConfig
from pdspark.hardware.cpu import kernels as cpu_kernels
from pdspark.hardware.cpu.kernel_abi import ROW_BLOCK
from pdspark.model.blocked_rows import BlockedRows
from pdspark.model.model_config import ModelConfig

D = 128
TINY_FIELDS = dict(vocab_size=32, hidden_size=16, num_attention_heads=2, head_dim=8, partial_rotary_factor=0.5,
                   q_lora_rank=8, o_groups=1, o_lora_rank=8, sliding_window=8, index_n_heads=1, index_head_dim=8,
                   index_topk=4, n_routed_experts=2, num_experts_per_tok=1, moe_intermediate_size=8, hc_mult=2,
                   compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 16})


def _blocked_copy(rows: torch.Tensor, layers: int = 3, layer: int = 1) -> BlockedRows:
    """`rows [R, D]` (R a multiple of ROW_BLOCK) as layer `layer` of a page-major blocked storage of `layers`."""
    R, width = rows.shape
    storage = torch.zeros(R // ROW_BLOCK, layers, width, ROW_BLOCK)
    storage[:, layer] = rows.view(R // ROW_BLOCK, ROW_BLOCK, width).transpose(1, 2)
    return BlockedRows(storage[:, layer])


def test_blocked_rows_read_and_write_as_the_rows_they_hold():
    g = torch.Generator().manual_seed(0)
    rows = torch.randn(64, 24, generator=g)
    blocked = _blocked_copy(rows)
    assert blocked.shape == rows.shape and blocked.block_stride() == 3 * 24 * ROW_BLOCK
    at = torch.randint(0, 64, (5, 7), generator=g)
    assert torch.equal(blocked[at], rows[at]) and torch.equal(blocked.index_select(0, at[0]), rows[at[0]])
    some = torch.randperm(64, generator=g)[:20]
    values = torch.randn(20, 24, generator=g)
    blocked[some] = values
    rows[some] = values
    assert torch.equal(blocked[torch.arange(64)], rows)


def _pages(g: torch.Generator, pages: int, per_page: int, V: int) -> torch.Tensor:
    """The rows of V entries in random pages of `per_page` rows (as a request's compressed entries lie)."""
    order = torch.randperm(pages, generator=g)
    return (order[:, None] * per_page + torch.arange(per_page)[None, :]).reshape(-1)[:V].contiguous()


@pytest.mark.parametrize("arrangement", ["pages", "pages with a swap", "scattered"])
@pytest.mark.parametrize("V", [37, 64, 1000, 5000])
def test_the_c_pick_over_blocked_keys_is_the_pick_over_the_same_rows(arrangement, V):
    """Whole blocks (entries of a page, in order) are read in place; a group that is not one (a swap inside a page,
    rows anywhere, a short tail) is copied out first: every way, the mask of `index_pick` over the rows."""
    g = torch.Generator().manual_seed(V)
    T, H, R, k = 2, 4, 8192, 32
    keys = torch.randn(R, D, generator=g)
    blocked = _blocked_copy(keys)
    if arrangement == "scattered":
        rows = torch.stack([torch.randperm(R, generator=g)[:V] for _ in range(T)])
    else:
        rows = torch.stack([_pages(g, R // 32, 32, V) for _ in range(T)])
    valid = torch.rand(T, V, generator=g) > 0.05
    q, w = torch.randn(T, H, D, generator=g), torch.rand(T, H, generator=g)
    if arrangement == "pages with a swap":  # (the first group of 8 is no block, the others are)
        rows[:, [3, 4]] = rows[:, [4, 3]].clone()
        valid[:, 3:5] = True
        for t in range(T):  # entry 3 certain to be picked, entry 4 certain not: a swap of their scores shows
            keys[rows[t, 3]], keys[rows[t, 4]] = 10 * q[t, 0], 0.0
        blocked = _blocked_copy(keys)
    try:
        for threads in (1, 2):
            cpu_kernels.set_threads(threads)
            over_blocks = cpu_kernels.index_pick(q, w, blocked.blocks, rows, valid, D**-0.5, k, layout="blocked")
            over_rows = cpu_kernels.index_pick(q, w, keys, rows, valid, D**-0.5, k)
            assert over_blocks is not None and over_rows is not None
            assert torch.equal(over_blocks, over_rows) and int(over_rows.sum()) == T * min(k, V)
    finally:
        cpu_kernels.set_threads(1)


def test_a_prefill_segments_shared_pick_over_blocked_keys_is_its_pick_over_the_same_rows():
    g = torch.Generator().manual_seed(5)
    T, H, R, V, k = 40, 2, 4096, 3000, 64
    keys = torch.randn(R, D, generator=g)
    blocked = _blocked_copy(keys)
    rows = _pages(g, R // 16, 16, V)
    visible = torch.linspace(V // 2, V, T).long()
    valid = (torch.arange(V)[None, :] < visible[:, None]).contiguous()
    q, w = torch.randn(T, H, D, generator=g), torch.randn(T, H, generator=g)
    over_blocks = cpu_kernels.index_pick_shared(q, w, blocked.blocks, rows, valid, D**-0.5, k, layout="blocked")
    over_rows = cpu_kernels.index_pick_shared(q, w, keys, rows, valid, D**-0.5, k)
    assert over_blocks is not None and over_rows is not None
    assert torch.equal(over_blocks[0], over_rows[0]) and torch.equal(over_blocks[1], over_rows[1])


def test_blocks_of_the_wrong_width_or_an_unknown_layout_are_refused_by_name():
    keys = torch.zeros(4, 64, ROW_BLOCK)
    q, w = torch.zeros(1, 2, D), torch.zeros(1, 2)
    rows, valid = torch.zeros(1, 8, dtype=torch.int64), torch.ones(1, 8, dtype=torch.bool)
    with pytest.raises(cpu_kernels.KernelArgumentError, match="key blocks of 128 channels"):
        cpu_kernels.index_pick(q, w, keys, rows, valid, 1.0, 4, layout="blocked")
    with pytest.raises(cpu_kernels.KernelArgumentError, match="allowed: \\['rows', 'packed', 'blocked'\\]"):
        cpu_kernels.index_pick(q, w, keys, rows, valid, 1.0, 4, layout="columns")


def _pools(page_size: int, kv_cache_dtype: str = "auto") -> KVPools:
    """Pools of a tiny model with two CSA layers (index keys of 8 channels)."""
    kinds = ["sliding_attention", "compressed_sparse_attention", "compressed_sparse_attention",
             "heavily_compressed_attention"]
    model = ModelConfig.from_dict({**TINY_FIELDS, "num_hidden_layers": 4, "layer_types": kinds})
    cache = CacheConfig(page_size=page_size, num_full_pages=8, num_swa_pages=8, num_c128_pages=4)
    sizes = PoolSizes.derive(model, cache, SchedulerConfig(max_num_seqs=2, max_model_len=4 * page_size))
    return KVPools(model, sizes, torch.float32, "cpu", kv_cache_dtype=kv_cache_dtype)


def test_keys_are_blocked_where_every_page_holds_whole_blocks_and_a_page_stays_one_span_of_bytes():
    """The raw `c4_index` view is what a transfer copies (a page: `rows_per_page` rows of every layer); copying one
    page's span from one pool to another page of a second pool moves its rows, in every layer."""
    a, b = _pools(64), _pools(64)
    assert a.index_blocked and isinstance(a.layer(a.model.csa_layers[0]).index_kv, BlockedRows)
    assert not _pools(16).index_blocked  # (4 rows a page: half a block)
    assert not _pools(64, "fp8_e4m3").index_blocked
    per_page = a.sizes.page_size // a.model.csa_ratio
    g = torch.Generator().manual_seed(1)
    src, dst = torch.arange(2 * per_page, 3 * per_page), torch.arange(5 * per_page, 6 * per_page)
    for layer in a.model.csa_layers:
        view = a.layer(layer).index_kv
        view[src] = torch.randn(per_page, view.shape[1], generator=g)
    b.c4_index[:, dst] = a.c4_index[:, src]  # (the bytes of page 2 into page 5, as `transfer_plan` describes them)
    assert torch.equal(b.index_rows(dst), a.index_rows(src)) and bool(a.index_rows(src).abs().sum() > 0)
    a.check_dummy_rows()
    a.c4_index[0, a.c4_dummy_row + 3] = 1.0  # (a row of the dummy's block: never written)
    with pytest.raises(AssertionError, match="C4 dummy row written"):
        a.check_dummy_rows()
