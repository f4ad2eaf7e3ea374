"""Fused kernels for the hot element-wise steps of a decoder layer, paged decode attention and
temperature sampling.

On CPU they come from a small C++ extension, torch.ops.splitserve_cpu, compiled with the installed
torch the first time an engine needs it and cached by torch under ~/.cache/torch_extensions (about
30 s once per machine); later starts load that library directly while the sources, flags and torch
are the same (a note under ~/.cache/splitserve/kernels). build.py builds and loads it. Each
function here takes that path for CPU tensors and otherwise runs the torch code it replaces, which
stays the reference the kernels are tested against.

The C++ sources, one concern each: elementwise.cpp (RMSNorm with or without the residual add,
rotary, SiLU-and-mul), decode_attention.cpp (paged decode attention, the KV cache write),
prefill_attention.cpp, sampling.cpp, the GGUF kernels called through splitserve.kernels.gguf
(gguf_formats.h: the block layouts and their dequantization; gguf_repack.h/.cpp: Q4_0 and Q4_1
interleaved 16 rows at a time; gguf_products.cpp: products; gguf_dequantize.cpp: dequantization
and embedding lookups), decode_stack.cpp (a decode step's decoder layers in one call). Every
operator is registered in ops_registry.cpp and declared in cpu_ops.h; cpu_simd.h is their one
instruction-set layer (which vector code a build takes, vectors, horizontal sums, exp, bfloat16
conversions).

SPLITSERVE_CPU_KERNELS=0 turns the C++ kernels off (to compare, or to rule them out); a build
that fails is logged once, with the compiler's reason, and the torch code runs instead.
SPLITSERVE_CPU_ISA=avx2 builds them without AVX-512 (cpu_features.py), as on AVX2 machines.

On CUDA, RMSNorm (with or without the residual add), rotary and SiLU-and-mul of float16, bfloat16
and float32 tensors run as Triton kernels (triton_ops.py): one launch each, float32 math; RMSNorm
rounds where the torch code does, rotary and SiLU-and-mul round once at the end instead of after
every op. triton_ops is imported on the first CUDA call; without triton, or with
SPLITSERVE_GPU_KERNELS=0, CUDA runs the torch code (logged once). Paged attention on CUDA belongs
to the attention backend (splitserve/executor/attention); plain temperature sampling runs as one
Triton kernel there too (triton_sampling.py), the other samplers in torch.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from splitserve import envs
from splitserve.kernels.build import build as _build
from splitserve.kernels.build import identity as _identity  # noqa: F401 (the tests' handles on the build)
from splitserve.kernels.build import load_built as _load_built  # noqa: F401
from splitserve.kernels.build import stamp_path as _stamp_path  # noqa: F401

logger = logging.getLogger(__name__)

_SUPPORTED = (torch.float32, torch.bfloat16, torch.float16)
_state: dict[str, object] = {}


def cpu_ops():
    """torch.ops.splitserve_cpu, built on first use; None when turned off or when the build failed."""
    if "ops" not in _state:
        _state["ops"] = _build()
    return _state["ops"]


def cpu_kernels_enabled() -> bool:
    return envs.SPLITSERVE_CPU_KERNELS


def _use_cpu_kernel(x: torch.Tensor) -> bool:
    return x.device.type == "cpu" and x.dtype in _SUPPORTED and cpu_ops() is not None


def gpu_kernels_enabled() -> bool:
    return envs.SPLITSERVE_GPU_KERNELS


def gpu_ops():
    """splitserve.kernels.triton_ops, imported on first use; None when turned off or when triton
    cannot be imported."""
    if "gpu" not in _state:
        _state["gpu"] = _import_gpu_ops()
    return _state["gpu"]


def _import_gpu_ops():
    if not gpu_kernels_enabled():
        logger.info("SPLITSERVE_GPU_KERNELS=0: CUDA runs the plain torch ops for RMSNorm, rotary and SiLU.")
        return None
    try:
        from splitserve.kernels import triton_ops
    except ImportError as exc:
        logger.info("triton cannot be imported (%s): CUDA runs the plain torch ops for RMSNorm, rotary and SiLU.", exc)
        return None
    return triton_ops


def _use_gpu_kernel(x: torch.Tensor) -> bool:
    return x.device.type == "cuda" and x.dtype in _SUPPORTED and gpu_ops() is not None


# --- RMSNorm, optionally fused with the residual add -------------------------------------------
def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """transformers' RMSNorm (normalised in float32, cast back, then times the weight).
    With `residual`: residual = x + residual first, and the norm is of that sum; returns
    (normed, new residual). The CPU and CUDA kernels update `residual` in place: use the returned one."""
    if _use_cpu_kernel(x):
        ops = cpu_ops()
        flat = x.reshape(-1, x.shape[-1])
        if residual is None:
            return ops.rms_norm(flat, weight, eps).view(x.shape), None
        out = ops.add_rms_norm(flat, residual.view(-1, x.shape[-1]), weight, eps)
        return out.view(x.shape), residual
    if (
        _use_gpu_kernel(x)
        and weight.dtype in _SUPPORTED
        and (residual is None or (residual.dtype == x.dtype and residual.shape == x.shape))
    ):
        return gpu_ops().rms_norm(x, weight, eps, residual)
    if residual is not None:
        x = residual = x + residual
    normed = F.rms_norm(x.float(), (x.shape[-1],), eps=eps)
    return weight * normed.to(x.dtype), residual


# --- rotary ---------------------------------------------------------------------------------------
def apply_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """Rotate-half rotary of q [T, Hq, D] and k [T, Hkv, D] by cos, sin [T, 1, D] (model dtype).
    The CPU and CUDA kernels rotate q and k in place and return them."""
    if _use_cpu_kernel(q) and q.stride(-2) == q.shape[-1] and k.stride(-2) == k.shape[-1]:
        cpu_ops().rotary(q, k, cos, sin)
        return q, k
    if _use_gpu_kernel(q) and _gpu_rotary_fits(q, k, cos, sin):
        return gpu_ops().rotary(q, k, cos, sin)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _gpu_rotary_fits(q, k, cos, sin) -> bool:
    """The layout the Triton kernel rotates in place: 3-d q, k of one dtype with stride 1 on an
    even head_dim, and one cos / sin row per token in that dtype."""
    num_tokens, d = q.shape[0], q.shape[-1]
    return (
        q.dim() == 3
        and k.dim() == 3
        and k.shape[0] == num_tokens
        and k.shape[-1] == d
        and d % 2 == 0
        and q.stride(-1) == 1
        and k.stride(-1) == 1
        and k.dtype == q.dtype
        and cos.dtype == sin.dtype == q.dtype
        and cos.shape == sin.shape
        and cos.shape[0] == num_tokens
        and cos.numel() == num_tokens * d
    )


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


# --- SiLU and mul ---------------------------------------------------------------------------------
def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """[T, 2I] = [gate | up] -> silu(gate) * up, [T, I]."""
    if _use_cpu_kernel(x) and x.dim() == 2 and x.stride(-1) == 1:
        return cpu_ops().silu_and_mul(x)
    if _use_gpu_kernel(x) and x.shape[-1] % 2 == 0:
        return gpu_ops().silu_and_mul(x)
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


# --- paged KV cache ------------------------------------------------------------------------------
def paged_kv_supported(q: torch.Tensor, kv_cache: torch.Tensor, kv_scales) -> bool:
    """Whether the CPU cache kernels take this layer: an unquantized cache in q's dtype."""
    return kv_scales is None and kv_cache.dtype == q.dtype and _use_cpu_kernel(q)


