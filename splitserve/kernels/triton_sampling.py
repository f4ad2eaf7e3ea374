"""Temperature (and greedy) sampling of a step's logits on CUDA in one Triton launch.

The torch sampler's plain path (temperature only, no top-k/top-p/min-p, penalties or logprobs) is
some fifteen small launches per step: the float32 copy, argmax, the temperature's division,
softmax, the uniform draw's use, cumsum, searchsorted, the chosen token's logprob (gather,
logsumexp). On the H200 check (docs/gpu.md) that phase took 0.78 ms of host time per step for one
request, more than the GPU's whole decode step. This kernel does the same work in one launch, one
program per row, the same way as the CPU kernel (splitserve/kernels/sampling.cpp):

1. one pass over the row: its maximum m and the maximum's first position (the greedy token), the
   sum of exp(l - m) (for the raw logits' log-softmax) and of exp((l - m) / T), kept online across
   blocks;
2. for a sampling row (T >= 1e-5), a second pass: the first token whose cumulative weight
   exp((l - m) / T) exceeds u * total, as softmax + cumsum + searchsorted(right=True) choose it;
   if rounding leaves none (u * total at the very top), the greedy token;
3. the chosen token's logprob under softmax(l), the raw logits (what vLLM reports).

The logits are read in their own dtype and computed in float32. No host synchronisation: the
launch can be queued behind the forward (overlap scheduling) or captured.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

GREEDY_TEMPERATURE = 1e-5  # as splitserve.executor.sampler
MAX_BLOCK = 8192  # logits per loop iteration of a program


@triton.jit
def _sample_kernel(
    logits_ptr,
    stride_row,
    temperature_ptr,
    u_ptr,
    tokens_ptr,
    logprobs_ptr,
    V,
    GREEDY_BELOW: tl.constexpr,  # a row whose temperature is below this is greedy
    ALL_GREEDY: tl.constexpr,  # every row is: no second pass, u not read
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    base = logits_ptr + row.to(tl.int64) * stride_row
    temperature = tl.load(temperature_ptr + row)
    greedy = temperature < GREEDY_BELOW
    inv_t = 1.0 / tl.where(greedy, 1.0, temperature)
    offs = tl.arange(0, BLOCK)
    m = -float("inf")
    best = 0
    raw_sum = 0.0
    scaled_sum = 0.0
    for start in range(0, V, BLOCK):
        mask = start + offs < V
        x = tl.load(base + start + offs, mask=mask, other=-float("inf")).to(tl.float32)
        block_max = tl.max(x, axis=0)
        block_best = tl.argmax(x, axis=0) + start
        new_m = tl.maximum(m, block_max)
        raw_sum = raw_sum * tl.exp(m - new_m) + tl.sum(tl.exp(x - new_m), axis=0)
        scaled_sum = scaled_sum * tl.exp((m - new_m) * inv_t) + tl.sum(tl.exp((x - new_m) * inv_t), axis=0)
        best = tl.where(block_max > m, block_best, best)
        m = new_m
    token = best
    if not ALL_GREEDY:
        if not greedy:
            threshold = tl.load(u_ptr + row) * scaled_sum
            running = 0.0
            first = V
            for start in range(0, V, BLOCK):
                idx = start + offs
                mask = idx < V
                x = tl.load(base + idx, mask=mask, other=-float("inf")).to(tl.float32)
                w = tl.where(mask, tl.exp((x - m) * inv_t), 0.0)
                cumulative = tl.cumsum(w, axis=0) + running
                first = tl.minimum(first, tl.min(tl.where(mask & (cumulative > threshold), idx, V), axis=0))
                running += tl.sum(w, axis=0)
            token = tl.where(first < V, first, best)
    chosen = tl.load(base + token).to(tl.float32)
    tl.store(tokens_ptr + row, token.to(tl.int64))
    tl.store(logprobs_ptr + row, chosen - m - tl.log(raw_sum))


def sample(
    logits: torch.Tensor, temperature: torch.Tensor, u: torch.Tensor | None, all_greedy: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """[R] int64 tokens and [R] float32 logprobs of logits [R, V] (unit stride along V), as
    splitserve.kernels.sample. `u` (one uniform per row) is not read when `all_greedy`."""
    rows, vocab = logits.shape
    tokens = torch.empty(rows, dtype=torch.int64, device=logits.device)
    logprobs = torch.empty(rows, dtype=torch.float32, device=logits.device)
    if rows == 0:
        return tokens, logprobs
    temperature = temperature.to(torch.float32).contiguous()
    u = temperature if u is None else u.to(torch.float32).contiguous()
    block = min(MAX_BLOCK, triton.next_power_of_2(vocab))
    _sample_kernel[(rows,)](
        logits,
        logits.stride(0),
        temperature,
        u,
        tokens,
        logprobs,
        vocab,
        GREEDY_BELOW=GREEDY_TEMPERATURE,
        ALL_GREEDY=all_greedy,
        BLOCK=block,
        num_warps=max(1, min(16, block // 512)),
    )
    return tokens, logprobs
