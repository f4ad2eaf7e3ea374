"""A mixture-of-experts layer's experts on CUDA in one Triton launch per projection (the design of
vLLM's fused_moe: sort the (token, slot) pairs by expert once, pad each expert's run to whole
blocks of rows, and let every program of one grouped GEMM compute a block of rows of one expert).

- `moe_align`: torch ops only, fixed shapes (the most rows the padding can take:
  pairs + experts * (BLOCK_M - 1)), no host synchronisation, so a CUDA graph captures it.
- `fused_moe_gemm`: C[pair] = A[row of pair] @ W[expert].T for every pair of the sorted blocks
  (optionally times the pair's routing weight), float32 accumulation, one rounding.
- `fused_experts`: both projections of SiLU-gated experts (w13 [E, 2I, H] = gate rows then up
  rows, w2 [E, H, I], the layout of splitserve.layers.moe.FusedMoE) with SiLU-and-mul between
  them and each token's k weighted outputs summed: [T, H].

float16, bfloat16 and float32 inputs; float32 products are exact float32 (no TF32), as the
torch code they replace is by default.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from splitserve.kernels import triton_ops

# Triton's CPU interpreter (the tests without a GPU) computes 16-bit dot products wrongly: there the
# tiles are widened to float32 first, which gives the same float32 sums of exact products.
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@dataclass(frozen=True)
class MoEConfig:
    """A launch's tile sizes (BLOCK_M is also the alignment's block of rows)."""

    block_m: int = 64
    block_n: int = 64
    block_k: int = 32
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 3


DECODE_CONFIG = MoEConfig(block_m=16, block_n=64, block_k=64, group_m=1, num_warps=4, num_stages=3)
PREFILL_CONFIG = MoEConfig(block_m=64, block_n=128, block_k=64, group_m=8, num_warps=8, num_stages=3)


def default_config(num_pairs: int, num_experts: int) -> MoEConfig:
    """Blocks of 16 rows while experts get few rows each (decode steps: less padding), else 64
    (not tuned per GPU yet: docs/moe.md)."""
    return DECODE_CONFIG if num_pairs <= 4 * num_experts else PREFILL_CONFIG


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int):
    """(sorted_ids, block_experts, padded_total, counts) for the pairs of `topk_ids` [T, k].

    sorted_ids [blocks * block_m] (int32): the pair indices (token * k + slot) grouped by expert, in
    pair order within an expert, each expert's run padded to a multiple of block_m with the
    sentinel T * k; entries past the padded total hold the sentinel too. block_experts [blocks]
    (int32): the expert of each block of block_m rows (-1 past the padded total). padded_total [1]
    (int32): rows in use. counts [E] (int64): pairs per expert. blocks = ceil((T * k + E *
    (block_m - 1)) / block_m), fixed by the shape, so nothing waits for the host."""
    flat = topk_ids.reshape(-1).long()
    pairs, device = flat.numel(), flat.device
    counts = torch.zeros(num_experts, dtype=torch.long, device=device).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_ends = padded.cumsum(0)
    starts, padded_starts = counts.cumsum(0) - counts, padded_ends - padded
    order = torch.argsort(flat, stable=True)
    experts_sorted = flat.index_select(0, order)
    rank = torch.arange(pairs, device=device) - starts.index_select(0, experts_sorted)
    blocks = triton.cdiv(pairs + num_experts * (block_m - 1), block_m)
    sorted_ids = torch.full((blocks * block_m,), pairs, dtype=torch.int32, device=device)
    sorted_ids.scatter_(0, padded_starts.index_select(0, experts_sorted) + rank, order.to(torch.int32))
    block_starts = torch.arange(blocks, device=device) * block_m
    block_experts = torch.searchsorted(padded_ends, block_starts, right=True)
    total = padded_ends[-1:]
    block_experts = torch.where(block_starts < total, block_experts, -1).to(torch.int32)
    return sorted_ids, block_experts, total.to(torch.int32), counts


@triton.jit
def _fused_moe_gemm_kernel(
    a_ptr,
    w_ptr,
    c_ptr,
    weights_ptr,
    sorted_ids_ptr,
    block_experts_ptr,
    total_ptr,
    N,
    K,
    num_pairs,
    num_blocks,
    stride_am,
    stride_ak,
    stride_we,
    stride_wn,
    stride_wk,
    stride_cm,
    ROWS_PER_A: tl.constexpr,
    MUL_WEIGHT: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    """A program per (block of BLOCK_M sorted rows, BLOCK_N output columns), in groups of GROUP_M
    row blocks per column block (the same weight tiles read while in cache). Row r of the block is
    pair p = sorted_ids[r]: it reads A's row p // ROWS_PER_A and stores C's row p; padding rows
    (p == num_pairs) are neither read nor stored, blocks past the padded total return at once."""
    pid = tl.program_id(0)
    blocks_n = tl.cdiv(N, BLOCK_N)
    in_group = GROUP_M * blocks_n
    first_m = (pid // in_group) * GROUP_M
    group_rows = tl.minimum(num_blocks - first_m, GROUP_M)
    pid_m = first_m + (pid % in_group) % group_rows
    pid_n = (pid % in_group) // group_rows
    if pid_m * BLOCK_M >= tl.load(total_ptr):
        return
    expert = tl.load(block_experts_ptr + pid_m).to(tl.int64)
    pairs = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    valid = pairs < num_pairs
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + (pairs // ROWS_PER_A)[:, None] * stride_am + offs_k[None, :] * stride_ak
    w_ptrs = w_ptr + expert * stride_we + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None] * stride_wk
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_in = offs_k < K - k0
        a = tl.load(a_ptrs, mask=valid[:, None] & k_in[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_in[:, None] & (offs_n[None, :] < N), other=0.0)
        if UPCAST:  # Triton's CPU interpreter multiplies 16-bit floats wrongly
            a, w = a.to(tl.float32), w.to(tl.float32)
        acc = tl.dot(a, w, acc, input_precision=PRECISION)
        a_ptrs += BLOCK_K * stride_ak
        w_ptrs += BLOCK_K * stride_wk
    if MUL_WEIGHT:
        acc = acc * tl.load(weights_ptr + pairs, mask=valid, other=0.0).to(tl.float32)[:, None]
    c_ptrs = c_ptr + pairs[:, None] * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=valid[:, None] & (offs_n[None, :] < N))


def fused_moe_gemm(
    a: torch.Tensor,
    w: torch.Tensor,
    out: torch.Tensor,
    alignment: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    top_k: int,
    config: MoEConfig,
    topk_weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """out[p] = a[p // top_k] @ w[expert of p].T (times topk_weights' entry p when given) for every
    pair p of `alignment` (moe_align's first three, made with config.block_m). a: [T, K] rows (or
    [T * k, K] with top_k=1), w: [E, N, K], out: [T * k, N] contiguous rows, written in place."""
    sorted_ids, block_experts, total = alignment
    num_pairs, (n, k) = out.shape[0], w.shape[1:]
    if a.shape[-1] != k or out.shape[1] != n or out.stride(1) != 1:
        raise ValueError(f"fused_moe_gemm: a {tuple(a.shape)}, w {tuple(w.shape)}, out {tuple(out.shape)} do not agree")
    blocks = block_experts.shape[0]
    grid = (blocks * triton.cdiv(n, config.block_n),)
    weights = topk_weights.reshape(-1) if topk_weights is not None else out
    _fused_moe_gemm_kernel[grid](
        a, w, out, weights, sorted_ids, block_experts, total, n, k, num_pairs, blocks,
        a.stride(0), a.stride(1), w.stride(0), w.stride(1), w.stride(2), out.stride(0),
        ROWS_PER_A=top_k, MUL_WEIGHT=topk_weights is not None,
        PRECISION="ieee" if a.dtype == torch.float32 or _INTERPRETED else "tf32", UPCAST=_INTERPRETED,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, GROUP_M=config.group_m,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )  # fmt: skip
    return out


def fused_experts(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    config: MoEConfig | None = None,
    expert_counts: torch.Tensor | None = None,
) -> torch.Tensor:
    """sum over each token's k experts of topk_weights * expert(x), expert(x) = w2 @ (silu(gate) *
    up), [gate; up] = w13 @ x: [T, H] in x's dtype. Each pair's weighted output is rounded once to
    x's dtype, then a token's k outputs are summed (as grouped_experts in splitserve.layers). The
    pairs per expert are added into `expert_counts` [E] when given (in place: a CUDA graph's replays
    count too)."""
    tokens, top_k = topk_ids.shape
    num_experts = w13.shape[0]
    config = config or default_config(tokens * top_k, num_experts)
    sorted_ids, block_experts, total, counts = moe_align(topk_ids, num_experts, config.block_m)
    if expert_counts is not None:
        expert_counts += counts
    alignment = (sorted_ids, block_experts, total)
    x = x.contiguous()
    gate_up = torch.empty(tokens * top_k, w13.shape[1], dtype=x.dtype, device=x.device)
    fused_moe_gemm(x, w13, gate_up, alignment, top_k, config)
    h = triton_ops.silu_and_mul(gate_up)
    down = torch.empty(tokens * top_k, w2.shape[1], dtype=x.dtype, device=x.device)
    fused_moe_gemm(h, w2, down, alignment, 1, config, topk_weights=topk_weights.contiguous())
    return down.view(tokens, top_k, -1).sum(1)
