"""`--quantization gguf`: a GGUF model's linears multiply by their quantized blocks as they are
(splitserve.kernels.gguf: 8-bit activations and integer dot products for decode-sized batches,
tiles dequantized for a dense matmul for larger ones), so a 4-bit model reads 4-bit weights per
token. The default for a quantized .gguf on CPU; `--quantization none` dequantizes it instead. On
CUDA (asked for with `--quantization gguf`), Q4_0, Q4_1 and Q4_K matrices run in the Triton W4A16
kernel (gguf_int4.py) and the other types are dequantized once at load.

A stacked linear (q/k/v, gate/up) keeps shards of one ggml type together as one matrix; a file
that quantizes its shards differently (some Q4_K_M files give v_proj Q6_K) gets one matrix per
run of shards of the same type. Unquantized GGUF tensors (F32/F16/BF16) become dense weights.
"""

from __future__ import annotations

import torch

from splitserve.kernels import row_buckets
from splitserve.layers.basic import Linear, LinearMethod
from splitserve.layers.gguf_weight import GGUFWeight
from splitserve.quantization import gguf_int4

INT4 = "int4"  # a run held as the Triton W4A16 kernel's operands (CUDA)


class GGUFLinearMethod(LinearMethod):
    def create_weights(self, layer: Linear) -> None:
        layer.staged = {}

    def takes(self, name: str) -> bool:
        return name == "weight"

    def load(self, layer: Linear, name: str, shard: int, tensor) -> None:
        if not isinstance(tensor, GGUFWeight):
            raise ValueError(f"--quantization gguf needs GGUF weights, got a {type(tensor).__name__} for {name}.")
        layer.staged[shard] = tensor

    def process_weights_after_loading(self, layer: Linear) -> None:
        missing = [s for s in range(len(layer.output_sizes)) if s not in layer.staged]
        if missing:
            raise ValueError(f"The GGUF file lacks shards {missing} of a {layer.in_features}-input linear layer.")
        parts = [layer.staged[s].take(*layer.checkpoint_slices(s)) for s in range(len(layer.output_sizes))]
        del layer.staged
        layer.gguf_runs = []  # (qtype, rows, buffer name): consecutive output rows of one type
        for i, run in enumerate(_runs_of_one_type(parts)):
            name = f"gguf_weight_{i}"
            if run[0].quantized:
                layer.register_buffer(name, torch.cat([p.data for p in run]).contiguous())
            else:
                layer.register_buffer(name, torch.cat([p.dense(layer.dtype) for p in run]))
            layer.gguf_runs.append((run[0].qtype if run[0].quantized else None, sum(p.shape[0] for p in run), name))
        if layer.gguf_runs and getattr(layer, layer.gguf_runs[0][2]).device.type == "cuda":
            _for_cuda(layer)

    def pack_cpu_weights(self, layer: Linear) -> int:
        """Q4_0/Q4_1/Q8_0 runs of a multiple of 16 rows interleaved for the decode GEMV (kernels.gguf.repack)."""
        from splitserve.kernels import gguf as gguf_kernels

        count = 0
        for i, (qtype, rows, name) in enumerate(layer.gguf_runs):
            repacked = (
                None if qtype is None else gguf_kernels.repack(getattr(layer, name), qtype, rows, layer.in_features)
            )
            if repacked is not None:
                setattr(layer, name, repacked[0])  # the buffer's bytes, interleaved
                layer.gguf_runs[i] = (repacked[1], rows, name)
                count += 1
        return count

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        from splitserve.kernels import gguf as gguf_kernels

        x2 = x.reshape(-1, x.shape[-1])
        outputs = []
        for qtype, rows, name in layer.gguf_runs:
            if qtype == INT4:
                from splitserve.kernels import triton_int4

                operands = (getattr(layer, f"{name}_{part}") for part in "qsz")
                outputs.append(triton_int4.linear(x2, *operands, 32))
            elif qtype is None:
                outputs.append(row_buckets.linear(x2, getattr(layer, name)))
            else:
                outputs.append(gguf_kernels.gguf_mm(x2, getattr(layer, name), qtype, rows, layer.in_features))
        y = outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=-1)
        return y.reshape(*x.shape[:-1], y.shape[-1])


def _for_cuda(layer: Linear) -> None:
    """On a GPU: Q4_0, Q4_1 and Q4_K runs as the Triton W4A16 kernel's operands (quantization/
    gguf_int4.py: the levels kept, 4.5-5 bits read per weight), the other types dequantized once,
    here, for dense products (never per step)."""
    from splitserve.quantization.int4_linear import choose_kernel

    for i, (qtype, rows, name) in enumerate(layer.gguf_runs):
        if qtype is None:
            continue
        blocks = getattr(layer, name)
        delattr(layer, name)
        plain = None
        if (
            gguf_int4.convertible(qtype)
            and choose_kernel(blocks.device, layer.dtype, layer.in_features, 32, False) == "triton"
        ):
            plain = gguf_int4.to_int4(blocks, qtype, rows, layer.in_features)
        if plain is None:
            from splitserve.kernels.gguf import dequantize_reference

            layer.register_buffer(name, dequantize_reference(blocks, qtype, rows, layer.in_features).to(layer.dtype))
            layer.gguf_runs[i] = (None, rows, name)
            continue
        from splitserve.kernels import triton_int4

        # float32 scale and zero: a Q4_1 or Q4_K zero is not a 16-bit number
        for part, tensor in zip("qsz", triton_int4.operands(plain.q, plain.scale, plain.zero, torch.float32)):
            layer.register_buffer(f"{name}_{part}", tensor)
        layer.gguf_runs[i] = (INT4, rows, name)


def _runs_of_one_type(parts: list[GGUFWeight]) -> list[list[GGUFWeight]]:
    runs: list[list[GGUFWeight]] = []
    for part in parts:
        if runs and runs[-1][0].qtype == part.qtype:
            runs[-1].append(part)
        else:
            runs.append([part])
    return runs
