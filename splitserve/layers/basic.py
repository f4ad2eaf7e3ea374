"""The small building blocks of decoder-only transformers. Parameters are allocated empty:
the loader fills every one of them, so random initialisation would only cost time."""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from splitserve import kernels
from splitserve.distributed.communication import tp_all_gather, tp_all_reduce
from splitserve.distributed.parallel_state import get_parallel_rank
from splitserve.kernels import packed_linear, row_buckets
from splitserve.layers.gguf_weight import GGUFWeight

logger = logging.getLogger(__name__)


class LinearMethod:
    """How a Linear holds and applies a weight that is not one dense matrix (a quantized one).

    A method either reads its own checkpoint tensors (`takes` / `load`, e.g. AWQ's qweight) or
    lets the layer load a dense `weight` and quantizes it afterwards. Either way
    `process_weights_after_loading` turns what was loaded into the form `apply` computes with.
    """

    def create_weights(self, layer: Linear) -> None:
        """Register what loading fills (default: a dense weight)."""
        layer.weight = nn.Parameter(
            torch.empty(layer.out_features, layer.in_features, dtype=layer.dtype), requires_grad=False
        )

    def takes(self, name: str) -> bool:
        """Whether the checkpoint tensor `<layer>.<name>` is this method's to load."""
        return False

    def load(self, layer: Linear, name: str, shard: int, tensor: torch.Tensor) -> None:
        raise NotImplementedError

    def process_weights_after_loading(self, layer: Linear) -> None:
        pass

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def pack_cpu_weights(self, layer: Linear) -> int:
        """Rewrite the layer's weights once into the layout the CPU kernels multiply fastest, after
        loading and on the CPU only (pack_cpu_weights); returns how many were rewritten."""
        return 0


