"""The device and dtype an engine runs with: `--device auto|cpu|cuda` and `--dtype auto|...` resolved
against the machine (and, for a CPU, its bfloat16 support), and the CPU KV cache's size."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from splitserve import envs

if TYPE_CHECKING:  # torch is imported where it is used (a server parses its flags before torch loads)
    import torch

logger = logging.getLogger(__name__)

_STR_TO_DTYPE = {  # --dtype spellings -> torch dtype names
    "float32": "float32",
    "float": "float32",
    "fp32": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "half": "float16",
    "fp16": "float16",
}


def resolve_device(device: str) -> torch.device:
    import torch

    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' was asked for but no CUDA device is available.")
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {device!r}.")
    return dev


def resolve_dtype(dtype: str | torch.dtype, config_dtype: torch.dtype | None, device: torch.device) -> torch.dtype:
    """'auto' takes the checkpoint's dtype (bfloat16 when it names none), except that on a CPU
    half-precision weights run in bfloat16 only where the CPU computes bfloat16 natively
    (AVX512-BF16 or AMX), else in float32: emulated bfloat16 matmuls are about four times slower
    than float32 ones. float16 is not a CPU dtype (vLLM's CPU backend also takes bfloat16)."""
    import torch

    if isinstance(dtype, torch.dtype):
        chosen = dtype
    elif dtype == "auto":
        chosen = config_dtype if config_dtype in (torch.float16, torch.bfloat16, torch.float32) else torch.bfloat16
        if device.type == "cpu" and chosen != torch.float32:
            chosen = _cpu_auto_dtype()
    elif dtype in _STR_TO_DTYPE:
        chosen = getattr(torch, _STR_TO_DTYPE[dtype])
    else:
        raise ValueError(f"dtype must be 'auto' or one of {sorted(_STR_TO_DTYPE)}, got {dtype!r}.")
    if device.type == "cpu" and chosen == torch.float16:
        raise ValueError("float16 is not supported on CPU: use bfloat16 or float32.")
    return chosen


def _cpu_auto_dtype() -> torch.dtype:
    import torch

    from splitserve.kernels import cpu_features

    if cpu_features.native_bf16():
        logger.info("dtype auto: bfloat16, which this CPU computes natively (%s).", cpu_features.describe())
        return torch.bfloat16
    logger.info(
        "dtype auto: float32, as this CPU has no bfloat16 arithmetic (%s) and would emulate it about four "
        "times more slowly; --dtype bfloat16 halves the memory of weights and KV cache instead.",
        cpu_features.describe(),
    )
    return torch.float32


def cpu_kv_cache_bytes() -> int:
    gib = envs.SPLITSERVE_CPU_KVCACHE_SPACE
    return int(gib * (1 << 30))
