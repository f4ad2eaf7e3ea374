"""Time splitserve's CPU kernels on the shapes of one offline decode step of the default model
(SmolLM2-135M: 9 query heads, 3 KV heads of 64 dims, hidden 576, MLP 1536, 30 layers): paged
decode attention over a cache laid out as an engine hands blocks out (each prompt's blocks in
order, decode blocks round robin), the KV write, RMSNorm and SiLU-and-mul, at --batch rows.

    .venv/bin/python scripts/bench_cpu_kernels.py [--batch 64] [--context 192] [--dtype bfloat16]

Prints the best of five runs of each; with SPLITSERVE_CPU_ISA=avx2 it times the AVX2 build. Large
tensors use transparent huge pages, as in an engine (cpu_memory.py).
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

import torch  # noqa: E402

from splitserve.kernels.build import build  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, HIDDEN, INTERMEDIATE, LAYERS, BLOCK = 9, 3, 64, 576, 1536, 30, 16


def best_of(fn, reps: int) -> float:
    """The best mean time of fn over five runs of `reps` calls, after three warm-up calls."""
    for _ in range(3):
        fn()
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(reps):
            fn()
        best = min(best, (time.perf_counter() - start) / reps)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=64, help="decode rows (requests) per step")
    parser.add_argument("--context", type=int, default=192, help="tokens in each request's KV cache")
    parser.add_argument("--prompt-blocks", type=int, default=8, help="blocks of each request allocated in order")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32", "float16"))
    args = parser.parse_args()
    ops = build()
    if ops is None:
        raise SystemExit("splitserve's CPU kernels are not available (see the log above).")
    dtype, B = getattr(torch, args.dtype), args.batch
    torch.manual_seed(0)

    blocks = -(-args.context // BLOCK)
    ordered = min(args.prompt_blocks, blocks)
    table = torch.empty(B, blocks, dtype=torch.int32)
    table[:, :ordered] = torch.arange(B * ordered, dtype=torch.int32).view(B, ordered)
    table[:, ordered:] = B * ordered + torch.arange(B * (blocks - ordered), dtype=torch.int32).view(-1, B).t()
    caches = [torch.randn(2, KV_HEADS, B * blocks, BLOCK, HEAD_DIM).to(dtype) for _ in range(LAYERS)]
    seq_lens = torch.full((B,), args.context, dtype=torch.int32)
    q = torch.randn(B, HEADS, HEAD_DIM).to(dtype)
    out = torch.empty_like(q)

    def attention() -> None:
        for cache in caches:
            ops.decode_attention(out, q, cache, table, seq_lens, B, HEAD_DIM**-0.5, 0)

    seconds = best_of(attention, 5)
    read = LAYERS * B * KV_HEADS * args.context * HEAD_DIM * 2 * q.element_size()
    print(
        f"decode attention, {LAYERS} layers x {B} requests x {args.context} tokens ({args.dtype}): "
        f"{seconds * 1e3:.2f} ms per step, {read / seconds / 1e9:.1f} GB/s of KV cache read"
    )

    k, v = torch.randn(B, KV_HEADS, HEAD_DIM).to(dtype), torch.randn(B, KV_HEADS, HEAD_DIM).to(dtype)
    slots = (table[:, -1].long() * BLOCK + (args.context - 1) % BLOCK).contiguous()

    def write() -> None:
        for cache in caches:
            ops.write_kv(cache, k, v, slots)

    print(f"KV write, {LAYERS} layers x {B} tokens: {best_of(write, 20) * 1e6:.1f} us per step")

    x, residual = torch.randn(B, HIDDEN).to(dtype), torch.randn(B, HIDDEN).to(dtype)
    weight = torch.randn(HIDDEN).to(dtype)
    seconds = best_of(lambda: ops.add_rms_norm(x, residual, weight, 1e-5), 500)
    print(f"add + RMSNorm, {B} x {HIDDEN}: {seconds * 1e6:.1f} us per call")
    gate_up = torch.randn(B, 2 * INTERMEDIATE).to(dtype)
    seconds = best_of(lambda: ops.silu_and_mul(gate_up), 500)
    print(f"SiLU and mul, {B} x {INTERMEDIATE}: {seconds * 1e6:.1f} us per call")


if __name__ == "__main__":
    main()
