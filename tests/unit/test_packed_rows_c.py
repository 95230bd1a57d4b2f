"""The C decode step writes and reads the FP8 cache's rows (`hardware/cpu/packed_rows.c`) byte for byte and bit for bit
as `quant/kv_fp8.py` does: otherwise the C step and the module path would diverge over packed pools. The e4m3 and bf16
roundings are checked against torch's casts over every kind of float that reaches them (ties, subnormals, the
saturation at 448, signed zeros, NaN); the block scales at the powers of two where a rounded log2 and
the exact rule could part."""

from __future__ import annotations

import pytest
import torch

from pdspark.hardware.cpu import kernels as cpu_kernels
from pdspark.hardware.cpu.kernel_abi import INDEX_ROWS
from pdspark.quant.kv_fp8 import IndexRowPack, KvRowPack

pytestmark = pytest.mark.skipif(cpu_kernels.load() is None, reason="no C compiler here")


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.int32), b.view(torch.int32))


def _floats_in(lo: float, hi: float, step: int) -> torch.Tensor:
    """Every `step`-th fp32 bit pattern with |x| in [lo, hi], both signs."""
    a = torch.tensor([lo], dtype=torch.float32).view(torch.int32).item()
    b = torch.tensor([hi], dtype=torch.float32).view(torch.int32).item()
    pos = torch.arange(a, b + 1, step, dtype=torch.int32).view(torch.float32)
    return torch.cat([pos, -pos])


def test_e4m3_rounding_is_torchs_cast_for_every_kind_of_value():
    """Rows whose blocks each hold 448 (scale exactly 1: the values reach the cast as they are, but in the few rows
    holding something past 448), the rest of each block floats from e4m3's subnormals to past 448, ties included
    (every 1,024th fp32 pattern from 2^-12 to 500 hits every rounding boundary's neighbourhood: e4m3 keeps 3 of
    fp32's 23 mantissa bits)."""
    specials = torch.tensor([0.0, -0.0, float("nan"), 464.0, 480.0, float("inf"), -float("inf")])
    subnormal_ties = torch.tensor([2.0**-9 * k for k in range(-40, 41)]) / 2
    values = torch.cat([_floats_in(2.0**-12, 500.0, 1024), specials, subnormal_ties])
    dim, rope, per = 72, 8, 63  # one 64-wide block of nope channels: 448, then 63 values
    pad = (-values.numel()) % per
    body = torch.cat([values, torch.zeros(pad)]).view(-1, per)
    rows = torch.cat([torch.full((body.shape[0], 1), 448.0), body, torch.zeros(body.shape[0], rope)], dim=1)
    assert rows.shape[1] == dim
    pack = KvRowPack(dim, rope)
    want = pack.encode(rows)
    got = cpu_kernels.pack_rows(rows, rope)
    assert torch.equal(got, want)
    # (and the cast itself, in the blocks whose scale is 1: no NaN, nothing past 448)
    one = (rows.abs() <= 448).all(dim=1)
    assert int(one.sum()) > 0.9 * rows.shape[0]
    assert torch.equal(got[one, : dim - rope], rows[one, : dim - rope].to(torch.float8_e4m3fn).view(torch.uint8))


