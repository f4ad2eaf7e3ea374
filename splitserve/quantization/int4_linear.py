"""4-bit weights at run time (AWQ, GPTQ with or without act-order, compressed-tensors W4A16): each
layer's checkpoint tensors unpacked to one plain `Int4Weight`, split over the tensor-parallel ranks
by groups of input columns, and multiplied by torch's CPU int4 kernel (`_weight_int4pack_mm_for_cpu`,
which computes (q - 8) * scale + bias per group), on CUDA by splitserve's Triton W4A16 kernel (packed
weights dequantized in registers, kernels/triton_int4.py), elsewhere dequantized for a dense product
(linear.py's table has the other methods)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from splitserve import kernels
from splitserve.layers.basic import Linear
from splitserve.quantization import compressed_tensors
from splitserve.quantization.linear import QuantMethod, check_shape, finish, flat_rows
from splitserve.quantization.packing import Int4Weight, quantize_int4_groupwise, unpack_awq, unpack_gptq


class Int4Method(QuantMethod):
    portable = False  # True: use the device-independent dequantize path even on CPU (tests)

    def __init__(self, method: str, group_size: int, from_checkpoint: bool):
        super().__init__(from_checkpoint)
        self.method = method
        self.group_size = group_size
        if method == "awq":
            self.required = ("qweight", "qzeros", "scales")
        elif method == compressed_tensors.METHOD:
            self.required, self.optional = compressed_tensors.REQUIRED, compressed_tensors.OPTIONAL
        else:
            self.required, self.optional = ("qweight", "qzeros", "scales"), ("g_idx",)

    def create_weights(self, layer):
        group = self._group(layer.in_features)
        if layer.in_features % group:
            raise ValueError(f"A {layer.in_features}-input linear layer cannot use {self.method} group_size {group}.")
        if group not in (32, 64, 128, 256) and layer.in_features != group:
            raise ValueError(
                f"{self.method} group_size {group} is not supported on this engine "
                "(the int4 kernel takes 32, 64, 128 or 256)."
            )
        super().create_weights(layer)

    def _group(self, in_features: int) -> int:
        if self.group_size <= 0:
            return in_features
        # Random (dummy) weights of a layer narrower than a group use one group per row.
        return self.group_size if self.from_checkpoint else min(self.group_size, in_features)

    def quantize_dense(self, weight):
        return quantize_int4_groupwise(weight, self._group(weight.shape[1]), sym=False)

    def from_tensors(self, tensors, out_features, in_features):
        group = self._group(in_features)
        if self.method == "awq":
            plain = unpack_awq(tensors["qweight"], tensors["qzeros"], tensors["scales"], group)
        elif self.method == compressed_tensors.METHOD:
            plain = compressed_tensors.unpack(tensors, group)
        else:
            plain = unpack_gptq(tensors["qweight"], tensors["qzeros"], tensors["scales"], tensors.get("g_idx"), group)
        check_shape(f"{self.method} qweight (unpacked)", plain.q, (out_features, in_features))
        return plain

    def narrow(self, plain: Int4Weight, rows: slice, cols: slice) -> Int4Weight:
        g = plain.group_size
        if cols.stop - cols.start == plain.q.shape[1]:
            return Int4Weight(plain.q[rows], plain.scale[rows], plain.zero[rows], g, plain.g_idx)
        if plain.g_idx is not None:
            raise ValueError(
                "A GPTQ checkpoint with act-order (desc_act / g_idx) cannot be split by input columns "
                "across tensor-parallel ranks: its channels of one group are spread over all ranks. "
                "Use tensor_parallel_size=1 or a checkpoint quantized without act-order."
            )
        groups = slice(cols.start // g, cols.stop // g)
        return Int4Weight(plain.q[rows, cols], plain.scale[rows, groups], plain.zero[rows, groups], g, None)

    def concat(self, parts: list[Int4Weight]) -> Int4Weight:
        g_idx = parts[0].g_idx
        for part in parts[1:]:
            if (part.g_idx is None) != (g_idx is None) or (g_idx is not None and not torch.equal(part.g_idx, g_idx)):
                raise ValueError("Stacked projections (q/k/v or gate/up) have different g_idx.")
        return Int4Weight(
            torch.cat([p.q for p in parts]),
            torch.cat([p.scale for p in parts]),
            torch.cat([p.zero for p in parts]),
            parts[0].group_size,
            g_idx,
        )

    def build(self, layer, plain: Int4Weight):
        q, scale, zero = plain.q, plain.scale, plain.zero
        group = plain.group_size
        perm = None
        if plain.g_idx is not None:
            # act-order: sort input channels by group, so that each group is contiguous again,
            # and gather the activations in that order at run time.
            perm = torch.argsort(plain.g_idx.long(), stable=True)
            counts = torch.bincount(plain.g_idx.long(), minlength=scale.shape[1])
            if not bool((counts == group).all()):
                raise ValueError("GPTQ g_idx does not give every group exactly group_size channels.")
            q = q[:, perm]
        layer.register_buffer("perm", perm)
        layer.group_size = group
        layer.int4_kernel = choose_kernel(q.device, layer.dtype, q.shape[1], group, self.portable)
        if layer.int4_kernel == "triton":
            from splitserve.kernels import triton_int4

            for name, tensor in zip(("qweight", "scales", "zeros"), triton_int4.operands(q, scale, zero, layer.dtype)):
                layer.register_buffer(name, tensor)
        elif layer.int4_kernel == "cpu_int4pack":
            if layer.out_features % 16:
                raise ValueError(f"The CPU int4 kernel needs output sizes divisible by 16, got {layer.out_features}.")
            layer.register_buffer(
                "qweight", torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).contiguous(), 8)
            )
            # the kernel computes (q - 8) * scale + bias per group
            bias = (8 - zero.float()) * scale
            layer.register_buffer(
                "scales_and_zeros", torch.stack([scale.t(), bias.t()], dim=-1).to(layer.dtype).contiguous()
            )
        else:
            layer.register_buffer("qweight", q.to(torch.uint8).contiguous())
            layer.register_buffer("scales", scale.to(layer.dtype))
            layer.register_buffer("zeros", zero.to(layer.dtype))

    def apply(self, layer, x):
        x2 = flat_rows(x)
        if layer.perm is not None:
            x2 = x2.index_select(1, layer.perm)
        if layer.int4_kernel == "cpu_int4pack":
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, layer.qweight, layer.group_size, layer.scales_and_zeros)
        elif layer.int4_kernel == "triton":
            from splitserve.kernels import triton_int4

            y = triton_int4.linear(x2, layer.qweight, layer.scales, layer.zeros, layer.group_size)
        else:
            y = _dequantized_linear(layer, x2)
        return finish(layer, y, x)


def choose_kernel(device: torch.device, dtype: torch.dtype, in_features: int, group: int, portable: bool) -> str:
    """cpu_int4pack on CPU; on CUDA the Triton W4A16 kernel (kernels/triton_int4.py: packed weights
    dequantized in registers) for 16-bit activations in groups it takes; else (and when `portable`)
    dequantize."""
    if portable:
        return "dequantize"
    if device.type == "cpu":
        return "cpu_int4pack"
    if device.type == "cuda" and dtype in (torch.float16, torch.bfloat16) and kernels.gpu_ops() is not None:
        from splitserve.kernels import triton_int4

        if triton_int4.supported(in_features, group):
            return "triton"
    return "dequantize"


def _dequantized_linear(layer: Linear, x2: torch.Tensor) -> torch.Tensor:
    """The portable int4 path: expand the weight, then a dense matmul."""
    out_features, in_features = layer.qweight.shape
    groups = in_features // layer.group_size
    q = layer.qweight.view(out_features, groups, layer.group_size).to(x2.dtype)
    w = (q - layer.zeros[..., None]) * layer.scales[..., None]
    return F.linear(x2, w.view(out_features, in_features))
