"""Quantized linear layers at run time: how each method loads its tensors, and the kernels it
multiplies with (which method a model runs with is quantization/config.py's to say).

| method           | weight                       | activations             | CPU kernel                          |
|------------------|------------------------------|-------------------------|-------------------------------------|
| weight_only_int8 | int8, a scale per output row | model dtype             | `_weight_int8pack_mm` for few rows, |
|                  |                              |                         | else int8->dtype + matmul           |
| smooth_quant     | int8, a scale per output row | int8, a scale per token | `torch._int_mm` (int8_mm.py)        |
| awq, gptq,       | int4, scale + zero per group | model dtype             | `_weight_int4pack_mm_for_cpu`       |
| compressed-tensors W4A16        |                         |                                     |
| fp8              | float8_e4m3, a scale per row | model dtype             | fp8->bf16 by moving bits + matmul   |
|                  |                              |                         | (no fp8 units on CPUs)              |

Other devices use the same formats through plain torch dequantize-then-matmul, which the tests also
run on CPU, except: fp8 on GPUs with fp8 tensor cores (compute capability 8.9+, bfloat16 models) runs
W8A8, the activations quantized per token on the fly (`fp8_w8a8`, torch._scaled_mm); int4 on CUDA
runs splitserve's Triton W4A16 kernel (int4_linear.py). The 4-bit methods are int4_linear.py's.

Every method first brings what it loaded to one plain form per layer (int8 levels + row scales,
`Int4Weight`, or fp8 + row scales), stacking q/k/v or gate/up shards along the output dim, and
then builds its kernel's form from it. A method with `from_checkpoint=False` quantizes the
dense weights the layer loaded instead (round to nearest): `--quantization weight_only_int8|fp8`
on an unquantized model, and dummy weights for benchmarks.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from splitserve.kernels import row_buckets
from splitserve.layers.basic import Linear, LinearMethod
from splitserve.quantization import int8_mm
from splitserve.quantization.kv_cache import fp8_as_bfloat16
from splitserve.quantization.packing import (
    quantize_int8_per_channel,
)

logger = logging.getLogger(__name__)

# Rows up to which `_weight_int8pack_mm` beats converting the int8 weight for a bf16 matmul
# (measured on a 2-core AVX-512 machine: 0.27 vs 0.30 ms at 16 rows, 1.0 vs 0.47 ms at 64).
_INT8PACK_MAX_ROWS = 16
_W8A8_CHUNK_ROWS = 256
_FP8_MAX = torch.finfo(torch.float8_e4m3fn).max


# --- shared plumbing ---------------------------------------------------------------------------------
class QuantMethod(LinearMethod):
    """Loads per-shard checkpoint tensors (or a dense weight), then builds the kernel form."""

    # checkpoint tensor names each shard must provide / may provide
    required: tuple[str, ...] = ()
    optional: tuple[str, ...] = ()

    def __init__(self, from_checkpoint: bool):
        self.from_checkpoint = from_checkpoint

    def create_weights(self, layer: Linear) -> None:
        if self.from_checkpoint:
            layer.staged = {}
        else:
            super().create_weights(layer)

    def takes(self, name: str) -> bool:
        return self.from_checkpoint and name in self.required + self.optional

    def load(self, layer: Linear, name: str, shard: int, tensor: torch.Tensor) -> None:
        layer.staged[(name, shard)] = tensor

    def process_weights_after_loading(self, layer: Linear) -> None:
        if not self.from_checkpoint:
            dense = layer.weight.data
            del layer.weight
            self.build(layer, self.quantize_dense(dense))
            return
        shards = []
        for shard in range(len(layer.output_sizes)):
            missing = [n for n in self.required if (n, shard) not in layer.staged]
            if missing:
                raise ValueError(
                    f"The checkpoint lacks {missing} for shard {shard} of a {type(self).__name__} "
                    f"layer ({layer.in_features} -> {layer.out_features})."
                )
            tensors = {n: layer.staged[(n, shard)] for n in self.required + self.optional if (n, shard) in layer.staged}
            full = self.from_tensors(tensors, layer.full_output_sizes[shard], layer.full_input_size)
            shards.append(self.narrow(full, *layer.checkpoint_slices(shard)))
        del layer.staged
        self.build(layer, self.concat(shards))

    # per method
    def quantize_dense(self, weight: torch.Tensor):
        raise NotImplementedError

    def from_tensors(self, tensors: dict[str, torch.Tensor], out_features: int, in_features: int):
        raise NotImplementedError

    def narrow(self, plain, rows: slice, cols: slice):
        """This tensor-parallel rank's share of a whole checkpoint matrix's plain form."""
        raise NotImplementedError

    def concat(self, parts: list):
        raise NotImplementedError

    def build(self, layer: Linear, plain) -> None:
        raise NotImplementedError


def flat_rows(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1])


def finish(layer: Linear, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """y [rows, out] in x's leading shape (the layer adds its bias itself)."""
    return y.reshape(*x.shape[:-1], y.shape[-1])


