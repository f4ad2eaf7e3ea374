"""`--quantization gguf`: a GGUF model's linears multiply by their quantized blocks as they are
(splitserve.kernels.gguf: 8-bit activations and integer dot products for decode-sized batches,
tiles dequantized for a dense matmul for larger ones), so a 4-bit model reads 4-bit weights per
token. The default for a quantized .gguf on CPU; `--quantization none` dequantizes it instead.

A stacked linear (q/k/v, gate/up) keeps shards of one ggml type together as one matrix; a file
that quantizes its shards differently (some Q4_K_M files give v_proj Q6_K) gets one matrix per
run of shards of the same type. Unquantized GGUF tensors (F32/F16/BF16) become dense weights.
"""

from __future__ import annotations

import torch

from splitserve.kernels import row_buckets
from splitserve.layers.basic import Linear, LinearMethod
from splitserve.layers.gguf_weight import GGUFWeight


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
            weight = getattr(layer, name)
            if qtype is None:
                outputs.append(row_buckets.linear(x2, weight))
            else:
                outputs.append(gguf_kernels.gguf_mm(x2, weight, qtype, rows, layer.in_features))
        y = outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=-1)
        return y.reshape(*x.shape[:-1], y.shape[-1])


def _runs_of_one_type(parts: list[GGUFWeight]) -> list[list[GGUFWeight]]:
    runs: list[list[GGUFWeight]] = []
    for part in parts:
        if runs and runs[-1][0].qtype == part.qtype:
            runs[-1].append(part)
        else:
            runs.append([part])
    return runs
