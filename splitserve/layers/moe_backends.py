"""The GPU backends of a mixture-of-experts layer's experts, and which one a layer runs.

- "triton": kernels/triton_moe.py's `fused_experts`, one Triton launch per projection over the
  (token, slot) pairs sorted by expert and padded to whole blocks of rows. Any CUDA GPU Triton
  supports (Ampere too), float16 / bfloat16 / float32 experts, no host synchronisation (CUDA
  graphs capture it). The default on CUDA for plain (unquantized) experts.
- "grouped_mm": torch's grouped GEMM (`torch._grouped_mm`, `grouped_experts` here) over the same
  sorted pairs: bfloat16 on Hopper or newer, rows of 16-byte multiples; also capturable.
- "loop": expert by expert (FusedMoE.experts), reading each expert's token count on the host every
  step, so no CUDA graphs. Always the path on CPU (where the experts have their own kernels: packed
  oneDNN weights, GGUF blocks) and for quantized experts.

SPLITSERVE_MOE_BACKEND=auto (the default) takes the first of triton, grouped_mm that fits the layer,
else loop; naming one backend takes that one where it fits, else loop. SPLITSERVE_MOE_GROUPED_MM=0
rules out grouped_mm. Both backends need every expert on this rank (expert parallelism runs loop).
"""

from __future__ import annotations

import functools
import logging

import torch

from splitserve import envs
from splitserve.layers.basic import silu_and_mul

logger = logging.getLogger(__name__)

BACKENDS = ("triton", "grouped_mm", "loop")
_TRITON_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def choose_backend(
    device: torch.device, dtype: torch.dtype, quantized: bool, all_local: bool, hidden: int, intermediate: int
) -> str:
    """The backend a layer with these properties runs on `device` in `dtype` (module docstring)."""
    if device.type != "cuda" or quantized or not all_local:
        return "loop"
    wanted = envs.SPLITSERVE_MOE_BACKEND
    for name in BACKENDS[:2] if wanted == "auto" else (wanted,):
        if name == "triton" and dtype in _TRITON_DTYPES and triton_moe() is not None:
            return name
        if (
            name == "grouped_mm"
            and dtype == torch.bfloat16
            and hidden % 8 == 0  # rows of 16-byte multiples, as the grouped GEMM's kernel wants
            and intermediate % 8 == 0
            and _grouped_gemm_on(str(device))
        ):
            return name
    return "loop"


@functools.cache
def triton_moe():
    """splitserve.kernels.triton_moe, or None (logged once) when Triton cannot be imported."""
    try:
        from splitserve.kernels import triton_moe as module
    except ImportError as exc:
        logger.warning("Triton is not available (%s): GPU MoE layers use another backend (docs/moe.md).", exc)
        return None
    return module


@functools.cache
def _grouped_gemm_on(device: str) -> bool:
    """SPLITSERVE_MOE_GROUPED_MM on, a Hopper or newer GPU, and torch's grouped GEMM working there (once
    per device: every MoE layer asks at every forward)."""
    gpu_ok = envs.SPLITSERVE_MOE_GROUPED_MM and torch.cuda.get_device_capability(device) >= (9, 0)
    return gpu_ok and grouped_mm_works(device)


@functools.cache
def grouped_mm_works(device: str) -> bool:
    """Whether torch's grouped GEMM runs on `device` and agrees with plain products (once per device,
    on a small problem in the experts' layout, an empty group included); if not, the log says why and
    the MoE layers run expert by expert."""
    try:
        generator = torch.Generator(device).manual_seed(0)
        x = torch.randn(24, 64, device=device, dtype=torch.bfloat16, generator=generator)
        w = torch.randn(3, 32, 64, device=device, dtype=torch.bfloat16, generator=generator)
        ends = torch.tensor([8, 8, 24], device=device, dtype=torch.int32)
        got = torch._grouped_mm(x, w.transpose(1, 2), offs=ends).float()
        expected = torch.cat([x[:8].float() @ w[0].float().T, x[8:].float() @ w[2].float().T])
        error = (got - expected).abs().max().item()
        if error > 0.05 * expected.abs().max().item():
            raise RuntimeError(f"its result is off by {error:.3g}")
        return True
    except (AttributeError, RuntimeError, NotImplementedError) as exc:
        message = (
            "torch's grouped GEMM does not work on %s (%s): the MoE layers run expert by expert, without CUDA graphs."
        )
        logger.warning(message, device, exc)
        return False


def grouped_experts(
    x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum over each token's k experts of weight * expert(x), tokens per expert) with every expert in
    two grouped GEMMs (torch._grouped_mm over the (token, slot) pairs sorted by expert, each expert's
    rows against its own matrices) and fixed shapes throughout: nothing waits for the host, so a CUDA
    graph can capture it. The k outputs of a token are summed in slot order after one rounding each."""
    tokens, k = ids.shape
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(w13.shape[0], dtype=torch.long, device=x.device).scatter_add_(0, flat, torch.ones_like(flat))
    offsets = counts.cumsum(0).to(torch.int32)  # where each expert's rows end
    gate_up = torch._grouped_mm(x.index_select(0, order // k), w13.transpose(1, 2), offs=offsets)
    h = torch._grouped_mm(silu_and_mul(gate_up), w2.transpose(1, 2), offs=offsets)
    h = (h * weights.reshape(-1).index_select(0, order)[:, None]).to(x.dtype)
    by_slot = torch.empty_like(h).index_copy_(0, order, h)  # back to (token, slot) order
    return by_slot.view(tokens, k, -1).sum(1), counts
