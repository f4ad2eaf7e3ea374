#!/usr/bin/env bash
# Build llama.cpp's `llama-server` and `llama-bench`, the peers of docs' CPU comparison, from the
# llama.cpp sources inside the PyPI sdist of llama-cpp-python. Everything lives in a cache
# directory outside the repository (nothing here is ever committed):
#
#   scripts/build_llama_cpp.sh [CACHE_DIR]          # default: ~/.cache/splitserve/llama.cpp
#   TARGETS="llama-lookup llama-speculative-simple" scripts/build_llama_cpp.sh   # speculative decoding's peers
#   $CACHE_DIR/bin/llama-server -m model.gguf -t 2 -np 64 -c 32768 --port 8080
#   $CACHE_DIR/bin/llama-bench -m model.gguf -t 2 -p 0 -n 128      # tg128, single stream
#
# A portable build (GGML_NATIVE=OFF) for the instruction sets this CPU has: AVX2 and FMA always,
# AVX-512 (and its VNNI and BF16 extensions) only where /proc/cpuinfo lists them, so that the
# binaries run on the AVX2-only hosts of this project's kind too; about 15 minutes on 2 cores. LLAMA_CPP_PYTHON_VERSION picks the sdist (default below).
set -euo pipefail

VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
CACHE="${1:-${HOME}/.cache/splitserve/llama.cpp}"
PYTHON="${PYTHON:-python3}"
JOBS="${JOBS:-$(nproc)}"
TARGETS="${TARGETS:-llama-server llama-bench}"

mkdir -p "$CACHE/src" "$CACHE/bin"
cd "$CACHE/src"
if [ ! -d "llama_cpp_python-$VERSION" ]; then
    echo "Downloading the llama-cpp-python $VERSION sdist into $CACHE/src"
    # The sdist's link from PyPI's simple index: `pip download` would also prepare its build metadata.
    "$PYTHON" - "$VERSION" <<'PY'
import re, sys, urllib.request
name = f"llama_cpp_python-{sys.argv[1]}.tar.gz"
with urllib.request.urlopen("https://pypi.org/simple/llama-cpp-python/") as response:
    page = response.read().decode()
url = re.search(r'href="([^"]*/' + re.escape(name) + r')[#"]', page).group(1)
urllib.request.urlretrieve(url, name)
print("downloaded", name)
PY
    tar xzf "llama_cpp_python-$VERSION.tar.gz"
fi
SRC="$CACHE/src/llama_cpp_python-$VERSION/vendor/llama.cpp"
[ -f "$SRC/CMakeLists.txt" ] || { echo "no llama.cpp sources at $SRC" >&2; exit 1; }

has_flag() { grep -qw "$1" /proc/cpuinfo && echo ON || echo OFF; }
AVX512="$(has_flag avx512f)" VNNI="$(has_flag avx512_vnni)" BF16="$(has_flag avx512_bf16)"
[ "$AVX512" = ON ] || VNNI=OFF BF16=OFF
# A build for another instruction set (a cache copied between hosts) is configured afresh.
BUILD="$CACHE/build-avx512-$AVX512-vnni-$VNNI-bf16-$BF16"
echo "Configuring llama.cpp ($SRC): AVX-512 $AVX512, AVX-512 VNNI $VNNI, AVX-512 BF16 $BF16"
cmake -S "$SRC" -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF \
    -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512="$AVX512" \
    -DGGML_AVX512_VNNI="$VNNI" -DGGML_AVX512_BF16="$BF16" \
    -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=ON -DLLAMA_BUILD_SERVER=ON
echo "Building $TARGETS with $JOBS jobs"
# shellcheck disable=SC2086  # TARGETS is a list of words
cmake --build "$BUILD" -j "$JOBS" --target $TARGETS
for target in $TARGETS; do cp "$BUILD/bin/$target" "$CACHE/bin/"; done
echo "Done: $TARGETS in $CACHE/bin"
