"""The FP8 KV cache's rows (`quant/kv_fp8.py`): SGLang's sizes for DeepSeek-V4 (584 B main rows, 132 B indexer keys),
FP8 values with power-of-two block scales (main) or fp32 scales (indexer), bf16 rope channels, an unwritten (zero)
row reads as zeros, and `PackedRows` reads and writes them as fp32 rows."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pdspark.hardware.cpu import kernels
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


@pytest.mark.skipif(kernels.load() is None, reason="C kernels off here: nothing to route through")
def test_packed_rows_code_through_the_c_kernels_with_the_torch_codecs_bits(monkeypatch):
    """On the CPU a `PackedRows` view encodes and decodes through `kernels.pack_rows`/`unpack_rows` (16-25x faster
    than the torch ops), giving the bytes and floats of the pack's own `encode`/`decode`, for both kinds of rows,
    multi-dimensional indexes included; without the C kernels it falls back to the torch ops."""
    calls = {"pack": 0, "unpack": 0}
    pack_rows, unpack_rows = kernels.pack_rows, kernels.unpack_rows

    def counted_pack(*a):
        calls["pack"] += 1
        return pack_rows(*a)

    def counted_unpack(*a):
        calls["unpack"] += 1
        return unpack_rows(*a)

    monkeypatch.setattr(kernels, "pack_rows", counted_pack)
    monkeypatch.setattr(kernels, "unpack_rows", counted_unpack)
    g = torch.Generator().manual_seed(3)
    for pack in (KvRowPack(192, 64), IndexRowPack(128)):
        storage = torch.zeros(12, 2, pack.width, dtype=torch.uint8).permute(1, 0, 2)
        view = PackedRows(storage[0], pack)
        values = 3 * torch.randn(4, pack.dim, generator=g)
        at = torch.tensor([1, 4, 6, 9])
        view[at] = values
        assert torch.equal(storage[0][at], pack.encode(values))
        want = pack.decode(pack.encode(values))
        assert torch.equal(view.index_select(0, at), want)
        assert torch.equal(view[at.view(2, 2)], want.view(2, 2, pack.dim))
    assert calls == {"pack": 2, "unpack": 4}
    monkeypatch.setattr(kernels, "pack_rows", lambda *a: None)
    monkeypatch.setattr(kernels, "unpack_rows", lambda *a: None)
    pack = KvRowPack(64, 16)
    view = PackedRows(torch.zeros(4, pack.width, dtype=torch.uint8), pack)
    values = torch.randn(2, 64, generator=g)
    view[torch.tensor([0, 3])] = values
    assert torch.equal(view[torch.tensor([3])], pack.decode(pack.encode(values))[1:])