def write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """k, v [T, Hkv, D] into kv_cache [2, Hkv, blocks, block_size, D] at slot_mapping [T] (int64,
    block * block_size + offset). CPU only (see paged_kv_supported)."""
    cpu_ops().write_kv(kv_cache, k, v, slot_mapping)


def decode_attention(
    out: torch.Tensor,
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    num_decodes: int,
    scale: float,
    sliding_window: int | None,
) -> None:
    """Attention of the first num_decodes requests, one query token each: rows [0, num_decodes) of
    q [T, Hq, D] into the same rows of out (contiguous); kv_cache [2, Hkv, blocks, block_size, D];
    block_tables [R, max_blocks] int32 and seq_lens [R] int32 (tokens cached, this one included).
    CPU only (see paged_kv_supported)."""
    cpu_ops().decode_attention(out, q, kv_cache, block_tables, seq_lens, num_decodes, scale, sliding_window or 0)


def prefill_attention(
    out: torch.Tensor,
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    first: int,
    scale: float,
    sliding_window: int | None,
) -> None:
    """Causal attention of the query tokens of requests [first, R) (prompts or prompt chunks) over
    their cached context and themselves, read from kv_cache after this step's K/V were written:
    their rows of q [T, Hq, D] into the same rows of out (contiguous). query_start_loc [R + 1]
    int64; the other arguments as for decode_attention. CPU only (see paged_kv_supported)."""
    cpu_ops().prefill_attention(
        out, q, kv_cache, block_tables, seq_lens, query_start_loc, first, scale, sliding_window or 0
    )


def set_prompt_attention_brgemm(float32: bool, bfloat16: bool) -> tuple[bool, bool]:
    """Whether prefill_attention's products go through oneDNN's block kernels from now on in this
    process: those it computes in float32 (float32, float16, and bfloat16 without native bfloat16)
    and its bfloat16 ones (AMX tiles on a CPU with AMX). The kernels' build sets them once
    (cpu_features.brgemm_attention); tests switch them. Returns the old settings."""
    return cpu_ops().set_prompt_attention_brgemm(float32, bfloat16)


# --- sampling -------------------------------------------------------------------------------------
def sample_supported(logits: torch.Tensor) -> bool:
    """Whether sample() takes these logits: CPU (the C++ kernel) or CUDA (triton_sampling.py)."""
    if logits.dim() != 2 or logits.stride(-1) != 1:
        return False
    return _use_cpu_kernel(logits) or _use_gpu_kernel(logits)


def sample(
    logits: torch.Tensor, temperature: torch.Tensor, u: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """[R] token ids: argmax for rows with temperature < 1e-5, else the token where the cumulative
    distribution of softmax(logits / temperature) first exceeds u (one uniform per row, [R]; None
    when every row is greedy); and [R] float32, each chosen token's logprob under softmax(logits)
    (the raw logits). One launch on CPU or CUDA (see sample_supported), where the torch sampler
    takes five passes and some fifteen launches."""
    if logits.device.type == "cuda":
        from splitserve.kernels import triton_sampling

        return triton_sampling.sample(logits, temperature, u, all_greedy=u is None)
    temperature = temperature.float().contiguous()
    return cpu_ops().sample(logits, temperature, temperature if u is None else u.float().contiguous())
