"""Time one layer's prompt attention (splitserve's CPU kernel) on SmolLM2's heads (9 query, 3 KV,
64 dims): its products in splitserve's own vector loops against oneDNN's block kernels (AMX tiles
on a CPU with AMX), the two alternated twice in one process, and how far apart their outputs are.

    .venv/bin/python scripts/bench_prompt_attention.py [--prompts 16] [--prompt-len 128]
        [--context 0] [--dtype bfloat16]

Prints the best mean of 5 runs of 5 calls for each path and round (bench_cpu_kernels.best_of).
With SPLITSERVE_CPU_ISA=avx2 it times the AVX2 build (add ONEDNN_MAX_CPU_ISA=AVX2 for oneDNN's
AVX2 kernels, as on an AVX2 host).
"""

from __future__ import annotations

import argparse

import torch
from bench_cpu_kernels import best_of  # scripts/, next to this one

from splitserve import kernels
from splitserve.kernels import cpu_features

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=16, help="prompts in the step")
    parser.add_argument("--prompt-len", type=int, default=128, help="new tokens of each prompt")
    parser.add_argument("--context", type=int, default=0, help="tokens each prompt has cached before them")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32", "float16"))
    args = parser.parse_args()
    if kernels.cpu_ops() is None:
        raise SystemExit("splitserve's CPU kernels are not available (see the log above).")
    dtype, P, L = getattr(torch, args.dtype), args.prompts, args.prompt_len
    torch.manual_seed(0)
    blocks = -(-(L + args.context) // BLOCK)
    cache = torch.randn(2, KV_HEADS, P * blocks, BLOCK, HEAD_DIM).to(dtype)
    tables = torch.arange(P * blocks, dtype=torch.int32).view(P, blocks)
    seq_lens = torch.full((P,), L + args.context, dtype=torch.int32)
    starts = torch.arange(P + 1, dtype=torch.int64) * L
    q = torch.randn(P * L, HEADS, HEAD_DIM).to(dtype)
    outs, times = {}, {}
    old = kernels.set_prompt_attention_brgemm(False, False)
    try:
        for path in ("own loops", "oneDNN block kernels") * 2:
            on = path != "own loops"
            kernels.set_prompt_attention_brgemm(on, on)
            out = torch.empty_like(q)

            def call(out=out):
                kernels.prefill_attention(out, q, cache, tables, seq_lens, starts, 0, HEAD_DIM**-0.5, None)

            times.setdefault(path, []).append(best_of(call, 5) * 1e3)
            outs[path] = out.float()
    finally:
        kernels.set_prompt_attention_brgemm(*old)
    print(f"CPU {cpu_features.describe()}; {P} prompts x {L} tokens after {args.context} cached, {args.dtype}")
    for path, ms in times.items():
        print(f"  {path:22s} " + " / ".join(f"{t:.2f} ms" for t in ms))
    diff = (outs["own loops"] - outs["oneDNN block kernels"]).abs().max().item()
    print(f"  largest difference between the two outputs: {diff:.2e}")


if __name__ == "__main__":
    main()
