"""int8 x int8 -> int32 matrix products (SmoothQuant W8A8's kernel), exact on every CPU.

`torch._int_mm` on CPU goes through oneDNN. On a CPU without VNNI (the AVX2-only hosts, AVX-512
before VNNI, or oneDNN capped below it by ONEDNN_MAX_CPU_ISA) oneDNN multiplies an unsigned copy of
the activations (+128, up to 255) by the signed weights with `vpmaddubsw`, which adds each pair of
products in saturating 16-bit integers: with weights beyond +-64 a pair can pass 32767 and the sum
comes out wrong (measured with ONEDNN_MAX_CPU_ISA=AVX2: off by up to 2e5 on random full-range
int8). Weights within [-64, 64] never saturate (255 * 64 * 2 = 32640), so on such a CPU each weight
is split into halves, w = 2 * hi + lo with hi in [-64, 63] and lo in {0, 1}, and the product is
2 * (a @ hi) + (a @ lo): exact, for twice the products. Layers split their weights once
(`split_weight`); whether this CPU's product saturates is probed once, on a product of 127s.
"""

from __future__ import annotations

import functools
import logging

import torch

from splitserve.kernels import row_buckets

logger = logging.getLogger(__name__)

# torch's CUDA int8 matmul refuses 16 rows or fewer (decode batches); 32 keeps rows a multiple of 8.
CUDA_INT_MM_MIN_ROWS = 32


@functools.cache
def cpu_int_mm_saturates() -> bool:
    """Whether torch._int_mm on this CPU gets a product of full-range int8 values wrong."""
    a = torch.full((16, 64), 127, dtype=torch.int8)
    wrong = not torch.equal(torch._int_mm(a, a.t().contiguous()), torch.full((16, 16), 64 * 127 * 127))
    if wrong:
        logger.info(
            "CPU: torch's int8 products saturate on this CPU (no VNNI): int8 weights are split in two halves "
            "within +-64 and multiplied twice, which is exact."
        )
    return wrong


def split_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 weight -> (hi, lo), int8 tensors of its shape with weight = 2 * hi + lo, hi in [-64, 63]
    and lo in {0, 1}."""
    hi = torch.div(weight, 2, rounding_mode="floor")
    return hi, weight - hi * 2


def int_mm(
    a: torch.Tensor, b: torch.Tensor, min_rows: int = 1, halves: tuple[torch.Tensor, torch.Tensor] | None = None
) -> torch.Tensor:
    """a [M, K] int8 @ b [K, N] int8 -> int32 [M, N], exactly. a is padded by zero rows to min_rows
    first when shorter (the extra rows of the product are dropped). On a CPU whose products saturate,
    b goes as its halves: `halves` (split_weight of b, kept by the caller) or split here."""
    if a.device.type == "cpu" and cpu_int_mm_saturates():
        hi, lo = halves if halves is not None else split_weight(b)
        return _int_mm(a, hi, min_rows).mul_(2).add_(_int_mm(a, lo, min_rows))
    return _int_mm(a, b, min_rows)


def _int_mm(a: torch.Tensor, b: torch.Tensor, min_rows: int) -> torch.Tensor:
    rows = a.shape[0]
    if rows >= min_rows:
        return torch._int_mm(row_buckets.padded_rows(a), b)[:rows]
    padded = torch.zeros(min_rows, a.shape[1], dtype=a.dtype, device=a.device)
    padded[:rows] = a
    return torch._int_mm(padded, b)[:rows]