def check_shape(name: str, tensor: torch.Tensor, shape: tuple[int, ...]) -> None:
    if tuple(tensor.shape) != shape:
        raise ValueError(f"Checkpoint tensor {name} has shape {tuple(tensor.shape)}, expected {shape}.")


def _row_scales(scale: torch.Tensor, out_features: int) -> torch.Tensor:
    """A per-tensor scalar or per-row [out] / [out, 1] scale as float32 [out]."""
    scale = scale.float().reshape(-1)
    if scale.numel() == 1:
        return scale.expand(out_features).clone()
    check_shape("weight_scale", scale, (out_features,))
    return scale


class _RowScaledMethod(QuantMethod):
    """Methods whose plain form is (weight [out, in] in a storage dtype, float32 scale [out]);
    the kernel form keeps both as buffers, the scale in `scale_dtype` (None: the layer's dtype)."""

    required = ("weight", "weight_scale")
    storage_dtype: torch.dtype = torch.int8
    scale_dtype: torch.dtype | None = None

    def quantize_dense(self, weight):
        return quantize_int8_per_channel(weight)

    def build(self, layer, plain):
        qweight, scale = plain
        layer.register_buffer("qweight", qweight.contiguous())
        layer.register_buffer("weight_scale", scale.to(self.scale_dtype or layer.dtype))

    def from_tensors(self, tensors, out_features, in_features):
        weight = tensors["weight"]
        check_shape("weight", weight, (out_features, in_features))
        if weight.dtype != self.storage_dtype:
            raise ValueError(f"{type(self).__name__} expects {self.storage_dtype} weights, got {weight.dtype}.")
        return weight, _row_scales(tensors["weight_scale"], out_features)

    def narrow(self, plain, rows, cols):
        weight, scale = plain
        return weight[rows, cols], scale[rows]

    def concat(self, parts):
        return torch.cat([w for w, _ in parts]), torch.cat([s for _, s in parts])


# --- int8 weight-only ------------------------------------------------------------------------------
class Int8WeightOnlyMethod(_RowScaledMethod):
    def apply(self, layer, x):
        x2 = flat_rows(x)
        if x.device.type == "cpu" and x2.shape[0] <= _INT8PACK_MAX_ROWS:
            y = torch.ops.aten._weight_int8pack_mm(x2, layer.qweight, layer.weight_scale)
        else:
            # Scaling the output rather than the weight saves a pass over the weight.
            y = row_buckets.linear(x2, layer.qweight.to(x.dtype)) * layer.weight_scale
        return finish(layer, y, x)


