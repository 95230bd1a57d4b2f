"""The released checkpoint's weight formats (`quant/release_formats.py`), checked against hand-decoded bytes: the
e2m1 nibble order (low nibble = even element), the FP8 tile scale as a multiplier (a partial last tile included), the
ue8m0 scale byte as 2^(b - 127), and encodings that decode back to exactly what they stand for."""

from __future__ import annotations

import torch

from pdspark.quant.release_formats import (
    E2M1,
    dequant_fp8_blocks,
    dequant_mxfp4,
    quant_fp8_blocks,
    quant_mxfp4,
    scale_values,
)


def _e8m0(*exps: int) -> torch.Tensor:
    return torch.tensor([e + 127 for e in exps], dtype=torch.uint8).view(torch.float8_e8m0fnu)


def test_a_ue8m0_scale_byte_is_a_power_of_two_and_float32_scales_pass_through():
    assert scale_values(_e8m0(0, 3, -2)).tolist() == [1.0, 8.0, 0.25]
    assert scale_values(torch.tensor([0.5, 3.0])).tolist() == [0.5, 3.0]


def test_the_low_nibble_is_the_even_element_and_each_32_inputs_have_their_scale():
    # Byte 0x71: low nibble 1 (0.5) is element 0, high nibble 7 (6.0) element 1; byte 0xA9: -0.5 then -1.0.
    row = torch.tensor([0x71, 0xA9] + [0x00] * 14 + [0x22] * 16, dtype=torch.uint8).view(torch.int8)[None]  # [1, 32]
    w = dequant_mxfp4(row, _e8m0(1, -1)[None])  # inputs 0..31 times 2, 32..63 times 0.5
    assert w.shape == (1, 64)
    assert w[0, :4].tolist() == [1.0, 12.0, -1.0, -2.0]
    assert w[0, 32:34].tolist() == [0.5, 0.5]  # code 2 (1.0) x 0.5
    assert E2M1.tolist()[8:] == [-0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


def test_an_fp8_tile_scale_multiplies_every_element_of_its_tile_a_partial_tile_too():
    q = torch.ones(130, 200).to(torch.float8_e4m3fn)  # tiles: rows [0,128) [128,130), cols [0,128) [128,200)
    w = dequant_fp8_blocks(q, _e8m0(0, 1, 2, 3).reshape(2, 2))
    assert (w[:128, :128] == 1).all() and (w[:128, 128:] == 2).all()
    assert (w[128:, :128] == 4).all() and (w[128:, 128:] == 8).all()


def test_encodings_decode_to_values_within_their_format_s_step():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(200, 160, generator=g) * 0.03
    q, s = quant_fp8_blocks(w)
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float8_e8m0fnu and s.shape == (2, 2)
    # e4m3: 3 mantissa bits, so within 1/16 of each value's magnitude (plus the subnormal step).
    back = dequant_fp8_blocks(q, s)
    assert ((back - w).abs() <= w.abs() / 16 + 2.0 ** -9 * scale_values(s).max()).all()
    packed, s4 = quant_mxfp4(w)
    assert packed.dtype == torch.int8 and packed.shape == (200, 80) and s4.shape == (200, 5)
    back4 = dequant_mxfp4(packed, s4)
    # e2m1 values are 0.5 apart below 2, 1 apart below 4, 2 apart above: each within half a step of its group's max.
    step = scale_values(s4).repeat_interleave(32, 1)
    assert ((back4 - w).abs() <= step + 1e-12).all()
    assert torch.equal(dequant_mxfp4(*quant_mxfp4(back4)), back4)  # decoded values encode to themselves
