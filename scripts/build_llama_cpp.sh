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
# By default a native build (GGML_NATIVE=ON: -march=native), the peer to compare against on the host
# that builds it: on a CPU with AMX it brings llama.cpp's AMX int8 kernels for the 4-bit types,
# which a portable build leaves out. PORTABLE=1 builds for the instruction sets /proc/cpuinfo lists
# instead (AVX2 and FMA always; AVX-512 and its VNNI and BF16 extensions where listed), binaries
# that also run on this project's AVX2-only hosts. Each build has a directory of its own, named by
# the kind and the CPU's flags, so a cache copied to another host is configured afresh. About 15
# minutes on 2 cores. LLAMA_CPP_PYTHON_VERSION picks the sdist (default below).
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
if [ "${PORTABLE:-0}" = 1 ]; then
    BUILD="$CACHE/build-avx512-$AVX512-vnni-$VNNI-bf16-$BF16"
    ISA_FLAGS=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON
               -DGGML_AVX512="$AVX512" -DGGML_AVX512_VNNI="$VNNI" -DGGML_AVX512_BF16="$BF16")
    echo "Configuring a portable llama.cpp ($SRC): AVX-512 $AVX512, AVX-512 VNNI $VNNI, AVX-512 BF16 $BF16"
else
    FLAGS_KEY="$(grep -m1 -w flags /proc/cpuinfo | md5sum | cut -c1-12)"
    BUILD="$CACHE/build-native-$FLAGS_KEY"
    ISA_FLAGS=(-DGGML_NATIVE=ON)
    echo "Configuring a native llama.cpp ($SRC) for this CPU: AVX-512 $AVX512, AVX-512 VNNI $VNNI," \
        "AVX-512 BF16 $BF16, AMX int8 $(has_flag amx_int8), AMX bf16 $(has_flag amx_bf16)"
fi
cmake -S "$SRC" -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF "${ISA_FLAGS[@]}" \
    -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=ON -DLLAMA_BUILD_SERVER=ON
echo "Building $TARGETS with $JOBS jobs"
# shellcheck disable=SC2086  # TARGETS is a list of words
cmake --build "$BUILD" -j "$JOBS" --target $TARGETS
for target in $TARGETS; do cp "$BUILD/bin/$target" "$CACHE/bin/"; done
echo "Done: $TARGETS in $CACHE/bin"
