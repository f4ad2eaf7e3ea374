"""A GGUF weight kept in its blocks: what the loader hands to a layer under `--quantization gguf`.

Each row of the matrix (one output feature) is its run of GGUF blocks, as in the file: a uint8
tensor [rows, row bytes], where a row of K values is K / block_values blocks of block_bytes each
(Q4_1: 32 values in 20 bytes; Q4_K: 256 values in 144). Taking rows (tensor-parallel output
shares, q/k row permutations) is indexing the tensor; taking columns (input shares) must fall on
block boundaries. Unquantized GGUF types (F32, F16, BF16) come this way too and are made dense.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# ggml type ids stored unquantized, and their torch dtypes
DENSE_TYPES = {0: torch.float32, 1: torch.float16, 30: torch.bfloat16}


def block_size(qtype: int) -> tuple[int, int]:
    """(values, bytes) of one block of a ggml type."""
    import gguf

    return gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(qtype)]


def type_name(qtype: int) -> str:
    import gguf

    return gguf.GGMLQuantizationType(qtype).name


@dataclass(frozen=True)
class GGUFWeight:
    qtype: int
    shape: tuple[int, int]  # [rows, values per row]
    data: torch.Tensor  # uint8 [rows, row bytes]

    @property
    def quantized(self) -> bool:
        return self.qtype not in DENSE_TYPES

    def take(self, rows: slice, cols: slice) -> GGUFWeight:
        """The sub-matrix [rows, cols]; columns must start and end on block boundaries."""
        values, nbytes = block_size(self.qtype)
        start, stop = cols.start or 0, self.shape[1] if cols.stop is None else cols.stop
        if start % values or stop % values:
            raise ValueError(
                f"A {type_name(self.qtype)} weight can only be split between its {values}-value blocks: "
                f"columns {start}:{stop} of {self.shape[1]} cut through one (use a tensor-parallel size that "
                "keeps each rank's share of the input a multiple of the block)."
            )
        data = self.data[rows, start // values * nbytes : stop // values * nbytes]
        return GGUFWeight(self.qtype, (data.shape[0], stop - start), data)

    def permute_rows(self, order: torch.Tensor) -> GGUFWeight:
        return GGUFWeight(self.qtype, self.shape, self.data.index_select(0, order))

    def padded_rows(self, rows: int) -> GGUFWeight:
        """With zero rows appended up to `rows` (all-zero blocks decode to zeros in every type)."""
        extra = rows - self.shape[0]
        if extra <= 0:
            return self
        data = torch.cat([self.data, self.data.new_zeros(extra, self.data.shape[1])])
        return GGUFWeight(self.qtype, (rows, self.shape[1]), data)

    def dense(self, dtype: torch.dtype) -> torch.Tensor:
        """The values as a [rows, values] tensor of `dtype`."""
        if not self.quantized:
            raw = self.data.contiguous().view(DENSE_TYPES[self.qtype])
            return raw.reshape(self.shape).to(dtype)
        from splitserve.kernels import gguf as gguf_kernels

        return gguf_kernels.gguf_dequantize(self.data, self.qtype, *self.shape, dtype)
