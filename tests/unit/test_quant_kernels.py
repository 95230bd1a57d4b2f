"""The CPU reference kernels of `pdspark.quant` against dequantize-in-float references (fp32 rounding apart)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pdspark.errors import CheckpointError
from pdspark.quant import kernels
from pdspark.quant.fused_linear import FusedLinear
from pdspark.quant.quant_experts import QuantExperts
from pdspark.quant.quant_linear import QuantLinear
from pdspark.quant.scheme import QuantDescription
from quant_reference import assert_fp32_close, experts_reference, fake_quant_rows

SHAPES = [(1, 64, 32), (3, 7, 5), (17, 96, 48)]  # (M, K, N): decode row, odd sizes, a prefill chunk


def quantize_weight(w: torch.Tensor, bits: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel symmetric weight quantization (what msmodelslim's minmax does)."""
    qmax = 2 ** (bits - 1) - 1
    scale = w.abs().amax(dim=1) / qmax
    return torch.round(w / scale[:, None]).clamp(-qmax, qmax).to(torch.int8), scale


def dynamic_linear(w: torch.Tensor, scheme: str = "W8A8_DYNAMIC") -> QuantLinear:
    wq, scale = quantize_weight(w, 4 if scheme == "W4A8_DYNAMIC" else 8)
    stored = kernels.pack_int4(wq) if scheme == "W4A8_DYNAMIC" else wq
    return QuantLinear.from_tensors("t", scheme, {"weight": stored, "weight_scale": scale[:, None],
                                                  "weight_offset": torch.zeros(w.shape[0], 1)})


@pytest.mark.parametrize("m,k,n", SHAPES)
def test_int_mm_is_exact_at_every_m(m, k, n):
    g = torch.Generator().manual_seed(m * k * n)
    a = torch.randint(-127, 128, (m, k), dtype=torch.int8, generator=g)
    b = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g)
    assert torch.equal(kernels.int_matmul(a, b), a.int() @ b.int().t())


def test_per_token_quantization_error_is_half_a_step():
    x = torch.randn(5, 33, generator=torch.Generator().manual_seed(0)) * torch.tensor([1e-3, 1, 10, 100, 0])[:, None]
    rows = kernels.quantize_per_token(x)
    assert rows.values.dtype == torch.int8 and rows.scale.shape == (5, 1)
    assert (rows.values.abs().amax(dim=1)[:4] == 127).all()  # each row's largest value maps to 127
    assert ((rows.values.float() * rows.scale - x).abs() <= rows.scale / 2 + 1e-7).all()
    assert not rows.values[4].any()  # an all-zero row stays zero (no 0/0)


@pytest.mark.parametrize("scheme", ["W8A8_DYNAMIC", "W4A8_DYNAMIC"])
@pytest.mark.parametrize("m,k,n", SHAPES + [(2, 8, 2)])
def test_dynamic_linear_equals_dequantized_float(scheme, m, k, n):
    g = torch.Generator().manual_seed(1)
    w, x = torch.randn(n * 2, k, generator=g), torch.randn(m, k, generator=g) * 3
    lin = dynamic_linear(w, scheme)
    assert lin.weight.shape == (n * 2, k) and lin.weight.dtype == torch.int8
    assert_fp32_close(lin(x), F.linear(fake_quant_rows(x), lin.dequantized_weight()))
    # ... and quantization itself is close to the float linear (int4 much less so)
    err = (lin(x) - F.linear(x, w)).norm() / F.linear(x, w).norm()
    assert err < (0.03 if scheme == "W8A8_DYNAMIC" else 0.25), err


def test_w4a8_unpacks_pairs_along_the_output_dimension():
    # row 0 low nibble, row 1 high nibble: 0x7F -> (-1, 7); 0x80 -> (0, -8); 0x1E -> (-2, 1)
    packed = torch.tensor([[0x7F, 0x80 - 256, 0x1E]], dtype=torch.int8)
    assert kernels.unpack_int4(packed).tolist() == [[-1, 0, -2], [7, -8, 1]]


@pytest.mark.parametrize("m,k,n", SHAPES)
@pytest.mark.parametrize("deq_dtype", [torch.float32, torch.int64])
def test_static_linear_folds_the_zero_point(m, k, n, deq_dtype):
    g = torch.Generator().manual_seed(2)
    w, x = torch.randn(n, k, generator=g), torch.randn(m, k, generator=g) + 0.7  # skewed: the offset matters
    bias = torch.randn(n, generator=g)
    wq, w_scale = quantize_weight(w)
    in_scale = (x.max() - x.min()).reshape(1) / 255
    in_offset = torch.round(-128 - x.min() / in_scale).reshape(1)
    deq = in_scale * w_scale
    quant_bias = kernels.fold_zero_point(bias, wq, in_offset, deq)
    stored_deq = deq if deq_dtype == torch.float32 else deq.view(torch.int32).to(torch.int64)
    lin = QuantLinear.from_tensors("t", "W8A8", {"weight": wq, "input_scale": in_scale, "input_offset": in_offset,
                                                 "quant_bias": quant_bias, "deq_scale": stored_deq})
    assert torch.equal(lin.deq_scale, deq)  # the int64 bit pattern decodes to the same fp32 values
    x_deq = (kernels.quantize_static(x, in_scale, in_offset).float() - in_offset) * in_scale
    expected = F.linear(x_deq, wq.float() * w_scale[:, None]) + torch.round(bias / deq) * deq
    assert_fp32_close(lin(x), expected)
    err = (lin(x) - F.linear(x, w, bias)).norm() / F.linear(x, w, bias).norm()
    assert err < 0.03, err


