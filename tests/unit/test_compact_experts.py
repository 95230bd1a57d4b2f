"""`CompactExperts`: a layer's routed experts as the released checkpoint stores them (MXFP4, or FP8 128x128 tiles with
fp32 scales as in V4-Flash-Base), only a shard's experts held: every (token, slot) output equals the expert's
SwiGLU over the weights decoded to fp32 through the row-exact GEMM, bit for bit; a slot routed elsewhere is zeros."""

from __future__ import annotations

import pytest
import torch

from pdspark.hardware.cpu import kernels
from pdspark.model.compact_experts import FP8, MXFP4, CompactExperts
from pdspark.model.moe import swiglu
from pdspark.quant import release_formats

D, INTER, E = 64, 96, 4


def _experts(fmt: str, first: int, count: int, g: torch.Generator):
    weights, scales, dense = {}, {}, {}
    for p, shape in (("w1", (INTER, D)), ("w3", (INTER, D)), ("w2", (D, INTER))):
        ws, ss, ds = [], [], []
        for _ in range(count):
            w = torch.randn(shape, generator=g) * 0.1
            if fmt == MXFP4:
                q, s = release_formats.quant_mxfp4(w)
                ws.append(q.view(torch.uint8))
                ss.append(s.view(torch.uint8))
                ds.append(release_formats.dequant_mxfp4(q, s))
            else:  # Flash-Base: FP8 tiles with float32 scales
                q, s = release_formats.quant_fp8_blocks(w)
                s32 = release_formats.scale_values(s) * 1.5  # (not a power of two: an fp32 scale)
                ws.append(q)
                ss.append(s32)
                ds.append(release_formats.dequant_fp8_blocks(q, s32))
        weights[p], scales[p], dense[p] = torch.stack(ws), torch.stack(ss), ds
    stacks = {"w13": torch.cat([weights["w1"], weights["w3"]], dim=1), "w2": weights["w2"]}
    stack_scales = {"w13": torch.cat([scales["w1"], scales["w3"]], dim=1), "w2": scales["w2"]}
    return CompactExperts(fmt, first, stacks, stack_scales), dense


@pytest.mark.parametrize("fmt", [MXFP4, FP8])
def test_held_experts_give_the_decoded_weights_bits_and_the_others_zeros(fmt):
    g = torch.Generator().manual_seed(3)
    experts, dense = _experts(fmt, first=2, count=2, g=g)
    x = torch.randn(5, D, generator=g)
    ids = torch.tensor([[0, 2], [3, 1], [2, 3], [1, 0], [3, 2]])
    act = lambda gate, up: swiglu(gate, up, 7.0)  # noqa: E731
    with torch.inference_mode():
        out = experts(x, ids, act)
        for t in range(5):
            for k in range(2):
                e = int(ids[t, k])
                if not 2 <= e < 4:
                    assert not out[t, k].any()
                    continue
                w1, w3, w2 = (dense[p][e - 2] for p in ("w1", "w3", "w2"))
                xt = x[t : t + 1]
                h = act(kernels.linear_rows(xt, w1), kernels.linear_rows(xt, w3))
                assert torch.equal(out[t, k], kernels.linear_rows(h, w2)[0]), (t, k)
