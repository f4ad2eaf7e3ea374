#!/usr/bin/env bash
# 4-bit quality side by side (issue 57, docs/quantization.md "Against llm-compressor and llama.cpp"):
# splitserve quantize, llm-compressor and llama.cpp's llama-quantize make 4-bit models from one
# bfloat16 base with the same calibration text; `splitserve bench quant --quality-only` then scores
# every model with the same perplexity windows on held-out prose and code, and llama.cpp's own
# `llama-perplexity` scores its GGUFs as a cross-check. Peers run in environments of their own, made
# here when missing; nothing is written into the repository.
#
#   scripts/quant_peers.sh [WORK_DIR]      # default /tmp/quant-peers; GROUP_SIZES="32 64" (the default model's width, 576, takes no group of 128)
#
# Needs: this project's venv (make setup), network for the peers' first install (pip: torch==2.13.0
# and llmcompressor in $LC_VENV; the llama-cpp-python sdist for scripts/build_llama_cpp.sh). About an
# hour on 2 cores, most of it quantizing; every step skips what its output already holds.
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
W="${1:-/tmp/quant-peers}"
PY="${PY:-$ROOT/.venv/bin/python}"
SPLITSERVE="${SPLITSERVE:-$ROOT/.venv/bin/splitserve}"
LC_VENV="${LC_VENV:-$W/lc-venv}"
LLAMA="${LLAMA_CPP:-$HOME/.cache/splitserve/llama.cpp}"
GROUP_SIZES="${GROUP_SIZES:-32 64}"
mkdir -p "$W"
cd "$W"
step() { echo "== $*"; }

step "base: the default model's GGUF dequantized to a bfloat16 Hugging Face directory ($W/base)"
if [ ! -f base/model.safetensors ]; then
    "$PY" - <<'PY'
import os
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from splitserve.loader.resolve import default_model_path
directory, name = os.path.split(default_model_path())
model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.bfloat16)
tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
model.hf_quantizer = None  # transformers marks GGUF-loaded models quantized; these weights are plain bf16
if hasattr(model.config, "quantization_config"):
    del model.config.quantization_config
model.save_pretrained("base")
tokenizer.save_pretrained("base")
PY
fi

step "texts: calibration (splitserve's built-in corpus) and two held-out texts (prose, code)"
"$PY" - <<'PY'
import inspect, collections
from transformers import AutoTokenizer
from splitserve.quantization.calibration import CALIBRATION_CORPUS, builtin_sequences
tokenizer = AutoTokenizer.from_pretrained("base")
with open("calib_ids.txt", "w") as f:  # what both splitserve and llm-compressor calibrate on
    for ids in builtin_sequences(tokenizer, len(tokenizer), 512, 128):
        f.write(" ".join(map(str, ids)) + "\n")
with open(CALIBRATION_CORPUS, encoding="utf-8") as src, open("calib.txt", "w", encoding="utf-8") as dst:
    dst.write(src.read())  # the same text for llama-imatrix
with open("/usr/share/common-licenses/GPL-3", encoding="utf-8") as f:
    open("gpl3.txt", "w", encoding="utf-8").write(f.read()[:12000])  # legal prose
with open(inspect.getsourcefile(collections), encoding="utf-8") as f:
    open("code.txt", "w", encoding="utf-8").write(f.read()[:12000])  # Python source (the stdlib's collections)
PY

step "splitserve quantize: AWQ and GPTQ (defaults) at group sizes $GROUP_SIZES"
for g in $GROUP_SIZES; do
    for m in awq gptq; do
        [ -f "ss-$m-g$g/model.safetensors" ] && continue
        "$SPLITSERVE" quantize -i base -o "ss-$m-g$g" --quant-type "$m" --group-size "$g" \
            --tokenids-path calib_ids.txt > "ss-$m-g$g.log" 2>&1
    done
done

step "llm-compressor: GPTQ W4A16 (symmetric, its preset) and asymmetric, AWQ W4A16_ASYM"
if [ ! -x "$LC_VENV/bin/python" ]; then
    python3 -m venv "$LC_VENV"
    "$LC_VENV/bin/pip" install -q torch==2.13.0  # the CPU build first: llmcompressor then keeps it
    "$LC_VENV/bin/pip" install -q llmcompressor==0.14.0.1 sentencepiece
