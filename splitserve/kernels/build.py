"""Building and loading splitserve's C++ CPU kernels (torch.ops.splitserve_cpu).

The sources (SOURCES, next to this file) are compiled with the installed torch the first time an
engine needs them (torch.utils.cpp_extension: about 30 s once per machine) and cached by torch under
~/.cache/torch_extensions; torch's ninja build recompiles a source whose text or included headers
changed. A note under splitserve's cache directory (envs.cache_root()/kernels, named after a digest
of every .cpp and .h here, the flags and torch) says which library those inputs built, so that later
starts load it directly, without torch's build machinery.

-march=native: the code runs on the machine that compiles it. SPLITSERVE_CPU_ISA=avx2 builds it
without AVX-512 (cpu_features.py) under a name of its own, so that both builds stay cached; the C++
side reads what the compiler targets once, in cpu_simd.h. -ffp-contract=off: no fused multiply-adds,
so that the element-wise kernels round exactly as the torch ops they replace, and GGUF
dequantization as the gguf package's numpy code. -fno-trapping-math: no floating-point exception is
trapped here, so the compiler may compute both sides of a select; without it GCC leaves the
`#pragma omp simd` loops around exp_approx scalar in the AVX2 build (it has no mask registers), which
made sampling 5-7x and decode attention 1.3x slower there. It changes no result (exp_approx gives the
same bits for all 2^32 inputs with and without it, in both builds).
"""

from __future__ import annotations

import hashlib
import logging
import os
import sys
import time

import torch

from splitserve import envs
from splitserve.kernels import cpu_features

logger = logging.getLogger(__name__)

# Every .cpp of the extension; the headers they include (cpu_ops.h, cpu_simd.h, gguf_formats.h,
# gguf_products_repacked.h, gguf_repack.h, shm_all_reduce.h) are found next to them.
SOURCES = (
    "ops_registry.cpp",
    "elementwise.cpp",
    "decode_attention.cpp",
    "prefill_attention.cpp",
    "sampling.cpp",
    "gguf_dequantize.cpp",
    "gguf_repack.cpp",
    "gguf_products.cpp",
    "moe_experts.cpp",
    "decode_stack.cpp",
    "shm_all_reduce.cpp",
)
_ISA_FLAGS = {"native": ["-march=native"], "avx2": ["-march=native", "-mno-avx512f"]}
_ISA_NAMES = {"avx512": "AVX-512", "avx2": "AVX2", "generic": "generic"}
_DIRECTORY = os.path.dirname(os.path.abspath(__file__))


def build():
    """Load (or build, then load) the kernels: torch.ops.splitserve_cpu, or None when they are
    turned off (SPLITSERVE_CPU_KERNELS=0) or could not be built (logged once, with the reason)."""
    if not envs.SPLITSERVE_CPU_KERNELS:
        logger.info("SPLITSERVE_CPU_KERNELS=0: the CPU runs the plain torch ops instead of splitserve's kernels.")
        return None
    requested = cpu_features.requested_isa()
    name = "splitserve_cpu_ops" if requested == "native" else "splitserve_cpu_ops_avx2"
    flags = ["-O3", *_ISA_FLAGS[requested], "-fopenmp", "-fno-math-errno", "-fno-trapping-math", "-ffp-contract=off"]
    start = time.perf_counter()
    stamp = stamp_path(name, flags)
    if not load_built(stamp):
        try:
            compile_library(name, flags, stamp)
        except Exception as exc:  # a missing compiler, or a torch without its headers
            logger.warning(
                "splitserve's CPU kernels could not be built (%s); the CPU runs the plain torch ops, which are slower.",
                str(exc).strip().splitlines()[-1] if str(exc).strip() else exc,
            )
            return None
    ops = torch.ops.splitserve_cpu
    float32, bfloat16, why = cpu_features.brgemm_attention()
    ops.set_prompt_attention_brgemm(float32, bfloat16)
    logger.info(
        "CPU kernels (%s code, %s) ready in %.1f s (built once per machine, then loaded from torch's cache); "
        "prompt attention multiplies through oneDNN's block kernels: float32 %s, bfloat16 %s (%s).",
        _ISA_NAMES[cpu_features.isa()],
        cpu_features.describe(),
        time.perf_counter() - start,
        "yes" if float32 else "no",
        "yes" if bfloat16 else "no",
        why,
    )
    return ops


def stamp_path(name: str, flags: list[str]) -> str:
    """Where the path of the library built from these sources, headers, flags and torch is noted."""
    digest = hashlib.sha256(f"{torch.__version__}\0{sys.version}\0{flags}".encode())
    for source in sorted(n for n in os.listdir(_DIRECTORY) if n.endswith((".cpp", ".h"))):
        with open(os.path.join(_DIRECTORY, source), "rb") as f:
            digest.update(source.encode() + b"\0" + f.read())
    return os.path.join(envs.cache_root(), "kernels", f"{name}-{digest.hexdigest()[:16]}")


def load_built(stamp: str) -> bool:
    """Load the library a previous start built from the same inputs, without torch's build
    machinery (importing torch.utils.cpp_extension alone takes 0.2 s: it imports setuptools)."""
    try:
        with open(stamp, encoding="utf-8") as f:
            library, noted = f.read().split("\n")[:2]
        if identity(library) != noted:  # rebuilt since (from other sources): let torch decide
            return False
    except (OSError, ValueError):
        return False
    torch.ops.load_library(library)
    return True


def identity(library: str) -> str:
    st = os.stat(library)
    return f"{st.st_size} {st.st_mtime_ns}"


def compile_library(name: str, flags: list[str], stamp: str) -> None:
    """Build (or find in torch's cache) the extension and note the library's path at `stamp`."""
    from torch.utils.cpp_extension import _get_build_directory, load

    load(
        name=name,
        sources=[os.path.join(_DIRECTORY, n) for n in SOURCES],
        is_python_module=False,
        verbose=False,
        extra_cflags=flags,
        extra_ldflags=["-fopenmp"],
    )
    built = [
        entry.path
        for entry in os.scandir(_get_build_directory(name, verbose=False))
        if entry.name.startswith(name) and entry.name.endswith(".so")
    ]
    if not built:
        return
    library = max(built, key=os.path.getmtime)  # torch names a rebuild name_v1.so, name_v2.so, ...
    try:
        os.makedirs(os.path.dirname(stamp), exist_ok=True)
        with open(stamp + ".tmp", "w", encoding="utf-8") as f:
            f.write(f"{library}\n{identity(library)}\n")
        os.replace(stamp + ".tmp", stamp)
    except OSError as exc:
        logger.info("Could not note where the CPU kernels were built (%s); torch finds them at each start.", exc)
