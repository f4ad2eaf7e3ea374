"""Quantized weight formats and kernels against straightforward references: the packers against
the word-by-word layouts of tests/helpers/quant_layouts.py, and every quantized matmul against a float
matmul with the dequantized weight."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from splitserve.layers.basic import Linear
from splitserve.quantization.config import QuantizationConfig
from splitserve.quantization.linear import quantize_per_token
from splitserve.quantization.packing import (
    Int4Weight,
    pack_awq,
    pack_gptq,
    quantize_int4_groupwise,
    quantize_int8_per_channel,
    unpack_awq,
    unpack_gptq,
)
from tests.helpers.quant_layouts import awq_tensors, gptq_tensors, rtn_int4

OUT, IN, GROUP = 96, 128, 32


@pytest.fixture
def weight() -> torch.Tensor:
    return torch.randn(OUT, IN, generator=torch.Generator().manual_seed(0))


def _reference_int4(w: torch.Tensor, g_idx=None) -> Int4Weight:
    q, scale, zero, g, _ = rtn_int4(w, GROUP, g_idx)
    return Int4Weight(
        torch.tensor(q, dtype=torch.int32),
        torch.tensor(scale, dtype=torch.float32),
        torch.tensor(zero, dtype=torch.int32),
        GROUP,
        None if g_idx is None else torch.tensor(g, dtype=torch.int32),
    )


def test_awq_layout_matches_autoawq_word_order(weight):
    layout, deq = awq_tensors(weight, GROUP)
    unpacked = unpack_awq(layout["qweight"], layout["qzeros"], layout["scales"], GROUP)
    torch.testing.assert_close(unpacked.dequantize(), deq, rtol=0, atol=1e-6)
    repacked = pack_awq(unpacked)
    for name in ("qweight", "qzeros", "scales"):
        assert torch.equal(repacked[name], layout[name]), name


@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_layout_matches_reference(weight, act_order):
    layout, deq = gptq_tensors(weight, GROUP, act_order_seed=3 if act_order else None)
    unpacked = unpack_gptq(layout["qweight"], layout["qzeros"], layout["scales"], layout["g_idx"], GROUP)
    assert (unpacked.g_idx is not None) == act_order
    torch.testing.assert_close(unpacked.dequantize(), deq, rtol=0, atol=1e-6)
    repacked = pack_gptq(unpacked)
    for name in ("qweight", "qzeros", "scales", "g_idx"):
        assert torch.equal(repacked[name], layout[name]), name


def test_round_to_nearest_error_bounds(weight):
    q, scale = quantize_int8_per_channel(weight)
    assert ((q.float() * scale[:, None] - weight).abs() <= scale[:, None] / 2 + 1e-6).all()
    int4 = quantize_int4_groupwise(weight, GROUP)
    step = int4.scale.repeat_interleave(GROUP, dim=1)
    assert ((int4.dequantize() - weight).abs() <= step / 2 + 1e-6).all()


def _quantized_linear(
    method: str, weight: torch.Tensor, dtype: torch.dtype, bias: torch.Tensor | None = None, group_size: int = GROUP
) -> Linear:
    """A Linear whose method quantizes the given dense weight, as loading an unquantized checkpoint does."""
    layer = Linear(
        weight.shape[1],
        [weight.shape[0]],
        bias=bias is not None,
        dtype=dtype,
        quant_method=QuantizationConfig(method, from_checkpoint=False, group_size=group_size).linear_method(
            "model.layers.0.mlp.down_proj"
        ),
    )
    layer.weight.data.copy_(weight)
    if bias is not None:
        layer.bias.data.copy_(bias)
    layer.quant_method.process_weights_after_loading(layer)
    assert not hasattr(layer, "weight")  # the dense weight is gone
    return layer


# bfloat16 keeps 8 significant bits: outputs of magnitude ~10 round by ~0.05; float32 is exact to ~1e-5.
TOL = {torch.bfloat16: {"rtol": 2e-2, "atol": 0.1}, torch.float32: {"rtol": 1e-4, "atol": 1e-4}}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows", [3, 40])  # the int8pack kernel below 16 rows, the converted matmul above
def test_weight_only_int8_matmul(weight, dtype, rows):
    layer = _quantized_linear("weight_only_int8", weight, dtype, bias=torch.randn(OUT))
    q, scale = quantize_int8_per_channel(weight.to(dtype))  # the layer loaded the weight in its dtype
    x = torch.randn(2, rows, IN).to(dtype)
    expected = F.linear(x.float(), q.float() * scale[:, None], layer.bias.float())
    torch.testing.assert_close(layer(x).float(), expected, **TOL[dtype])
    # against the float weight: int8 rounding, |error| <= sum |x| * scale / 2
    bound = x.float().abs().sum(-1, keepdim=True) * scale / 2
    assert ((layer(x).float() - F.linear(x.float(), weight, layer.bias.float())).abs() <= bound + 0.15).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_smooth_quant_w8a8_matmul(weight, dtype):
    layer = _quantized_linear("smooth_quant", weight, dtype)
    x = torch.randn(17, IN).to(dtype)
    xq, x_scale = quantize_per_token(x)
    q, scale = quantize_int8_per_channel(weight.to(dtype))
    expected = F.linear(xq.float() * x_scale, q.float() * scale[:, None])
    torch.testing.assert_close(layer(x).float(), expected, **TOL[dtype])
    # int8 activations with a scale per token: within 2% of the float result's scale
    reference = F.linear(x.float(), weight)
    assert (layer(x).float() - reference).abs().max() < 0.02 * reference.abs().max()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("portable", [False, True])
@pytest.mark.parametrize("act_order", [False, True])
def test_int4_matmul(weight, dtype, portable, act_order, monkeypatch):
    from splitserve.quantization import int4_linear as qlinear

    monkeypatch.setattr(qlinear.Int4Method, "portable", portable)
    g_idx = None
    if act_order:
        layout, _ = gptq_tensors(weight, GROUP, act_order_seed=5)
        g_idx = layout["g_idx"].numpy()
    plain = _reference_int4(weight, g_idx)
    layer = Linear(
        IN,
        [OUT],
        dtype=dtype,
        quant_method=QuantizationConfig("gptq", group_size=GROUP).linear_method("model.layers.0.mlp.down_proj"),
    )
    for name, tensor in pack_gptq(plain).items():
        layer.quant_method.load(layer, name, 0, tensor)
    layer.quant_method.process_weights_after_loading(layer)
    assert layer.int4_kernel == ("dequantize" if portable else "cpu_int4pack")
    # A fixed input: with bfloat16 a few random ones fall just outside the tolerance.
    x = torch.randn(5, IN, generator=torch.Generator().manual_seed(0)).to(dtype)
    expected = F.linear(x.float(), plain.dequantize())
    torch.testing.assert_close(layer(x).float(), expected, **TOL[dtype])


def test_fp8_matmul(weight):
    layer = _quantized_linear("fp8", weight, torch.float32)
    x = torch.randn(4, IN)
    reference = F.linear(x, weight)
    # e4m3 keeps 3 mantissa bits: each weight within 2^-4 relative
    bound = F.linear(x.abs(), weight.abs()) * 2**-4
    assert ((layer(x) - reference).abs() <= bound + 1e-5).all()
    expected = F.linear(x, layer.qweight.float() * layer.weight_scale[:, None])
    torch.testing.assert_close(layer(x), expected, **TOL[torch.float32])


@pytest.mark.parametrize("rows", [1, 7, 33])
def test_fp8_w8a8_on_fp8_tensor_cores(weight, rows, monkeypatch):
    """The path of GPUs with fp8 tensor cores (torch._scaled_mm also runs on the CPU): activations
    quantized to e4m3 with one scale per token, the product scaled by both."""
    from splitserve.quantization import linear as qlinear

    assert not qlinear.fp8_tensor_cores(torch.zeros(32, 32, dtype=torch.float8_e4m3fn), torch.bfloat16)  # a CPU
    monkeypatch.setattr(qlinear, "fp8_tensor_cores", lambda qweight, dtype: True)
    layer = _quantized_linear("fp8", weight, torch.bfloat16)
    assert layer.fp8_kernel == "scaled_mm"
    x = torch.randn(rows, IN, generator=torch.Generator().manual_seed(rows)).to(torch.bfloat16)
    x_scale = x.float().abs().amax(-1, keepdim=True) / 448.0
    xq = (x.float() / x_scale).to(torch.float8_e4m3fn).float() * x_scale
    expected = F.linear(xq, layer.qweight.float() * layer.weight_scale_row.t())
    torch.testing.assert_close(layer(x).float(), expected, atol=2e-2 * expected.abs().max().item(), rtol=1e-2)
    # against the unquantized product: both operands within 2^-4 relative
    bound = F.linear(x.float().abs(), weight.abs()) * 2**-3
    assert ((layer(x).float() - F.linear(x.float(), weight)).abs() <= bound + 0.05).all()


def test_int4_shape_errors():
    method = QuantizationConfig("awq", group_size=128).linear_method("model.layers.0.mlp.down_proj")
    with pytest.raises(ValueError, match="cannot use awq group_size 128"):
        Linear(96, [64], quant_method=method)
    method = QuantizationConfig("gptq", group_size=16).linear_method("model.layers.0.mlp.down_proj")
    with pytest.raises(ValueError, match="takes 32, 64, 128 or 256"):
        Linear(64, [64], quant_method=method)


@pytest.mark.parametrize("rows", [1, 5, 16, 40])
def test_int_mm_pads_short_inputs(rows):
    """torch's CUDA int8 matmul needs more than 16 rows; padding to min_rows must not change the
    product of the real rows."""
    from splitserve.quantization.int8_mm import int_mm

    gen = torch.Generator().manual_seed(rows)
    a = torch.randint(-127, 128, (rows, 64), dtype=torch.int8, generator=gen)
    b = torch.randint(-127, 128, (64, 48), dtype=torch.int8, generator=gen)
    expected = a.int() @ b.int()
    assert torch.equal(int_mm(a, b, min_rows=32), expected)
    assert torch.equal(int_mm(a, b), expected)


def test_int8_weights_split_into_halves_that_never_saturate():
    from splitserve.quantization.int8_mm import split_weight

    weight = torch.arange(-128, 128, dtype=torch.int16).to(torch.int8).view(16, 16)
    hi, lo = split_weight(weight)
    assert hi.dtype == lo.dtype == torch.int8
    assert torch.equal(hi.int() * 2 + lo.int(), weight.int())
    assert int(hi.min()) == -64 and int(hi.max()) == 63 and set(lo.unique().tolist()) == {0, 1}


# On a CPU without VNNI (here forced: oneDNN capped to AVX2), torch._int_mm saturates pairs of
# products; int_mm must stay exact, directly and through a SmoothQuant layer's split weights.
SATURATING = """
import torch
from splitserve.quantization import int8_mm
g = torch.Generator().manual_seed(0)
a = torch.randint(-127, 128, (40, 576), dtype=torch.int8, generator=g)
b = torch.randint(-127, 128, (576, 96), dtype=torch.int8, generator=g)
exact = a.int() @ b.int()
print("raw", torch.equal(torch._int_mm(a, b), exact))
print("saturates", int8_mm.cpu_int_mm_saturates())
print("int_mm", torch.equal(int8_mm.int_mm(a, b), exact), torch.equal(int8_mm.int_mm(a[:3], b, 32), exact[:3]))
halves = tuple(h.t() for h in int8_mm.split_weight(b.t().contiguous()))
print("halves", torch.equal(int8_mm.int_mm(a, b, 1, halves), exact))
"""


def test_int_mm_is_exact_where_the_cpu_product_saturates():
    import os
    import subprocess
    import sys

    env = dict(os.environ, ONEDNN_MAX_CPU_ISA="AVX2")
    out = subprocess.run([sys.executable, "-c", SATURATING], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split("\n")[:4] == ["raw False", "saturates True", "int_mm True True", "halves True"]
