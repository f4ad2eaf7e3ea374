"""W4A16 on CUDA: 4-bit AWQ/GPTQ/compressed-tensors weights multiplied in one Triton kernel that
reads them packed and dequantizes them in registers, instead of expanding the whole weight to 16
bits on every forward (the portable path of quantization/int4_linear.py: it read 1 byte per weight,
wrote 2 and read them again, so 4-bit serving was slower than bfloat16).

Layout (`pack`): the levels 0..15 of a [N, K] weight, eight per int32 along K (level of column k in
bits 4 * (k % 8) of word k // 8): [N, K / 8] int32, a quarter of the bfloat16 weight's bytes; scales
and zero points [N, K / G] in the activations' dtype. Act-order (GPTQ g_idx) is resolved before:
the layer sorts its input channels by group at load and gathers the activations in that order.

`linear(x, qweight, scales, zeros, group_size)`: y = x @ ((q - zero) * scale)^T, one program per
(block of rows, block of output channels), walking K in blocks inside one group (a block's scale and
zero are one value per output channel); decode rows (M <= 16) take narrow blocks of outputs so that
a single request's product still spreads over the GPU's SMs. No host synchronisation: the launch can
be captured in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _int4_linear_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    z_ptr,
    y_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_qn,
    stride_sn,
    stride_ym,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_mask = rm < M
    n_mask = rn < N
    shifts = (rk % 8) * 4
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + rk
        x = tl.load(x_ptr + rm[:, None] * stride_xm + k[None, :], mask=m_mask[:, None], other=0.0)
        words = tl.load(q_ptr + rn[:, None] * stride_qn + (k[None, :] // 8), mask=n_mask[:, None], other=0)
        levels = ((words >> shifts[None, :]) & 0xF).to(tl.float32)
        group = k0 // GROUP  # a block lies inside one group (GROUP % BLOCK_K == 0)
        scale = tl.load(s_ptr + rn * stride_sn + group, mask=n_mask, other=0.0).to(tl.float32)
        zero = tl.load(z_ptr + rn * stride_sn + group, mask=n_mask, other=0.0).to(tl.float32)
        w = ((levels - zero[:, None]) * scale[:, None]).to(x.dtype)
        acc += tl.dot(x, tl.trans(w))
    y = acc.to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], y, mask=m_mask[:, None] & n_mask[None, :])


def pack(levels: torch.Tensor) -> torch.Tensor:
    """[N, K] levels 0..15 (K a multiple of 8) -> [N, K / 8] int32, column k in bits 4 * (k % 8)."""
    n, k = levels.shape
    nibbles = levels.to(torch.int32).view(n, k // 8, 8)
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=levels.device)
    return (nibbles << shifts).sum(dim=-1, dtype=torch.int32)


def operands(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, dtype: torch.dtype):
    """The kernel's (packed levels, scales, zero points) of [N, K] levels and their [N, K / G] scale
    and zero, these two in `dtype`."""
    return pack(q), scale.to(dtype).contiguous(), zero.to(dtype).contiguous()


def _block_k(k: int, group: int) -> int | None:
    """The widest K block (64, 32 or 16) inside one group: it divides the group size (and so K)."""
    return next((b for b in (64, 32, 16) if group % b == 0 and k % group == 0), None)


def _blocks(m: int, k: int, group: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps): narrow output blocks for decode rows."""
    block_k = _block_k(k, group)
    if m <= 16:
        return 16, 32, block_k, 4
    if m <= 64:
        return 64, 64, block_k, 4
    return 64, 128, block_k, 8


def supported(k: int, group: int) -> bool:
    """Whether the kernel takes K input channels in groups of `group` (a multiple of 16 dividing K)."""
    return _block_k(k, group) is not None


def linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group: int):
    """x [M, K] (unit stride along K) times the dequantized [N, K] weight, transposed: [M, N] in x's dtype."""
    m, k = x.shape
    n = qweight.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    x = x if x.stride(1) == 1 else x.contiguous()
    block_m, block_n, block_k, warps = _blocks(m, k, group)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _int4_linear_kernel[grid](
        x,
        qweight,
        scales,
        zeros,
        y,
        m,
        n,
        k,
        x.stride(0),
        qweight.stride(0),
        scales.stride(0),
        y.stride(0),
        GROUP=group,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=warps,
    )
    return y
