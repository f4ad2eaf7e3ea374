"""vLLM's CPU backend on an offline workload: LLM.generate of N prompts of random token ids,
ignore_eos. Defaults: the workload of docs/cpu-performance.md (64 prompts of 128 tokens, 128 output
tokens, temperature 1); issue 53's host-time comparison is 256 x 128/256 greedy (docs/gpu.md). Run
it with vLLM's own interpreter (vLLM is not a dependency of splitserve):

    VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_KVCACHE_SPACE=4 /tmp/vllm-venv/bin/python \\
        scripts/bench_vllm_offline.py /tmp/smol-hf [--dtype bfloat16] [--num-prompts 64] \\
        [--input-len 128] [--output-len 128] [--temperature 1.0]

--dtype (default bfloat16) is passed to LLM(dtype=...): float32 is the faster one on CPUs without
native bf16 (AVX2-only hosts), bfloat16 where AVX512-BF16 or AMX compute it. The splitserve side is
`splitserve bench throughput` with the same numbers.
"""

import argparse
import random
import time

from vllm import LLM, SamplingParams


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("legacy_dtype", nargs="?", help="the dtype, as the script's older second argument")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    ns = parser.parse_args()
    dtype = ns.legacy_dtype or ns.dtype
    llm = LLM(ns.model, dtype=dtype, max_model_len=2048, seed=0, max_num_seqs=ns.max_num_seqs)
    rng = random.Random(0)
    prompts = [
        {"prompt_token_ids": [rng.randrange(100, 32000) for _ in range(ns.input_len)]} for _ in range(ns.num_prompts)
    ]
    params = SamplingParams(temperature=ns.temperature, max_tokens=ns.output_len, ignore_eos=True)
    llm.generate(prompts[:1], SamplingParams(max_tokens=4), use_tqdm=False)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    print(f"vLLM CPU ({dtype}): {produced} tokens in {elapsed:.2f} s = {produced / elapsed:.1f} output tok/s")


if __name__ == "__main__":
    main()
