"""The W4A16 Triton kernel (splitserve/kernels/triton_int4.py) against the portable int4 path it
replaces on CUDA (dequantize, then a dense product): packing, decode rows and prompt-sized rows,
group sizes 32 to 256 and per-channel, output sizes that are not multiples of a block, act-order
weights through a real layer. Without CUDA it runs in Triton's CPU interpreter (float32 and float16;
bfloat16 is computed wrongly there); gpu-marked cases run bfloat16 at a Qwen3-8B layer's shape."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when the kernel is defined (imported below)
pytest.importorskip("triton")

from splitserve.kernels import triton_int4  # noqa: E402
from splitserve.quantization.packing import Int4Weight, quantize_int4_groupwise  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
pytestmark = pytest.mark.filterwarnings("error::RuntimeWarning")


def _weight(n: int, k: int, group: int, seed: int = 0) -> Int4Weight:
    gen = torch.Generator().manual_seed(seed)
    return quantize_int4_groupwise(torch.randn(n, k, generator=gen), group, sym=False)


def _operands(plain: Int4Weight, dtype: torch.dtype):
    q = triton_int4.pack(plain.q).to(DEVICE)
    return q, plain.scale.to(dtype).contiguous().to(DEVICE), plain.zero.to(dtype).contiguous().to(DEVICE)


def test_pack_puts_column_k_in_bits_4_k_mod_8_of_word_k_div_8():
    levels = torch.randint(0, 16, (3, 24))
    words = triton_int4.pack(levels)
    assert words.shape == (3, 3) and words.dtype == torch.int32
    for k in range(24):
        assert torch.equal((words[:, k // 8] >> (4 * (k % 8))) & 0xF, levels[:, k].to(torch.int32))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    "m,n,k,group", [(1, 72, 128, 32), (3, 100, 256, 64), (17, 64, 256, 128), (70, 136, 512, 256), (2, 40, 96, 96)]
)
def test_kernel_matches_the_dequantized_product(dtype, m, n, k, group):
    plain = _weight(n, k, group, seed=m)
    q, scales, zeros = _operands(plain, dtype)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(1)).to(dtype).to(DEVICE)
    got = triton_int4.linear(x, q, scales, zeros, group)
    want = x.float() @ plain.dequantize().to(dtype).float().to(DEVICE).t()
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want, atol=tol * k**0.5, rtol=tol)


def test_supported_shapes():
    assert all(triton_int4.supported(k, g) for k, g in [(4096, 128), (576, 64), (96, 96), (576, 576), (4096, 32)])
    assert not triton_int4.supported(100, 100)  # groups must be multiples of 16
    assert not triton_int4.supported(576, 40) and not triton_int4.supported(96, 64)  # K must be whole groups


@pytest.mark.parametrize("act_order", [False, True])
def test_a_gptq_layer_on_the_kernel_answers_as_its_dequantized_weight(monkeypatch, act_order):
    """Through the int4 linear method: checkpoint tensors, act-order's channel permutation, packing;
    the kernel is what CUDA chooses (on the CPU it runs in the interpreter)."""
    from splitserve.layers.basic import Linear
    from splitserve.quantization import int4_linear
    from splitserve.quantization.config import QuantizationConfig
    from splitserve.quantization.packing import pack_gptq
    from tests.helpers.quant_layouts import gptq_tensors, rtn_int4

    out_features, in_features, group = 96, 128, 32
    weight = torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(2))
    g_idx = gptq_tensors(weight, group, act_order_seed=5)[0]["g_idx"].numpy() if act_order else None
    q, scale, zero, g, _ = rtn_int4(weight, group, g_idx)
    plain = Int4Weight(
        torch.tensor(q, dtype=torch.int32),
        torch.tensor(scale, dtype=torch.float32),
        torch.tensor(zero, dtype=torch.int32),
        group,
        None if g_idx is None else torch.tensor(g, dtype=torch.int32),
    )
    monkeypatch.setattr(int4_linear, "choose_kernel", lambda *args: "triton")
    method = QuantizationConfig("gptq", group_size=group).linear_method("model.layers.0.mlp.down_proj")
    layer = Linear(in_features, [out_features], dtype=torch.float16, quant_method=method)
    for name, tensor in pack_gptq(plain).items():
        layer.quant_method.load(layer, name, 0, tensor)
    layer.quant_method.process_weights_after_loading(layer)
    assert layer.int4_kernel == "triton" and layer.qweight.dtype == torch.int32
    x = torch.randn(5, in_features, generator=torch.Generator().manual_seed(0)).to(torch.float16)
    want = x.float() @ plain.dequantize().to(torch.float16).float().t()
    torch.testing.assert_close(layer(x).float(), want, atol=5e-2, rtol=2e-2)


def test_cuda_chooses_the_kernel_for_16_bit_activations_only(monkeypatch):
    from splitserve import kernels
    from splitserve.quantization.int4_linear import choose_kernel

    cuda = torch.device("cuda")
    monkeypatch.setattr(kernels, "gpu_ops", lambda: object())
    assert choose_kernel(cuda, torch.bfloat16, 4096, 128, False) == "triton"
    assert choose_kernel(cuda, torch.float32, 4096, 128, False) == "dequantize"  # tf32 products: not exact enough
    assert choose_kernel(cuda, torch.bfloat16, 4096, 128, True) == "dequantize"
    assert choose_kernel(torch.device("cpu"), torch.bfloat16, 4096, 128, False) == "cpu_int4pack"
    monkeypatch.setattr(kernels, "gpu_ops", lambda: None)  # no triton, or SPLITSERVE_GPU_KERNELS=0
    assert choose_kernel(cuda, torch.bfloat16, 4096, 128, False) == "dequantize"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("m", [1, 16, 64, 300])
def test_gpu_kernel_at_a_qwen3_8b_shape(m):
    """Qwen3-8B's down projection (12288 -> 4096), group 128, bfloat16."""
    plain = _weight(4096, 12288, 128, seed=m)
    q, scales, zeros = _operands(plain, torch.bfloat16)
    x = torch.randn(m, 12288, device=DEVICE).to(torch.bfloat16)
    got = triton_int4.linear(x, q, scales, zeros, 128)
    want = x.float() @ plain.dequantize().to(torch.bfloat16).float().to(DEVICE).t()
    torch.testing.assert_close(got.float(), want, atol=0.05 * 12288**0.5 * 0.1, rtol=2e-2)