fi
for g in $GROUP_SIZES; do
    for spec in "gptq-sym:gptq --sym" "gptq-asym:gptq" "awq-asym:awq"; do
        name="lc-${spec%%:*}-g$g"
        [ -f "$name/model.safetensors" ] && continue
        # shellcheck disable=SC2086  # the method and its flags are words
        "$LC_VENV/bin/python" "$ROOT/scripts/llmcompressor_quantize.py" base "$name" --method ${spec#*:} \
            --group-size "$g" --calib-ids calib_ids.txt > "$name.log" 2>&1
    done
done

step "llama.cpp: bf16 GGUF of the base, importance matrix on the calibration text, llama-quantize"
[ -x "$LLAMA/bin/llama-quantize" ] || TARGETS="llama-quantize llama-perplexity llama-imatrix" \
    "$ROOT/scripts/build_llama_cpp.sh" "$LLAMA"
CONVERT="$(ls "$LLAMA"/src/llama_cpp_python-*/vendor/llama.cpp/convert_hf_to_gguf.py | head -1)"
[ -f base-bf16.gguf ] || "$LC_VENV/bin/python" "$CONVERT" base --outtype bf16 --outfile base-bf16.gguf > convert.log 2>&1
[ -f imatrix.gguf ] || "$LLAMA/bin/llama-imatrix" -m base-bf16.gguf -f calib.txt -o imatrix.gguf -c 512 -t "$(nproc)" \
    > imatrix.log 2>&1
LLAMA_TYPES="Q4_0 Q4_1 Q4_K_M Q5_K_M"
for t in $LLAMA_TYPES; do
    # Embeddings and the (tied) output stay bf16, as splitserve's and llm-compressor's do.
    keep=(--token-embedding-type bf16 --output-tensor-type bf16)
    [ -f "llama-$t.gguf" ] || "$LLAMA/bin/llama-quantize" "${keep[@]}" base-bf16.gguf "llama-$t.gguf" "$t" \
        > "llama-$t.log" 2>&1
    [ -f "llama-$t-imat.gguf" ] || "$LLAMA/bin/llama-quantize" "${keep[@]}" --imatrix imatrix.gguf base-bf16.gguf \
        "llama-$t-imat.gguf" "$t" > "llama-$t-imat.log" 2>&1
done

step "perplexity of every model with splitserve's windows (1024 tokens, stride 512), one run"
variants=(bf16=base)
for g in $GROUP_SIZES; do
    variants+=("splitserve-awq-g$g=ss-awq-g$g" "splitserve-gptq-g$g=ss-gptq-g$g")
    variants+=("llmc-gptq-sym-g$g=lc-gptq-sym-g$g" "llmc-gptq-asym-g$g=lc-gptq-asym-g$g" "llmc-awq-g$g=lc-awq-asym-g$g")
done
for t in $LLAMA_TYPES; do variants+=("llama.cpp-$t=llama-$t.gguf" "llama.cpp-$t-imatrix=llama-$t-imat.gguf"); done
"$SPLITSERVE" bench quant --model base --dtype bfloat16 --max-model-len 1025 --max-length 1024 --quality-only \
    --text-file gpl3.txt code.txt --output-json quality.json --variants "${variants[@]}" 2> bench_quant.log | tee quality.md

step "llama-perplexity (llama.cpp's own windows: -c 1024, the second half of each scored) on its GGUFs"
for text in gpl3.txt code.txt; do
    for f in base-bf16.gguf $(for t in $LLAMA_TYPES; do echo "llama-$t.gguf llama-$t-imat.gguf"; done); do
        ppl=$("$LLAMA/bin/llama-perplexity" -m "$f" -f "$text" -c 1024 -b 1024 -t "$(nproc)" 2>&1 \
            | sed -n 's/.*Final estimate: PPL = \([0-9.]*\).*/\1/p')
        echo "| $text | $f | $ppl |"
    done
done | tee llama_perplexity.md
