"""Matmul rows padded to a bounded set of sizes on CPU, so that oneDNN's caches stay bounded.

torch multiplies bfloat16 and float16 (and `torch._int_mm`'s int8) on CPU through oneDNN, which
builds and JIT-compiles a kernel for every new shape and keeps it in two caches of up to 1024
entries each (ideep's `LRU_CACHE_CAPACITY`, oneDNN's `ONEDNN_PRIMITIVE_CACHE_CAPACITY`), about
0.5 MB apiece. A server's steps carry every row count from 1 to max_num_batched_tokens, so the
engine process grew by over a gigabyte in a 10-minute soak without leaking anything (float32
F.linear goes through MKL and does not grow; float32 weights prepacked for oneDNN do, and are
padded). Building a kernel also costs about 1.7 ms, against 0.6 ms
for the product itself at a few hundred rows (576 -> 1728, 2 cores).

So rows go up to `row_bucket(m)`: exact up to 16 (decode batches), then multiples of 16 up to
256 (at most 15 zero rows, nearly free while the product is bound by reading the weight), then 8
sizes per doubling (at most 12.5% of the rows computed for nothing), and from 1024 rows on 8
finer ones in the first 1/16 past each power of two: a step of the default 2048-token budget plus
a prompt tail it finishes (the scheduler's prompt_tail_tokens) would otherwise compute 2304 rows.
Up to 4096 rows that is 79 sizes per weight shape, each built once.
SPLITSERVE_CPU_ROW_BUCKETS=0 turns it off.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from splitserve import envs
from splitserve.kernels import batch_invariant

_EXACT_UP_TO = 16
_PER_DOUBLING = 8
_BUCKETED_DTYPES = (torch.bfloat16, torch.float16, torch.int8)


# Read once: padded_rows runs for every linear of every step.
ENABLED = envs.SPLITSERVE_CPU_ROW_BUCKETS


def row_bucket(m: int) -> int:
    """The smallest bucket size >= m."""
    if m <= _EXACT_UP_TO:
        return m
    # m in [2^p, 2^(p+1)): steps of 2^p / _PER_DOUBLING, and never finer than _EXACT_UP_TO; steps of
    # 2^p / 128 up to 2^p + 2^p / 16 from 2^p = 1024 on.
    base = 1 << (m.bit_length() - 1)
    if base >= 1024 and m <= base + base // 16:
        step = base // 128
    else:
        step = max(_EXACT_UP_TO, base // _PER_DOUBLING)
    return -(-m // step) * step


def rows_for(m: int, weight: torch.Tensor | None = None) -> int:
    """The rows a CPU product of m rows computes: row_bucket(m), rounded up to the batch-invariant
    row multiple of `weight` when that mode is on (kernels/batch_invariant.py)."""
    rows = row_bucket(m) if ENABLED else m
    return batch_invariant.padded_row_count(rows, weight) if batch_invariant.enabled() else rows


def padded_rows(x2: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
    """x2 [M, K] with zero rows appended up to rows_for(M, weight), where the product would go
    through oneDNN (a CPU tensor of a bucketed dtype, or a weight prepacked for oneDNN) or
    batch-invariant numerics are on; x2 itself otherwise."""
    m = x2.shape[0]
    through_onednn = x2.dtype in _BUCKETED_DTYPES or (weight is not None and weight.is_mkldnn)  # packed float32 too
    if x2.device.type != "cpu" or not (batch_invariant.enabled() or (ENABLED and through_onednn)):
        return x2
    rows = rows_for(m, weight)
    if rows == m:
        return x2
    padded = x2.new_empty(rows, x2.shape[1])
    padded[:m] = x2
    padded[m:].zero_()
    return padded


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, product=None) -> torch.Tensor:
    """product(x, weight, bias) (F.linear by default, or another with its contract) with x's rows
    (all leading dims together) padded by `padded_rows`."""
    product = F.linear if product is None else product
    x2 = x.reshape(-1, x.shape[-1])
    padded = padded_rows(x2, weight)
    if padded is x2:
        return product(x, weight, bias)
    y = product(padded, weight, bias)[: x2.shape[0]]
    return y.view(*x.shape[:-1], y.shape[-1])
