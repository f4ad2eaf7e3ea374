"""vLLM's CPU backend on the workload of docs/cpu-performance.md: offline LLM.generate of 64 prompts
of 128 random token ids, 128 output tokens, ignore_eos, temperature 1. Run it with vLLM's own
interpreter (vLLM is not a dependency of splitserve):

    VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_KVCACHE_SPACE=4 /tmp/vllm-venv/bin/python \
        scripts/bench_vllm_offline.py /tmp/smol-hf [DTYPE]

DTYPE (default bfloat16) is passed to LLM(dtype=...): float32 is the faster one on CPUs without
native bf16 (AVX2-only hosts), bfloat16 where AVX512-BF16 or AMX compute it.
"""

import random
import sys
import time

from vllm import LLM, SamplingParams


def main():
    dtype = sys.argv[2] if len(sys.argv) > 2 else "bfloat16"
    llm = LLM(sys.argv[1], dtype=dtype, max_model_len=2048, seed=0)
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(100, 32000) for _ in range(128)]} for _ in range(64)]
    params = SamplingParams(temperature=1.0, max_tokens=128, ignore_eos=True)
    llm.generate(prompts[:1], SamplingParams(max_tokens=4), use_tqdm=False)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    print(f"vLLM CPU ({dtype}): {produced} tokens in {elapsed:.2f} s = {produced / elapsed:.1f} output tok/s")


if __name__ == "__main__":
    main()
