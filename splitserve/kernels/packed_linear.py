"""Dense linear weights on CPU (bfloat16 and float32) prepacked once in oneDNN's blocked layout.

F.linear in bfloat16 goes through oneDNN, which reorders the weight into its blocked layout on
every call. Reordered once after loading (torch.ops.mkldnn._reorder_linear_weight, what inductor's
freezing pass does) and multiplied with torch.ops.mkldnn._linear_pointwise, SmolLM2-135M's layer
shapes ran 2x faster at 1 row, 1.3x at 33-64 rows and 1.05x at 2048 (AMD EPYC, AVX512-BF16, 2
threads), and the results equal F.linear's bit for bit at every row count (tested).
F.linear in float32 goes through MKL (sgemm), which on the AMD hosts measured is slower than
oneDNN's packed float32 product: SmolLM2-135M's shapes at 64 rows 1.2-1.5x faster, the LM head
(576 -> 49152) 1.8x, at 2048 rows 1.1x (AMD EPYC, 2 threads, with AVX-512 and capped to AVX2 alike;
MKL's own packed GEMM was no faster than plain sgemm). Its results differ from MKL's in the last
bits (another order of the sums over K), as two GEMM libraries' do.

layers.basic.pack_cpu_weights packs every dense bfloat16 or float32 Linear of a model on CPU (their
dense weight is dropped: the packed copy replaces it) and the dense LM head (an Embedding, which
keeps its dense rows too: a tied head is also the token embedding). SPLITSERVE_CPU_PACKED_WEIGHTS=0
turns it off. Rows are padded to bounded sizes as for F.linear in bfloat16 (row_buckets), since
oneDNN builds a kernel per shape here too.
"""

from __future__ import annotations

import functools
import logging

import torch

from splitserve import envs
from splitserve.kernels import row_buckets

logger = logging.getLogger(__name__)
ENV = "SPLITSERVE_CPU_PACKED_WEIGHTS"
# The batch size oneDNN is told to expect when it picks the blocked layout; any row count works
# with it (measured: as fast as packing for the exact row count from 1 to 2048 rows).
_BATCH_HINT = 64


def enabled() -> bool:
    return envs.SPLITSERVE_CPU_PACKED_WEIGHTS


PACKED_DTYPES = (torch.bfloat16, torch.float32)


def can_pack(weight: torch.Tensor) -> bool:
    return (
        weight.device.type == "cpu"
        and weight.dtype in PACKED_DTYPES
        and weight.dim() == 2
        and torch.backends.mkldnn.is_available()
        and _onednn_packs(weight.dtype)
    )


@functools.cache
def _onednn_packs(dtype: torch.dtype) -> bool:
    """Whether oneDNN reorders weights of this dtype here. float32 on any x86 CPU; bfloat16 needs
    AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT: an AVX2 CPU, or one capped by ONEDNN_MAX_CPU_ISA,
    multiplies bfloat16 weights as they are (F.linear), as logged."""
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=dtype), _BATCH_HINT)
    except RuntimeError as exc:
        logger.info("%s weights are not prepacked: oneDNN cannot reorder them on this CPU (%s)", dtype, exc)
        return False
    return True


def pack(weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] (PACKED_DTYPES) -> an opaque oneDNN tensor for `linear`."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), _BATCH_HINT)


def linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) for the packed weight, x's rows padded by row_buckets."""
    return row_buckets.linear(x, packed, bias, product=_packed_product)


def _packed_product(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