@pytest.mark.parametrize("dim,rope", [(512, 64), (128, 64), (32, 8), (72, 8)])
def test_main_kv_rows_pack_and_unpack_as_the_python_rows_do(dim, rope):
    g = torch.Generator().manual_seed(dim + rope)
    n = 300
    rows = torch.randn(n, dim, generator=g) * torch.logspace(-6, 3, n).unsqueeze(1)
    # Blocks whose amax / 448 is a power of two, a float past one and a float short of one; tiny and zero blocks.
    for i, y in enumerate([2.0**-3, 2.0**5, 1.0]):
        for j, scale in enumerate((1.0, 1.0 + 2.0**-23, 1.0 - 2.0**-24)):
            r = 3 * i + j
            rows[r, : dim - rope] = torch.linspace(-1, 1, dim - rope) * 448.0 * y * scale
    rows[9, : dim - rope] = 1e-7
    rows[10] = 0.0
    rows[11, :] = -0.0
    rows[12, -rope:] = torch.tensor([1.0 + 2.0**-8, 1.0 + 3 * 2.0**-8, -(1.0 + 2.0**-8), 2.0**-130] * (rope // 4))
    pack = KvRowPack(dim, rope)
    want = pack.encode(rows)
    got = cpu_kernels.pack_rows(rows, rope)
    assert torch.equal(got, want)
    assert _same_bits(cpu_kernels.unpack_rows(want, dim, rope), pack.decode(want))


@pytest.mark.parametrize("dim", [128, 32, 200])
def test_index_key_rows_pack_and_unpack_as_the_python_rows_do(dim):
    g = torch.Generator().manual_seed(dim)
    n = 300
    rows = torch.randn(n, dim, generator=g) * torch.logspace(-14, 4, n).unsqueeze(1)
    rows[0] = 0.0
    rows[1, :] = -0.0
    rows[2, 0] = float("nan")
    pack = IndexRowPack(dim)
    want = pack.encode(rows)
    got = cpu_kernels.pack_rows(rows, INDEX_ROWS)
    assert torch.equal(got, want)
    back_c, back_py = cpu_kernels.unpack_rows(want, dim, INDEX_ROWS), pack.decode(want)
    assert torch.equal(back_c.isnan(), back_py.isnan())
    assert _same_bits(back_c.nan_to_num(), back_py.nan_to_num())


def test_every_e4m3_byte_decodes_to_torchs_value():
    """Two key rows holding the 256 bytes, scale 1 and then 3 (the decode's multiply rounds where the value needs it):
    the C decode (16 at a time with AVX-512, else a byte at a time) gives torch's values, NaN where torch's is."""
    pack = IndexRowPack(128)
    values = torch.arange(256, dtype=torch.uint8).view(2, 128)
    for scale in (1.0, 3.0):
        scales = torch.tensor([[scale], [scale]], dtype=torch.float32).view(torch.uint8)
        rows = torch.cat([values, scales], dim=1)
        c, py = cpu_kernels.unpack_rows(rows, 128, INDEX_ROWS), pack.decode(rows)
        assert torch.equal(c.isnan(), py.isnan()) and int(py.isnan().sum()) == 2
        assert _same_bits(c.nan_to_num(), py.nan_to_num())


def _keys_and_queries(g: torch.Generator, T: int, H: int, D: int, R: int):
    """R random key rows packed as the FP8 cache holds them, the same rows decoded to fp32, and T queries of H heads
    with their head weights."""
    pack = IndexRowPack(D)
    storage = pack.encode(torch.randn(R, D, generator=g))
    q, w = torch.randn(T, H, D, generator=g), torch.randn(T, H, generator=g)
    return storage, pack.decode(storage), q, w


def test_the_c_pick_over_packed_keys_is_the_pick_over_their_decoded_floats():
    """`index_pick` reading the FP8 cache's key rows in place (decoded block by block, on several threads) picks what
    it picks over the same keys decoded to an fp32 pool first."""
    g = torch.Generator().manual_seed(3)
    T, H, D, R, V, k = 2, 4, 128, 9000, 6000, 64
    storage, floats, q, w = _keys_and_queries(g, T, H, D, R)
    rows = torch.stack([torch.randperm(R, generator=g)[:V] for _ in range(T)])
    valid = torch.rand(T, V, generator=g) > 0.05
    try:
        for threads in (1, 2):
            cpu_kernels.set_threads(threads)
            packed = cpu_kernels.index_pick(q, w, storage, rows, valid, D**-0.5, k, layout="packed")
            plain = cpu_kernels.index_pick(q, w, floats, rows, valid, D**-0.5, k)
            assert packed is not None and plain is not None
            assert torch.equal(packed, plain) and int(packed.sum()) == T * k
    finally:
        cpu_kernels.set_threads(1)


def test_a_prefill_segments_shared_pick_over_packed_keys_is_its_pick_over_the_decoded_floats():
    """`index_pick_shared` (the queries of a prefill segment sharing their entries, each block of keys decoded once
    for a group of 16 queries) picks over the FP8 cache's key rows what it picks over the same keys decoded first."""
    g = torch.Generator().manual_seed(4)
    T, H, D, R, V, k = 40, 2, 128, 5000, 3000, 64
    storage, floats, q, w = _keys_and_queries(g, T, H, D, R)
    rows = torch.randperm(R, generator=g)[:V].contiguous()
    visible = torch.linspace(V // 2, V, T).long()  # (each query its causal count)
    valid = (torch.arange(V)[None, :] < visible[:, None]).contiguous()
    packed = cpu_kernels.index_pick_shared(q, w, storage, rows, valid, D**-0.5, k, layout="packed")
    plain = cpu_kernels.index_pick_shared(q, w, floats, rows, valid, D**-0.5, k)
    assert packed is not None and plain is not None
    assert torch.equal(packed[0], plain[0]) and torch.equal(packed[1], plain[1]) and bool(plain[1].all())
