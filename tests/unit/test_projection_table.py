"""`projection_table` + `gemm_proj` (compact.c): a projection whose rows are segments in different storages (fp32,
bf16 bits, an FP8 slice of a bigger matrix, stacks of FP8 or MXFP4 experts) multiplies every range of its rows with
the bits of the row-exact GEMM over the same rows decoded to fp32, whatever segments and experts a range crosses and
however many threads share it."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pdspark.hardware.cpu import kernels
from pdspark.model.compact_experts import FP8, MXFP4, CompactExperts
from pdspark.model.cpu.projection_table import expert_segment, float_segment, fp8_segment, projection_table
from pdspark.model.fp8_linear import Fp8Linear
from pdspark.quant import release_formats

K, I, D, E = 160, 128, 160, 3  # K, D: not multiples of 128 (a partial tile column); I: FP8 stacks need 128 | I


def _experts(fmt: str, g: torch.Generator) -> tuple[CompactExperts, dict[str, torch.Tensor]]:
    """E experts with w13 [2I, D] and w2 [D, I], compact, and their decoded stacks [E * rows, in]."""
    weights, scales, dense = {}, {}, {}
    for p, shape in (("w13", (2 * I, D)), ("w2", (D, I))):
        ws, ss, ds = [], [], []
        for _ in range(E):
            halves = [torch.randn(shape[0] // 2 if p == "w13" else shape[0], shape[1], generator=g) * 0.1
                      for _ in range(2 if p == "w13" else 1)]
            parts = []
            for w in halves:  # (w13: gate and up quantized apart, as the checkpoint stores them)
                if fmt == MXFP4:
                    q, s = release_formats.quant_mxfp4(w)
                    parts.append((q.view(torch.uint8), s.view(torch.uint8), release_formats.dequant_mxfp4(q, s)))
                else:
                    q, s = release_formats.quant_fp8_blocks(w)
                    s32 = release_formats.scale_values(s) * 1.5  # (an fp32 scale, not a power of two)
                    parts.append((q, s32, release_formats.dequant_fp8_blocks(q, s32)))
            ws.append(torch.cat([p_[0] for p_ in parts]))
            ss.append(torch.cat([p_[1] for p_ in parts]))
            ds.append(torch.cat([p_[2] for p_ in parts]))
        weights[p], scales[p], dense[p] = torch.stack(ws), torch.stack(ss), torch.cat(ds)
    return CompactExperts(fmt, 0, weights, scales), dense


def _projections():
    """Projection A (K = D inputs): fp32, bf16, an FP8 slice at row0 100, FP8 experts' w13, MXFP4 experts' w13;
    projection B (K = I): FP8 experts' w2, MXFP4 experts' w2. Each with its decoded fp32 rows."""
    g = torch.Generator().manual_seed(21)
    f32 = torch.randn(40, K, generator=g)
    bf16 = torch.randn(24, K, generator=g).bfloat16()
    q, s = release_formats.quant_fp8_blocks(torch.randn(300, K, generator=g))
    big = Fp8Linear(q, s)
    sliced = big.rows(100, 260)  # (a group of `wo_a`: its tiles counted from row 100 of the whole)
    fp8_experts, fp8_dense = _experts(FP8, g)
    fp4_experts, fp4_dense = _experts(MXFP4, g)
    segments = [float_segment(f32, bf16_copy=False), float_segment(bf16, bf16_copy=False), fp8_segment(sliced),
                expert_segment(fp8_experts, "w13"), expert_segment(fp4_experts, "w13")]
    dense_a = torch.cat([f32, bf16.float(), big.dequantized_weight()[100:260], fp8_dense["w13"], fp4_dense["w13"]])
    segments_b = [expert_segment(fp8_experts, "w2"), expert_segment(fp4_experts, "w2")]
    dense_b = torch.cat([fp8_dense["w2"], fp4_dense["w2"]])
    assert not any(isinstance(s, str) for s in segments + segments_b)
    a, b = projection_table(segments), projection_table(segments_b)  # type: ignore[arg-type]
    assert a.formats == ("f32", "bf16", "fp8", "fp8", "mxfp4") and b.formats == ("fp8", "mxfp4")
    return (a, dense_a), (b, dense_b)


@pytest.mark.parametrize("threads", [1, 2, 4])
def test_every_row_range_has_the_bits_of_its_decoded_rows(threads):
    (a, dense_a), (b, dense_b) = _projections()
    x = torch.randn(17, K, generator=torch.Generator().manual_seed(5))
    xb = torch.randn(17, I, generator=torch.Generator().manual_seed(6))
    fp8_w13 = 64 + 160
    ranges_a = [(0, dense_a.shape[0]), (30, 20), (60, 120), (fp8_w13 - 8, 2 * I + 16),  # across segments
                (fp8_w13 + 2 * I, 2 * I), (fp8_w13 + 2 * I + 100, 2 * I),  # an expert; across experts
                (fp8_w13 + 3 * 2 * I + 2 * I, 2 * I)]  # an MXFP4 expert
    ranges_b = [(0, dense_b.shape[0]), (D, D), (D - 5, 10), (3 * D - 1, D + 2)]
    try:
        kernels.set_threads(threads)
        with torch.inference_mode():
            for proj, dense, xs, ranges in ((a, dense_a, x, ranges_a), (b, dense_b, xb, ranges_b)):
                for rows in (1, 4, 6, 7, 17):  # (1 to 6: the fused decode-and-dot kernels; more: blocks)
                    for start, n in ranges:
                        got = kernels.linear_proj(xs[:rows], proj.words, start, n)
                        want = kernels.linear_rows(xs[:rows], dense[start : start + n].contiguous())
                        assert got is not None and torch.equal(got, want), (rows, start, n)
    finally:
        kernels.set_threads(1)


def test_segments_the_c_step_cannot_read_are_named():
    g = torch.Generator().manual_seed(2)
    assert "torch.float16" in float_segment(torch.randn(4, 8).half(), bf16_copy=False)
    assert "not contiguous" in float_segment(torch.randn(8, 4).t(), bf16_copy=False)
    experts, _ = _experts(FP8, g)
    odd = CompactExperts(FP8, 0, {"w13": experts.w13[:, :200].contiguous(), "w2": experts.w2},
                         {"w13": experts.w13_scale, "w2": experts.w2_scale})
    assert expert_segment(odd, "w13") == "FP8 routed experts with 100 gate rows, not a multiple of 128"
    assert float_segment(torch.randn(4, 8).bfloat16(), bf16_copy=True).fmt == "bf16"
    exact = torch.randn(4, 8).bfloat16().float()
    assert float_segment(exact, bf16_copy=True).fmt == "bf16" and float_segment(exact, bf16_copy=False).fmt == "f32"
    assert float_segment(torch.randn(4, 8) / 3, bf16_copy=True).fmt == "f32"  # (not bf16 numbers: kept fp32)


@st.composite
def _layouts(draw):
    """A projection of 1 to 5 segments over K inputs (fp32, bf16, FP8 with a row0, MXFP4), a row range of it, and
    1 to 9 input rows."""
    K = draw(st.sampled_from([32, 96, 160]))
    segments = draw(st.lists(st.tuples(st.sampled_from(["f32", "bf16", "fp8", "mxfp4"]), st.integers(1, 40),
                                       st.integers(0, 200)), min_size=1, max_size=5))
    total = sum(rows for _, rows, _ in segments)
    start = draw(st.integers(0, total - 1))
    n = draw(st.integers(1, total - start))
    return K, segments, start, n, draw(st.integers(1, 9)), draw(st.integers(0, 2**16))


@settings(max_examples=60, deadline=None)
@given(_layouts())
def test_any_layout_of_segments_has_the_bits_of_its_decoded_rows(layout):
    """Random segment layouts, row ranges and input row counts (both the fused kernels' 1 to 6 rows and the block
    path's more): every output equals the row-exact GEMM's over the same rows decoded to fp32."""
    K, specs, start, n, T, seed = layout
    g = torch.Generator().manual_seed(seed)
    segments, dense = [], []
    for fmt, rows, row0 in specs:
        w = torch.randn(rows, K, generator=g)
        if fmt in ("f32", "bf16"):
            t = w if fmt == "f32" else w.bfloat16()
            segments.append(float_segment(t, bf16_copy=False))
            dense.append(t.float())
        elif fmt == "fp8":  # rows [row0, row0 + rows) of a bigger matrix: their tiles counted from row0
            q, s = release_formats.quant_fp8_blocks(torch.randn(row0 + rows, K, generator=g))
            linear = Fp8Linear(q, s).rows(row0, row0 + rows)
            segments.append(fp8_segment(linear))
            dense.append(linear.dequantized_weight())
        else:
            q, s = release_formats.quant_mxfp4(w)
            q8, s8 = q.view(torch.uint8)[None], s.view(torch.uint8)[None]  # one expert's rows x K as its w2
            experts = CompactExperts(MXFP4, 0, {"w13": torch.cat([q8, q8], 1), "w2": q8},
                                     {"w13": torch.cat([s8, s8], 1), "w2": s8})
            segments.append(expert_segment(experts, "w2"))
            dense.append(release_formats.dequant_mxfp4(q, s))
    proj = projection_table(segments)  # type: ignore[arg-type]
    x = torch.randn(T, K, generator=g)
    with torch.inference_mode():
        got = kernels.linear_proj(x, proj.words, start, n)
        want = kernels.linear_rows(x, torch.cat(dense)[start : start + n].contiguous())
    assert got is not None and torch.equal(got, want)