class Linear(nn.Module):
    """y = x W^T (+ b), where W may be several checkpoint matrices stacked along the output dim
    (`output_sizes`), so that q/k/v or gate/up run as one matmul. With a `quant_method`, W is
    stored and multiplied the way that method says.

    Under tensor parallelism (`parallel`): "column" gives each rank its share of every stacked
    matrix's output rows (matrix s split into `output_partitions[s]` parts, tp by default; rank r
    holds part r * parts // tp, so a matrix with fewer parts than ranks, such as the K and V of
    fewer KV heads than ranks, is replicated); "row" gives each rank its share of the input
    columns and sums the outputs over the ranks (the bias is added once, after the sum). Loading
    takes the checkpoint's full tensors and keeps this rank's share (`checkpoint_slices`)."""

    def __init__(
        self,
        input_size: int,
        output_sizes: list[int],
        bias: bool = False,
        dtype: torch.dtype | None = None,
        quant_method: LinearMethod | None = None,
        parallel: str | None = None,
        output_partitions: list[int] | None = None,
    ):
        super().__init__()
        rank = get_parallel_rank()
        assert parallel in (None, "column", "row"), parallel
        self.parallel = parallel if rank.tp_size > 1 else None
        self.tp_rank, self.tp_size = (rank.tp_rank, rank.tp_size) if self.parallel else (0, 1)
        self.full_input_size, self.full_output_sizes = input_size, list(output_sizes)
        self.output_partitions = self._partitions(output_partitions)
        self.output_sizes = [_divide(s, p, "output rows") for s, p in zip(output_sizes, self.output_partitions)]
        self.in_features = _divide(input_size, self.tp_size, "input columns") if self.parallel == "row" else input_size
        self.out_features = sum(self.output_sizes)
        self.dtype = dtype if dtype is not None else torch.get_default_dtype()
        self.quant_method = quant_method
        if quant_method is None:
            self.weight = nn.Parameter(
                torch.empty(self.out_features, self.in_features, dtype=dtype), requires_grad=False
            )
        else:
            quant_method.create_weights(self)
        self.bias = nn.Parameter(torch.empty(self.out_features, dtype=dtype), requires_grad=False) if bias else None
        self.lora = None  # LoRASlots (layers/lora.py) when the engine serves LoRA adapters
        self.packed_weight: torch.Tensor | None = None  # the weight in oneDNN's layout (kernels/packed_linear.py)

    def pack_weight(self, packed: torch.Tensor) -> None:
        """Compute with `packed` (kernels/packed_linear.py) from now on; the dense weight is dropped."""
        del self.weight
        self.weight = None
        self.packed_weight = packed

    def _dense(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.packed_weight is not None:
            return packed_linear.linear(x, self.packed_weight, bias)
        return row_buckets.linear(x, self.weight, bias)

    def _partitions(self, given: list[int] | None) -> list[int]:
        if self.parallel != "column":
            return [1] * len(self.full_output_sizes)
        parts = given or [self.tp_size] * len(self.full_output_sizes)
        for p in parts:
            if self.tp_size % p and p % self.tp_size:
                raise ValueError(f"{p} parts cannot be spread over {self.tp_size} tensor-parallel ranks.")
        return [min(p, self.tp_size) for p in parts]

    def shard_slice(self, shard: int) -> slice:
        """Where stacked matrix `shard` lies in this rank's output rows."""
        start = sum(self.output_sizes[:shard])
        return slice(start, start + self.output_sizes[shard])

    def checkpoint_slices(self, shard: int) -> tuple[slice, slice]:
        """(rows, columns) of the checkpoint's full matrix `shard` that this rank holds."""
        size, parts = self.output_sizes[shard], self.output_partitions[shard]
        part = self.tp_rank * parts // self.tp_size
        rows = slice(part * size, (part + 1) * size)
        if self.parallel != "row":
            return rows, slice(0, self.full_input_size)
        return rows, slice(self.tp_rank * self.in_features, (self.tp_rank + 1) * self.in_features)

    def load_checkpoint_tensor(self, name: str, shard: int | None, tensor: torch.Tensor) -> None:
        """A full checkpoint tensor of this layer (`weight`, `bias`, or a quantized method's own)."""
        if self.quant_method is not None and self.quant_method.takes(name):
            self.quant_method.load(self, name, shard or 0, tensor)
            return
        rows, cols = self.checkpoint_slices(shard or 0)
        dest = getattr(self, name).data
        if shard is not None:
            dest = dest[self.shard_slice(shard)]
        if name == "bias":
            tensor = tensor[rows] if self.parallel == "column" else tensor
        elif tensor.dim() == 2:
            tensor = tensor[rows, cols]
        if dest.shape != tensor.shape:
            raise ValueError(
                f"Checkpoint tensor {name!r} has shape {tuple(tensor.shape)} after taking this rank's "
                f"share, expected {tuple(dest.shape)}."
            )
        dest.copy_(tensor)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.parallel == "row":
            y = self._matmul(x)
            if self.lora is not None:
                self.lora.add_delta(x, y)  # each rank's share of the delta, summed with the output
            y = tp_all_reduce(y)
            return y if self.bias is None else y + self.bias
        if self.quant_method is None:
            y = self._dense(x, self.bias)
        else:
            y = self.quant_method.apply(self, x)
            y = y if self.bias is None else y + self.bias
        if self.lora is not None:
            self.lora.add_delta(x, y)
        return y

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x W^T without the bias."""
        if self.quant_method is None:
            return self._dense(x, None)
        return self.quant_method.apply(self, x)


def _divide(size: int, parts: int, what: str) -> int:
    if size % parts:
        raise ValueError(f"{size} {what} cannot be split evenly over {parts} tensor-parallel ranks.")
    return size // parts


class Embedding(nn.Module):
    """The token embedding, split by vocabulary rows under tensor parallelism (vLLM's
    VocabParallelEmbedding): each rank holds a contiguous share of the rows (the vocabulary padded
    to a multiple of the ranks), looks up the ids it holds, and the ranks' results are summed.
    The untied LM head is one too (vLLM's ParallelLMHead): `logits` multiplies by this rank's rows
    and gathers the ranks' shares in order. A quantized GGUF embedding (--quantization gguf) stays
    in its blocks: rows are dequantized as they are looked up, and the logits come from the
    quantized matmul."""

    def __init__(self, num_embeddings: int, dim: int, dtype: torch.dtype | None = None):
        super().__init__()
        rank = get_parallel_rank()
        self.num_embeddings, self.dim, self.tp_size = num_embeddings, dim, rank.tp_size
        self.rows_per_rank = -(-num_embeddings // rank.tp_size)
        self.first_row = rank.tp_rank * self.rows_per_rank
        self.dtype = dtype if dtype is not None else torch.get_default_dtype()
        self.weight = nn.Parameter(torch.empty(self.rows_per_rank, dim, dtype=dtype), requires_grad=False)
        self.gguf_qtype: int | None = None  # set when the weight is kept in GGUF blocks (`gguf_blocks`)
        self.packed_weight: torch.Tensor | None = None  # the LM head in oneDNN's layout (kernels/packed_linear.py)

    def load_checkpoint_tensor(self, name: str, shard: int | None, tensor) -> None:
        assert name == "weight" and shard is None
        if tensor.shape[0] != self.num_embeddings or tuple(tensor.shape[1:]) != (self.dim,):
            raise ValueError(
                f"Checkpoint embedding has shape {tuple(tensor.shape)}, expected {(self.num_embeddings, self.dim)}."
            )
        rows = slice(self.first_row, self.first_row + self.rows_per_rank)
        if isinstance(tensor, GGUFWeight) and tensor.quantized and self.weight.device.type == "cpu":
            # blocks kept for the CPU kernels; on a GPU the table is dense (looked up, not streamed)
            share = tensor.take(rows, slice(0, self.dim)).padded_rows(self.rows_per_rank)
            del self.weight
            self.register_buffer("gguf_blocks", share.data.contiguous())
            self.gguf_qtype = tensor.qtype
            return
        share = (
            tensor.take(rows, slice(0, self.dim)).dense(self.dtype) if isinstance(tensor, GGUFWeight) else tensor[rows]
        )
        self.weight.data[: len(share)].copy_(share)
        self.weight.data[len(share) :].zero_()  # padding rows of the last rank

    def repack_gguf_blocks(self) -> int:
        """Interleave a GGUF head's blocks 16 rows at a time for its logits' products (kernels.gguf.repack);
        1 if it was, 0 where its type or row count has no repacked layout."""
        from splitserve.kernels import gguf as gguf_kernels

        repacked = gguf_kernels.repack(self.gguf_blocks, self.gguf_qtype, self.gguf_blocks.shape[0], self.dim)
        if repacked is None:
            return 0
        self.gguf_blocks, self.gguf_qtype = repacked
        return 1

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        if self.gguf_qtype is None:
            return F.embedding(ids, self.weight)
        from splitserve.kernels import gguf as gguf_kernels

        return gguf_kernels.gguf_embedding(ids, self.gguf_blocks, self.gguf_qtype, self.dim, self.dtype)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return self._lookup(ids)
        local = ids - self.first_row
        outside = (local < 0) | (local >= self.rows_per_rank)
        out = self._lookup(local.masked_fill(outside, 0))
        out.masked_fill_(outside[:, None], 0)
        return tp_all_reduce(out)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.packed_weight is not None:
            logits = packed_linear.linear(hidden, self.packed_weight)
        elif self.gguf_qtype is None:
            logits = row_buckets.linear(hidden, self.weight)
        else:
            from splitserve.kernels import gguf as gguf_kernels

            flat = hidden.reshape(-1, self.dim)
            logits = gguf_kernels.gguf_mm(flat, self.gguf_blocks, self.gguf_qtype, self.rows_per_rank, self.dim)
        if self.tp_size == 1:
            return logits
        return tp_all_gather(logits, dim=-1)[..., : self.num_embeddings]


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


def pack_cpu_weights(model: nn.Module) -> int:
    """Prepack the model's weights once for the CPU kernels: dense bfloat16 and float32 linears and
    the LM head for oneDNN (kernels/packed_linear.py), and whatever a quantized linear's method repacks (GGUF
    Q4_0/Q4_1/Q8_0 blocks interleaved 16 rows at a time), a GGUF LM head too (its token lookups read
    the interleaved rows). Returns how many weights were packed, and logs it."""
    if not packed_linear.enabled():
        logger.info(
            "%s=0: dense linear weights are multiplied as loaded (F.linear), quantized ones stay as loaded.",
            packed_linear.ENV,
        )
        return 0
    dense = quantized = 0
    for module in model.modules():
        if hasattr(module, "pack_weights"):  # mixture-of-experts layers pack their experts themselves
            dense += module.pack_weights()
        if not isinstance(module, Linear):
            continue
        if module.quant_method is not None:
            quantized += module.quant_method.pack_cpu_weights(module)
        elif packed_linear.can_pack(module.weight):
            module.pack_weight(packed_linear.pack(module.weight))
            dense += 1
    head = model.compute_logits_embedding() if hasattr(model, "compute_logits_embedding") else None
    if isinstance(head, Embedding) and head.gguf_qtype is None and packed_linear.can_pack(head.weight):
        head.packed_weight = packed_linear.pack(head.weight)
        dense += 1
    elif isinstance(head, Embedding) and head.gguf_qtype is not None:
        quantized += head.repack_gguf_blocks()
    if dense:
        logger.info(
            "CPU: %d dense weights prepacked for oneDNN once, not reordered at every call (%s=0 turns it off).",
            dense,
            packed_linear.ENV,
        )
    if quantized:
        logger.info(
            "CPU: %d quantized weights repacked for the decode kernels, 16 rows interleaved (%s=0 turns it off).",
            quantized,
            packed_linear.ENV,
        )
    return dense + quantized