def test_fused_linear_equals_each_alone():
    g = torch.Generator().manual_seed(3)
    floats = [torch.randn(4, 16, generator=g), torch.randn(3, 16, generator=g)]
    quants = [dynamic_linear(torch.randn(8, 16, generator=g)), dynamic_linear(torch.randn(6, 16, generator=g))]
    w4 = dynamic_linear(torch.randn(4, 16, generator=g), "W4A8_DYNAMIC")
    weights = [quants[0], floats[0], w4, quants[1], floats[1]]
    x = torch.randn(5, 16, generator=g)
    fused = FusedLinear(weights)
    assert len(fused.groups) == 3  # floats, W8A8_DYNAMIC pair, W4A8 alone
    for part, w in zip(fused(x), weights):
        assert_fp32_close(part, w(x) if isinstance(w, QuantLinear) else F.linear(x, w))
    only_float = FusedLinear(floats)(x)
    assert torch.equal(torch.cat(only_float, dim=-1), F.linear(x, torch.cat(floats)))


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate.clamp(max=10.0)) * up.clamp(-10.0, 10.0)


@pytest.mark.parametrize("tokens", [1, 9])
def test_quant_experts_equal_dequantized_float(tokens):
    g = torch.Generator().manual_seed(4)
    E, D, inter, k = 6, 32, 16, 2
    w1 = [dynamic_linear(torch.randn(inter, D, generator=g) / D**0.5) for _ in range(E)]
    w3 = [dynamic_linear(torch.randn(inter, D, generator=g) / D**0.5) for _ in range(E)]
    w2 = [dynamic_linear(torch.randn(D, inter, generator=g) / inter**0.5) for _ in range(E)]
    experts = QuantExperts.stack(w1, w3, w2)
    x = torch.randn(tokens, D, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(tokens)])
    weights = torch.rand(tokens, k, generator=g)
    expected = experts_reference(experts, x, ids, weights, swiglu)
    assert_fp32_close((experts(x, ids, swiglu) * weights[..., None]).sum(1), expected)


def test_description_names_the_bad_field():
    ok = QuantDescription.parse({"version": "1.0.0", "model_quant_type": "FLOAT", "a.weight": "W4A8_DYNAMIC",
                                 "optional": {"quarot": {"rotation_map": {"global_rotation": "optional/q.st"}}}},
                                "d.json")
    assert ok.scheme_of("a") == "W4A8_DYNAMIC" and ok.quarot  # model_quant_type ("FLOAT") is not read
    with pytest.raises(CheckpointError, match=r"'b.weight' has scheme 'W4A4_DYNAMIC'; supported: \['FLOAT'"):
        QuantDescription.parse({"b.weight": "W4A4_DYNAMIC"}, "d.json")
    with pytest.raises(CheckpointError, match="group_size"):
        QuantDescription.parse({"group_size": 128}, "d.json")
    with pytest.raises(CheckpointError, match="no entry for 'c.weight'"):
        ok.scheme_of("c")


def test_quant_linear_rejects_missing_and_wrong_tensors():
    with pytest.raises(CheckpointError, match=r"missing tensors \['weight_scale'\]"):
        QuantLinear.from_tensors("p", "W8A8_DYNAMIC", {"weight": torch.zeros(2, 2, dtype=torch.int8),
                                                       "weight_offset": torch.zeros(2, 1)})
    with pytest.raises(CheckpointError, match="p.weight .* expected a 2-D int8"):
        QuantLinear.from_tensors("p", "W8A8_DYNAMIC", {"weight": torch.zeros(2, 2), "weight_scale": torch.ones(2, 1),
                                                       "weight_offset": torch.zeros(2, 1)})


def test_quant_experts_one_token_has_its_bits_in_any_batch():
    """A decode token alone (the T == 1 path) gets the very bits of its rows in a batch (the grouped path): each
    (token, slot) output is the same whatever the row count, and `MoE.combine` sums them in slot order on every
    path. (The T == 1 path once summed in another order than the grouped one: every decode step's bits changed with
    the batch size, which a static W8A8 checkpoint's int8 activation rounding turned into logit differences of
    ~5e-2.)"""
    g = torch.Generator().manual_seed(7)
    E, D, inter, k, T = 8, 64, 32, 6, 48  # inter a multiple of 32: silu's rows never end in a scalar tail
    w1 = [dynamic_linear(torch.randn(inter, D, generator=g) / D**0.5) for _ in range(E)]
    w3 = [dynamic_linear(torch.randn(inter, D, generator=g) / D**0.5) for _ in range(E)]
    w2 = [dynamic_linear(torch.randn(D, inter, generator=g) / inter**0.5) for _ in range(E)]
    experts = QuantExperts.stack(w1, w3, w2)
    x = torch.randn(T, D, generator=g) * 3
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    ids[::5, 1] = ids[::5, 0]  # a hash table may repeat an expert in a row: the repeat keeps its slot order

    def swiglu(gate, up):
        return F.silu(gate.clamp(max=10.0)) * up.clamp(-10.0, 10.0)

    batched = experts(x, ids, swiglu)
    for t in range(T):
        assert torch.equal(experts(x[t : t + 1], ids[t : t + 1], swiglu), batched[t : t + 1]), t