# --- SmoothQuant W8A8 ------------------------------------------------------------------------------
def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic symmetric int8 with one scale per row: (int8 [M, K], float32 scale [M, 1])."""
    scale = x.abs().amax(dim=-1, keepdim=True).float().clamp_(min=1e-6).div_(127.0)
    return x.to(torch.float32, copy=True).div_(scale).round_().clamp_(-127, 127).to(torch.int8), scale


class W8A8Int8Method(_RowScaledMethod):
    scale_dtype = torch.float32  # rescales the int32 accumulator in float32

    def apply(self, layer, x):
        x2 = flat_rows(x)
        if x2.shape[0] <= _W8A8_CHUNK_ROWS:
            return finish(layer, self._matmul(layer, x2), x)
        # Row chunks keep the int32 accumulator and its rescaling in cache: 1.2x bf16's speed at
        # 4096 rows instead of 0.4x for one big call (2-core AVX-512, 576 -> 3072).
        y = torch.empty(x2.shape[0], layer.out_features, dtype=x.dtype, device=x.device)
        for start in range(0, x2.shape[0], _W8A8_CHUNK_ROWS):
            y[start : start + _W8A8_CHUNK_ROWS] = self._matmul(layer, x2[start : start + _W8A8_CHUNK_ROWS])
        return finish(layer, y, x)

    def build(self, layer, plain):
        super().build(layer, plain)
        if layer.qweight.device.type == "cpu" and int8_mm.cpu_int_mm_saturates():  # split once (int8_mm.py)
            hi, lo = int8_mm.split_weight(layer.qweight)
            layer.register_buffer("qweight_hi", hi)
            layer.register_buffer("qweight_lo", lo)

    @staticmethod
    def _matmul(layer, x2: torch.Tensor) -> torch.Tensor:
        xq, x_scale = quantize_per_token(x2)
        min_rows = int8_mm.CUDA_INT_MM_MIN_ROWS if xq.is_cuda else 1
        hi = getattr(layer, "qweight_hi", None)
        halves = None if hi is None else (hi.t(), layer.qweight_lo.t())
        acc = int8_mm.int_mm(xq, layer.qweight.t(), min_rows, halves)
        return acc.float().mul_(x_scale).mul_(layer.weight_scale).to(x2.dtype)


# --- fp8 (e4m3) weights -------------------------------------------------------------------------------
class Fp8Method(_RowScaledMethod):
    storage_dtype = torch.float8_e4m3fn
    optional = ("input_scale",)  # static activation scales of fp8 checkpoints: activations stay unquantized here

    def quantize_dense(self, weight):
        scale = weight.float().abs().amax(dim=1).clamp(min=1e-12) / _FP8_MAX
        return (weight.float() / scale[:, None]).to(torch.float8_e4m3fn), scale

    def build(self, layer, plain):
        super().build(layer, plain)
        layer.fp8_kernel = "scaled_mm" if fp8_tensor_cores(layer.qweight, layer.dtype) else "bfloat16"
        if layer.fp8_kernel == "scaled_mm":
            layer.register_buffer("weight_scale_row", plain[1].float().view(1, -1))

    def apply(self, layer, x):
        if layer.fp8_kernel == "scaled_mm":
            return finish(layer, fp8_w8a8(flat_rows(x), layer.qweight, layer.weight_scale_row), x)
        # Moving bits is exact and several times faster than torch's CPU cast from float8.
        weight = fp8_as_bfloat16(layer.qweight).to(x.dtype)
        y = row_buckets.linear(flat_rows(x), weight) * layer.weight_scale
        return finish(layer, y, x)


def fp8_tensor_cores(qweight: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether fp8 weights multiply as W8A8 on the GPU's fp8 tensor cores (compute capability 8.9 or
    later: Ada, Hopper; bfloat16 models, whose row-wise scaled products torch supports; sizes that
    are multiples of 16)."""
    if qweight.device.type != "cuda" or dtype != torch.bfloat16 or any(d % 16 for d in qweight.shape):
        return False
    return torch.cuda.get_device_capability(qweight.device) >= (8, 9)


def fp8_w8a8(x2: torch.Tensor, qweight: torch.Tensor, weight_scale_row: torch.Tensor) -> torch.Tensor:
    """x2 [M, K] quantized to float8_e4m3 with one dynamic scale per row (token), times the fp8
    weight [N, K] with its row scales [1, N], in one scaled product (torch._scaled_mm): [M, N] in x's dtype."""
    x_scale = x2.abs().amax(dim=-1, keepdim=True).float().clamp_(min=1e-12).div_(_FP8_MAX)
    xq = (x2.float() / x_scale).clamp_(-_FP8_MAX, _FP8_MAX).to(torch.float8_e4m3fn)
    return torch._scaled_mm(xq, qweight.t(), scale_a=x_scale, scale_b=weight_scale_row, out_dtype=x2.dtype)


# --- int4 (AWQ, GPTQ) -------------------------------------------------------------------------------
def weight_bytes(model: nn.Module) -> int:
    """Bytes of every parameter and buffer, and of the weights prepacked for oneDNN on CPU (held outside
    both, layers/basic.py): what the weights take in memory."""
    tensors = list(model.parameters()) + list(model.buffers())
    tensors += [m.packed_weight for m in model.modules() if getattr(m, "packed_weight", None) is not None]
    return sum(t.numel() * t.element_size() for t in tensors)
