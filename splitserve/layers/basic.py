"""The small building blocks of decoder-only transformers. Parameters are allocated empty:
the loader fills every one of them, so random initialisation would only cost time."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from splitserve import kernels


class LinearMethod:
    """How a Linear holds and applies a weight that is not one dense matrix (a quantized one).

    A method either reads its own checkpoint tensors (`takes` / `load`, e.g. AWQ's qweight) or
    lets the layer load a dense `weight` and quantizes it afterwards. Either way
    `process_weights_after_loading` turns what was loaded into the form `apply` computes with.
    """

    def create_weights(self, layer: Linear) -> None:
        """Register what loading fills (default: a dense weight)."""
        layer.weight = nn.Parameter(torch.empty(layer.out_features, layer.in_features, dtype=layer.dtype),
                                    requires_grad=False)

    def takes(self, name: str) -> bool:
        """Whether the checkpoint tensor `<layer>.<name>` is this method's to load."""
        return False

    def load(self, layer: Linear, name: str, shard: int, tensor: torch.Tensor) -> None:
        raise NotImplementedError

    def process_weights_after_loading(self, layer: Linear) -> None:
        pass

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class Linear(nn.Module):
    """y = x W^T (+ b), where W may be several checkpoint matrices stacked along the output dim
    (`output_sizes`), so that q/k/v or gate/up run as one matmul. With a `quant_method`, W is
    stored and multiplied the way that method says."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False,
                 dtype: torch.dtype | None = None, quant_method: LinearMethod | None = None):
        super().__init__()
        self.output_sizes = list(output_sizes)
        self.in_features, self.out_features = input_size, sum(self.output_sizes)
        self.dtype = dtype if dtype is not None else torch.get_default_dtype()
        self.quant_method = quant_method
        if quant_method is None:
            self.weight = nn.Parameter(torch.empty(self.out_features, input_size, dtype=dtype), requires_grad=False)
        else:
            quant_method.create_weights(self)
        self.bias = nn.Parameter(torch.empty(self.out_features, dtype=dtype), requires_grad=False) if bias else None

    def shard_slice(self, shard: int) -> slice:
        start = sum(self.output_sizes[:shard])
        return slice(start, start + self.output_sizes[shard])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quant_method is None:
            return F.linear(x, self.weight, self.bias)
        return self.quant_method.apply(self, x)


class Embedding(nn.Module):
    def __init__(self, num_embeddings: int, dim: int, dtype: torch.dtype | None = None):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_embeddings, dim, dtype=dtype), requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)


class RMSNorm(nn.Module):
    """transformers' Llama/Qwen RMSNorm: normalised in float32, cast back, times the weight.
    Called with a residual, it adds x to it first and returns (normed, new residual), as vLLM's
    fused add-norm does; on CPU both run in one kernel (splitserve.kernels)."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype | None = None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        out, residual = kernels.rms_norm(x, self.weight, self.eps, residual)
        return out if residual is None else (out, residual)


silu_and_mul = kernels.silu_and_mul
