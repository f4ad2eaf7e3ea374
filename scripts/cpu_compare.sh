#!/usr/bin/env bash
# The CPU comparison of docs/cpu-performance.md on the host it runs on, in one command: the host's
# CPU flags and topology, then each engine one after the other (never two at once), alternated
# ROUNDS times so that a drift of the host shows:
#   - single stream: llama.cpp's `llama-bench -t THREADS -p 0 -n 128` (built natively for this host
#     by scripts/build_llama_cpp.sh if missing) against `splitserve bench latency --batch-size 1
#     --input-len 128 --output-len 128` (decode tok/s after the prompt's step), both on the
#     default model's Q4_1 GGUF;
#   - offline, 64 prompts x 128 in / 128 out: `splitserve bench throughput --backend splitserve hf`
#     (transformers as the baseline of the same run) and, with VLLM_PYTHON set, vLLM's CPU backend
#     (scripts/bench_vllm_offline.py), on a dense Hugging Face copy of the default model, each in
#     the dtype `--dtype auto` picks for this CPU (bfloat16 with AVX512-BF16 or AMX, else float32);
#   - the breakdown of splitserve's offline run (`bench throughput --profile`).
#
#   scripts/cpu_compare.sh                                   # everything but vLLM
#   VLLM_PYTHON=/tmp/vllm-venv/bin/python scripts/cpu_compare.sh
#
# Settings (environment): ROUNDS (default 2), THREADS (default: the CPUs this process may use),
# DENSE_DIR (the dense copy; default ~/.cache/splitserve/smollm2-dense-DTYPE, written once),
# PYTHON (splitserve's interpreter; default .venv/bin/python), OUT (default /tmp/cpu_compare:
# every command's full output, and the profile).
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON="${PYTHON:-.venv/bin/python}"
ROUNDS="${ROUNDS:-2}"
THREADS="${THREADS:-$("$PYTHON" -c 'import os; print(len(os.sched_getaffinity(0)))')}"
OUT="${OUT:-/tmp/cpu_compare}"
LLAMA_BENCH="${LLAMA_CPP_DIR:-$HOME/.cache/splitserve/llama.cpp}/bin/llama-bench"
mkdir -p "$OUT"

echo "== host"
grep -m1 'model name' /proc/cpuinfo
echo "flags: $(grep -m1 -w flags /proc/cpuinfo | tr ' ' '\n' |
    grep -x -E 'avx2|fma|avx512f|avx512_vnni|avx512_bf16|amx_tile|amx_bf16|amx_int8' | tr '\n' ' ')"
lscpu | grep -E '^(Thread\(s\) per core|Core\(s\) per socket|Socket\(s\)):' || true
echo "threads: $THREADS; splitserve's kernels: $("$PYTHON" -c 'from splitserve.kernels import cpu_features as c; print(c.describe())')"
echo "oneDNN, a bfloat16 product of 64 rows: $(ONEDNN_VERBOSE=1 "$PYTHON" -c 'import torch
torch.nn.functional.linear(torch.randn(64, 576).bfloat16(), torch.randn(1728, 576).bfloat16())' 2>&1 |
    grep -o -E 'isa:[^,]*|brg[^,]*' | tr '\n' ' ')"
DTYPE="$("$PYTHON" -c 'from splitserve.kernels import cpu_features as c; print("bfloat16" if c.native_bf16() else "float32")')"
GGUF="$("$PYTHON" -c 'from splitserve.loader.resolve import default_model_path; print(default_model_path())')"
DENSE_DIR="${DENSE_DIR:-$HOME/.cache/splitserve/smollm2-dense-$DTYPE}"
echo "dtype for this CPU: $DTYPE; GGUF: $GGUF; dense copy: $DENSE_DIR"

[ -x "$LLAMA_BENCH" ] || scripts/build_llama_cpp.sh
if [ ! -f "$DENSE_DIR/config.json" ]; then
    echo "Writing the dense $DTYPE copy of the default model to $DENSE_DIR"
    "$PYTHON" - "$GGUF" "$DENSE_DIR" "$DTYPE" 2>"$OUT/dense-copy.txt" <<'PY'
import os, sys, torch
from splitserve.loader.hf_model import load_hf_model
from splitserve.tokenizer import get_tokenizer
gguf, out, dtype = sys.argv[1:]
load_hf_model(os.path.dirname(gguf), os.path.basename(gguf), getattr(torch, dtype)).save_pretrained(out)
get_tokenizer(gguf).save_pretrained(out)
PY
fi

for round in $(seq "$ROUNDS"); do
    echo "== round $round: single stream"
    "$LLAMA_BENCH" -m "$GGUF" -t "$THREADS" -p 0 -n 128 -r 3 >"$OUT/llama-bench-$round.txt" 2>&1
    echo "llama.cpp tg128: $(grep tg128 "$OUT/llama-bench-$round.txt" | awk -F'|' '{print $(NF-1)}') tok/s"
    OMP_NUM_THREADS="$THREADS" "$PYTHON" -m splitserve.entrypoints.cli bench latency --batch-size 1 \
        --input-len 128 --output-len 128 --num-iters 5 --num-iters-warmup 2 >"$OUT/latency-$round.txt" 2>&1
    echo "splitserve $(grep '^Decode:' "$OUT/latency-$round.txt")"

    echo "== round $round: offline 64 x 128/128"
    if [ -n "${VLLM_PYTHON:-}" ]; then
        VLLM_CPU_OMP_THREADS_BIND="0-$((THREADS - 1))" VLLM_CPU_KVCACHE_SPACE=4 "$VLLM_PYTHON" \
            scripts/bench_vllm_offline.py "$DENSE_DIR" "$DTYPE" >"$OUT/vllm-$round.txt" 2>&1
        grep '^vLLM CPU' "$OUT/vllm-$round.txt"
    fi
    OMP_NUM_THREADS="$THREADS" "$PYTHON" -m splitserve.entrypoints.cli bench throughput --model "$DENSE_DIR" \
        --dtype "$DTYPE" --backend splitserve hf --num-prompts 64 --input-len 128 --output-len 128 \
        >"$OUT/throughput-$round.txt" 2>&1
    grep -E '^(backend|splitserve|hf) ' "$OUT/throughput-$round.txt"
done

echo "== the breakdown of splitserve's offline run (under torch.profiler: slower, not a speed figure)"
OMP_NUM_THREADS="$THREADS" "$PYTHON" -m splitserve.entrypoints.cli bench throughput --model "$DENSE_DIR" \
    --dtype "$DTYPE" --num-prompts 64 --input-len 128 --output-len 128 --profile "$OUT/profile" \
    >"$OUT/profile.txt" 2>&1
awk '/^Profiled run/{on=1} on && /^-----/{exit} on' "$OUT/profile.txt"
echo "Full outputs in $OUT"
