"""What this CPU computes natively, read once from /proc/cpuinfo.

Two kinds of x86 machines matter: AVX-512 ones, some with bfloat16 dot products (avx512_bf16, or
AMX), and AVX2 + FMA ones, where bfloat16 matmuls are emulated (about four times slower than
float32). The kernels are compiled for the kind found (`isa()`), and `dtype="auto"` picks bfloat16
only where the CPU computes it natively (`native_bf16()`). Prompt attention multiplies through
oneDNN's block kernels where they pay (`brgemm_attention()`: AMX tiles for bfloat16, `amx_tiles()`).

SPLITSERVE_CPU_ISA=avx2 makes an AVX-512 machine behave as an AVX2 one: kernels compiled without
AVX-512 (a build of their own) and no native bfloat16. The kernel tests use it so that the AVX2
code is tested on every machine; it also lets one measure the AVX2 path where only AVX-512 exists.
"""

from __future__ import annotations

import functools
import platform

from splitserve import envs

ISA_ENV = "SPLITSERVE_CPU_ISA"
_BF16_FLAGS = ("avx512_bf16", "amx_bf16")


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The flags of the first processor in /proc/cpuinfo (empty where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def requested_isa() -> str:
    """ "native" or "avx2" (SPLITSERVE_CPU_ISA, checked by splitserve.envs)."""
    return envs.SPLITSERVE_CPU_ISA


def isa() -> str:
    """ "avx512", "avx2" or "generic": the widest vector code the kernels are built for here."""
    flags = cpu_flags()
    if platform.machine() not in ("x86_64", "AMD64"):
        return "generic"
    if requested_isa() == "native" and {"avx512f", "avx512bw", "avx512vl"} <= flags:
        return "avx512"
    return "avx2" if {"avx2", "fma"} <= flags else "generic"


def native_bf16() -> bool:
    """Whether bfloat16 matmuls run on bf16 hardware here (not emulated through float32)."""
    return isa() == "avx512" and any(flag in cpu_flags() for flag in _BF16_FLAGS)


def amx_tiles() -> bool:
    """Whether this process may run AMX tile instructions: the CPU lists them and Linux granted the
    process their state (torch asks for it with arch_prctl(ARCH_REQ_XCOMP_PERM); oneDNN asks too)."""
    if isa() != "avx512" or not {"amx_tile", "amx_bf16"} <= cpu_flags():
        return False
    import torch

    init = getattr(torch._C._cpu, "_init_amx", None)
    return bool(init()) if init is not None else True


def brgemm_attention() -> tuple[bool, bool, str]:
    """Which of prompt attention's products go through oneDNN's block kernels rather than its own
    vector loops: (float32, bfloat16, why, for the log). SPLITSERVE_CPU_ATTENTION_BRGEMM: auto
    (float32 everywhere: faster on AVX2 and AVX-512 alike; bfloat16 where the CPU has AMX, whose
    tiles oneDNN uses), 1 (bfloat16 wherever it is native, too), 0 (neither)."""
    setting = envs.SPLITSERVE_CPU_ATTENTION_BRGEMM
    if setting == "0":
        return False, False, "SPLITSERVE_CPU_ATTENTION_BRGEMM=0"
    if isa() == "generic":  # oneDNN's block kernels need AVX2 at least; torch's fallback is a plain GEMM
        return False, False, "no AVX2 on this CPU"
    if not native_bf16():
        return True, False, "no native bfloat16 on this CPU"
    if amx_tiles():
        return True, True, "bfloat16 on AMX tiles"
    if setting == "1":
        return True, True, "SPLITSERVE_CPU_ATTENTION_BRGEMM=1; no AMX here: bfloat16 in oneDNN's AVX512-BF16 code"
    why = "no AMX on this CPU" if "amx_bf16" not in cpu_flags() else "Linux did not grant AMX to this process"
    return True, False, f"bfloat16 in splitserve's AVX512-BF16 loops: {why}"


def describe() -> str:
    """The CPU's relevant flags in words, for logs and benchmark reports."""
    flags = cpu_flags()
    shown = [f for f in ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_int8") if f in flags]
    forced = f" ({ISA_ENV}=avx2: treated as AVX2)" if requested_isa() == "avx2" else ""
    return f"{platform.machine()} [{' '.join(shown) or 'no AVX2'}]{forced}"
