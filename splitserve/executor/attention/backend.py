"""The attention backend interface and the per-step batch description it reads."""
from __future__ import annotations

import logging
import os
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import torch

logger = logging.getLogger(__name__)

BACKEND_ENV = "SPLITSERVE_ATTENTION_BACKEND"
BACKENDS = ("torch", "cpu", "triton")


@dataclass
class AttentionMetadata:
    """One step's batch, flattened: the tokens of every scheduled request, decodes first.

    Request i owns query tokens [query_start_loc[i], query_start_loc[i+1]) and, after this step,
    `seq_lens[i]` tokens of KV; its first `seq_lens[i] - query_len` tokens are already cached.
    Host-side lists are kept next to the tensors so that backends need no device->host syncs.
    """

    backend: "AttentionBackend"
    num_decodes: int                 # requests 0..num_decodes-1 have exactly one query token
    query_start_loc: list[int]       # len R + 1
    seq_lens: list[int]              # len R
    seq_lens_tensor: torch.Tensor    # [R] int32 on device
    block_tables: torch.Tensor       # [R, max_blocks] int32 on device (rows padded with 0)
    slot_mapping: torch.Tensor       # [T] int64 on device: where each token's K/V is written
    block_size: int
    # CUDA graphs: the steps replayed from one capture may have any length up to this bound, so a
    # backend must not size its work from seq_lens (the host list is the capture's, not the step's).
    decode_len_bound: int | None = None
    # Device tensors a backend derives from the fields above (e.g. query_start_loc as a tensor):
    # the first layer of a step builds them, the others reuse them.
    scratch: dict = field(default_factory=dict)

    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens)

    def query_len(self, i: int) -> int:
        return self.query_start_loc[i + 1] - self.query_start_loc[i]


class AttentionBackend(ABC):
    name: str
    # Whether a decode step can be captured in a CUDA graph: its kernels read lengths and block
    # tables from device tensors only, and it honours AttentionMetadata.decode_len_bound.
    supports_cuda_graphs: bool = False

    @abstractmethod
    def forward(self, layer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """Write k/v into layer.kv_cache at meta.slot_mapping, return attention output [T, Hq, D]."""


def get_attention_backend(device: torch.device, kv_cache_dtype: str = "auto") -> AttentionBackend:
    """The backend for a device and --kv-cache-dtype. $SPLITSERVE_ATTENTION_BACKEND (torch | cpu |
    triton) decides when set; otherwise CUDA devices get triton where it can run (else torch) and
    CPUs get cpu (the torch reference with splitserve's C++ paged-cache kernels).
    Forcing cpu on another device is a ValueError, and so is forcing triton where it cannot run
    (no CUDA device and no TRITON_INTERPRET=1, an int4 cache, an fp8_e4m3 cache before compute
    capability 8.9, triton not installed)."""
    device = torch.device(device)
    forced = os.environ.get(BACKEND_ENV, "").strip().lower()
    if forced and forced not in BACKENDS:
        raise ValueError(f"{BACKEND_ENV} must be one of {BACKENDS}, got {forced!r}.")
    if forced == "triton" or (not forced and device.type == "cuda"):
        reason = _why_not_triton(device, kv_cache_dtype)
        if reason is None:
            from splitserve.executor.attention.triton_attn import TritonAttentionBackend

            return TritonAttentionBackend()
        if forced:
            raise ValueError(f"{BACKEND_ENV}=triton: {reason}.")
        logger.info("Attention backend: torch, not triton: %s.", reason)
    if forced == "cpu" or (not forced and device.type == "cpu"):
        if device.type != "cpu":
            raise ValueError(f"{BACKEND_ENV}=cpu: its kernels run on the CPU, not on {device.type}.")
        from splitserve.executor.attention.cpu_backend import CPUAttentionBackend

        return CPUAttentionBackend()
    from splitserve.executor.attention.torch_ref import TorchAttentionBackend

    return TorchAttentionBackend()


def _why_not_triton(device: torch.device, kv_cache_dtype: str) -> str | None:
    """Why the Triton backend cannot serve this device and cache, or None if it can."""
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return (f"its kernels need a CUDA device, not {device.type} "
                "(TRITON_INTERPRET=1 runs them on CPU, slowly, for testing)")
    if kv_cache_dtype == "int4":
        return "it has no kernel for an int4 KV cache (the torch backend has)"
    if (kv_cache_dtype in ("fp8", "fp8_e4m3") and device.type == "cuda"
            and torch.cuda.get_device_capability(device) < (8, 9)):
        return "Triton has float8 e4m3 only on GPUs of compute capability 8.9 or later"
    try:
        import triton  # noqa: F401
    except ImportError:
        return "triton is not installed"
    return None