def _random_blocks(qtype: int, n: int, k: int, seed: int = 0) -> torch.Tensor:
    """Valid random GGUF blocks: finite float16 scales (and mins), any levels and 6-bit sub-scales."""
    from splitserve.quantization import gguf_int4

    gen = torch.Generator().manual_seed(seed)
    nb, size = k // gguf_int4.BLOCK_WEIGHTS[qtype], gguf_int4.BLOCK_BYTES[qtype]
    blocks = torch.randint(0, 256, (n, nb, size), generator=gen, dtype=torch.uint8)
    halves = 2 if qtype != gguf_int4.Q4_0 else 1  # d (and m / dmin) as float16
    values = (torch.rand(n, nb, halves, generator=gen) * 0.02 + 0.001).to(torch.float16)
    values[..., 1:] *= -1 if qtype == gguf_int4.Q4_1 else 1
    blocks[..., : 2 * halves] = values.view(torch.uint8).view(n, nb, 2 * halves)
    if qtype == gguf_int4.Q4_K:  # no sub-block scale of 0 (its weights would all be -dmin m)
        blocks[..., 4:8] |= 1
        blocks[..., 12:16] |= 1
    return blocks.view(n, nb * size)


@pytest.mark.parametrize("qtype", [2, 3, 12])
def test_gguf_4bit_blocks_convert_exactly(qtype):
    from splitserve.kernels.gguf import dequantize_reference
    from splitserve.quantization import gguf_int4

    n, k = 6, 512
    blocks = _random_blocks(qtype, n, k)
    plain = gguf_int4.to_int4(blocks, qtype, n, k)
    assert plain.group_size == 32 and plain.q.shape == (n, k) and int(plain.q.max()) <= 15
    torch.testing.assert_close(plain.dequantize(), dequantize_reference(blocks, qtype, n, k), atol=1e-6, rtol=1e-5)


def test_a_gguf_block_without_an_affine_form_is_not_converted():
    from splitserve.quantization import gguf_int4

    blocks = _random_blocks(gguf_int4.Q4_1, 2, 64).view(2, 2, 20)
    blocks[0, 1, :2] = 0  # d = 0 while m != 0: every weight of the block is m
    assert gguf_int4.to_int4(blocks.reshape(2, 40), gguf_int4.Q4_1, 2, 64) is None


def test_a_gguf_layer_on_a_gpu_multiplies_4bit_blocks_in_the_kernel_and_the_rest_dense(monkeypatch):
    """quantization/gguf.py's CUDA form (run here on CPU tensors, the kernel in the interpreter): a
    stacked layer whose q shard is Q4_K and k/v shards Q8_0, as some Q4_K_M files are."""
    from splitserve.kernels.gguf import dequantize_reference
    from splitserve.layers.basic import Linear
    from splitserve.layers.gguf_weight import GGUFWeight
    from splitserve.quantization import gguf as gguf_method
    from splitserve.quantization import int4_linear
    from splitserve.quantization.config import QuantizationConfig

    k, q8 = 256, 8
    shards = [GGUFWeight(12, (32, k), _random_blocks(12, 32, k, seed=1))]
    values = torch.randn(16, k, generator=torch.Generator().manual_seed(3))
    scale = values.view(16, k // 32, 32).abs().amax(-1, keepdim=True) / 127  # Q8_0: d (float16), 32 int8
    levels = (values.view(16, k // 32, 32) / scale).round().to(torch.int8)
    block = torch.cat([scale.to(torch.float16).view(torch.uint8).view(16, k // 32, 2), levels.view(torch.uint8)], -1)
    shards += [GGUFWeight(q8, (16, k), block.reshape(16, -1).contiguous()) for _ in range(2)]
    layer = Linear(k, [32, 16, 16], dtype=torch.float16, quant_method=QuantizationConfig("gguf").linear_method("x"))
    for i, shard in enumerate(shards):
        layer.quant_method.load(layer, "weight", i, shard)
    layer.quant_method.process_weights_after_loading(layer)
    monkeypatch.setattr(int4_linear, "choose_kernel", lambda *args: "triton")
    gguf_method._for_cuda(layer)
    assert [run[0] for run in layer.gguf_runs] == [gguf_method.INT4, None]
    dense = torch.cat([dequantize_reference(s.data, s.qtype, s.shape[0], k) for s in shards])
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(4)).to(torch.float16)
    want = x.float() @ dense.to(torch.float16).float().t()
    torch.testing.assert_close(layer(x).float(), want, atol=1e-2 * want.abs().max().item(), rtol=1e-2)
