"""The FP8 KV cache's rows (`quant/kv_fp8.py`): SGLang's sizes for DeepSeek-V4 (584 B main rows, 132 B indexer keys),
FP8 values with power-of-two block scales (main) or fp32 scales (indexer), bf16 rope channels, an unwritten (zero)
row reads as zeros, and `PackedRows` reads and writes them as fp32 rows."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pdspark.model.packed_rows import PackedRows
from pdspark.quant.kv_fp8 import IndexRowPack, KvRowPack


def test_deepseek_v4_rows_take_sglangs_bytes():
    assert KvRowPack(512, 64).width == 448 + 128 + 7 + 1 == 584
    assert IndexRowPack(128).width == 128 + 4 == 132


@settings(max_examples=40, deadline=None)
@given(dim=st.sampled_from([32, 64, 96, 512]), rope=st.sampled_from([8, 16, 64]), n=st.integers(1, 9),
       magnitude=st.floats(1e-3, 1e3), seed=st.integers(0, 2**16))
def test_a_main_row_round_trips_within_fp8s_error_and_its_rope_within_bf16s(dim, rope, n, magnitude, seed):
    pack = KvRowPack(dim, min(rope, dim))
    x = torch.randn(n, dim, generator=torch.Generator().manual_seed(seed)) * magnitude
    y = pack.decode(pack.encode(x))
    nope = pack.nope
    # e4m3: 3 mantissa bits (relative error <= 2^-4 of the value) for values within a block's range; values far
    # below the block's maximum go subnormal: their error is at most half the block's smallest step.
    block_max = torch.nn.functional.pad(x[:, :nope].abs(), (0, pack.scales * 64 - nope)).view(n, -1, 64).amax(-1)
    step = (block_max / 448 * 2).repeat_interleave(64, 1)[:, :nope] * 2.0**-9
    assert ((y[:, :nope] - x[:, :nope]).abs() <= x[:, :nope].abs() * 2.0**-4 + step).all()
    torch.testing.assert_close(y[:, nope:], x[:, nope:].bfloat16().float(), rtol=0, atol=0)


def test_an_index_key_round_trips_and_zero_rows_read_as_zeros():
    pack = IndexRowPack(128)
    x = torch.randn(5, 128)
    y = pack.decode(pack.encode(x))
    assert ((y - x).abs() <= x.abs() * 2.0**-4 + x.abs().amax(1, keepdim=True) * 2.0**-17).all()
    for p in (pack, KvRowPack(512, 64)):
        assert torch.equal(p.decode(torch.zeros(3, p.width, dtype=torch.uint8)), torch.zeros(3, p.dim))


def test_packed_rows_read_and_write_a_strided_pool_view_as_fp32_rows():
    pack = KvRowPack(64, 16)
    storage = torch.zeros(10, 2, pack.width, dtype=torch.uint8).permute(1, 0, 2)  # page-major: 2 layers
    rows = PackedRows(storage[1], pack)
    values = torch.randn(3, 64)
    rows[torch.tensor([2, 5, 7])] = values
    got = rows.index_select(0, torch.tensor([5, 2, 0]))
    assert torch.equal(got[:2], pack.decode(pack.encode(values))[[1, 0]]) and not got[2].any()
    assert not storage[0].any()  # the other layer's rows are untouched
    assert rows.shape == (10, 64) and rows.dtype is torch.uint8  # (the C step reads the storage itself)
