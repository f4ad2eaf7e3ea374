"""Choosing the attention backend for a device and KV-cache dtype (the implementations import the
interface in backend.py, so the choice lives apart from it)."""

from __future__ import annotations

import logging
import os

import torch

from splitserve import envs
from splitserve.executor.attention.backend import BACKENDS, AttentionBackend

logger = logging.getLogger(__name__)
_ENV = "SPLITSERVE_ATTENTION_BACKEND"


def get_attention_backend(device: torch.device, kv_cache_dtype: str = "auto") -> AttentionBackend:
    """The backend for a device and --kv-cache-dtype. $SPLITSERVE_ATTENTION_BACKEND (torch | cpu |
    triton) decides when set; otherwise CUDA devices get triton where it can run (else torch) and
    CPUs get cpu (the torch reference with splitserve's C++ paged-cache kernels).
    Forcing cpu on another device is a ValueError, and so is forcing triton where it cannot run
    (no CUDA device and no TRITON_INTERPRET=1, an int4 cache, an fp8_e4m3 cache before compute
    capability 8.9, triton not installed)."""
    device = torch.device(device)
    forced = (envs.SPLITSERVE_ATTENTION_BACKEND or "").lower()
    if forced and forced not in BACKENDS:
        raise ValueError(f"{_ENV} must be one of {BACKENDS}, got {forced!r}.")
    if forced == "triton" or (not forced and device.type == "cuda"):
        reason = _why_not_triton(device, kv_cache_dtype)
        if reason is None:
            from splitserve.executor.attention.triton_attn import TritonAttentionBackend

            return TritonAttentionBackend()
        if forced:
            raise ValueError(f"{_ENV}=triton: {reason}.")
        logger.info("Attention backend: torch, not triton: %s.", reason)
    if forced == "cpu" or (not forced and device.type == "cpu"):
        if device.type != "cpu":
            raise ValueError(f"{_ENV}=cpu: its kernels run on the CPU, not on {device.type}.")
        from splitserve.executor.attention.cpu_backend import CPUAttentionBackend

        return CPUAttentionBackend()
    from splitserve.executor.attention.torch_ref import TorchAttentionBackend

    return TorchAttentionBackend()


def _why_not_triton(device: torch.device, kv_cache_dtype: str) -> str | None:
    """Why the Triton backend cannot serve this device and cache, or None if it can."""
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return (
            f"its kernels need a CUDA device, not {device.type} "
            "(TRITON_INTERPRET=1 runs them on CPU, slowly, for testing)"
        )
    if kv_cache_dtype == "int4":
        return "it has no kernel for an int4 KV cache (the torch backend has)"
    if (
        kv_cache_dtype in ("fp8", "fp8_e4m3")
        and device.type == "cuda"
        and torch.cuda.get_device_capability(device) < (8, 9)
    ):
        return "Triton has float8 e4m3 only on GPUs of compute capability 8.9 or later"
    try:
        import triton  # noqa: F401
    except ImportError:
        return "triton is not installed"
    return None
