"""Triton kernels for CUDA for the element-wise steps of a decoder layer: RMSNorm (optionally fused
with the residual add), rotate-half rotary in place on q and k, and SiLU-and-mul. Each is one
launch per call; splitserve.kernels routes CUDA tensors here.

All three read float16, bfloat16 or float32 and compute in float32:

- rms_norm rounds where the torch code it replaces does (splitserve.kernels.rms_norm): the
  residual sum once to the dtype, the normalised row once to the dtype, then the product with the
  weight once to the output dtype; so results differ from torch only by the float32 sum of squares.
- rotary and silu_and_mul round once, at the end (the torch code rounds after every op, so
  16-bit results may differ from it by one rounding step).

The wrappers only allocate their outputs and launch: no host synchronisation, so they can be
captured in a CUDA graph. Rows are addressed by their strides (stride 1 along the last dim), so
views into a fused projection output (q and k of qkv, Qwen3's per-head norm) are read in place.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# rms_norm keeps a whole row in registers up to this many elements (hidden sizes up to 8192);
# longer rows are read in chunks of this size, twice (sum of squares, then normalise).
MAX_ROW_BLOCK = 8192
# silu_and_mul: columns per program (a program per (row, column block)).
SILU_BLOCK = 1024
# rotary: about this many elements (BLOCK_H heads x padded head_dim) per program.
ROTARY_ELEMENTS = 2048


def _num_warps(elements: int, most: int = 16) -> int:
    """A warp per 256 elements of a program's block (8 per thread), from 1 to `most`."""
    return max(1, min(most, elements // 256))


# --- RMSNorm, optionally fused with the residual add ----------------------------------------------
@triton.jit
def _load_summed(x_row, res_row, offs, mask, HAS_RESIDUAL: tl.constexpr):
    """The row's values at offs, in float32. With HAS_RESIDUAL: x + residual, rounded to the
    residual's dtype as torch's add rounds, and stored back into the residual."""
    x = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(res_row + offs, mask=mask, other=0.0).to(tl.float32)
        total = (x + r).to(res_row.dtype.element_ty)
        tl.store(res_row + offs, total, mask=mask)
        x = total.to(tl.float32)
    return x


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    rows_inner,
    stride_xo,
    stride_xi,
    stride_ro,
    stride_ri,
    n_cols,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
    ONE_PASS: tl.constexpr,
):
    """One program per row. Rows are indexed by (outer, inner) with their own strides in x and in
    the residual (a [T, H, D] view normalises T * H rows of D); out is contiguous [rows, n_cols].
    With HAS_RESIDUAL the row of res_ptr becomes round(x + residual) and that is normalised.
    ONE_PASS: the row fits in BLOCK and stays in registers; otherwise it is read BLOCK at a time,
    once for the sum of squares and once more to normalise."""
    row = tl.program_id(0)
    outer = (row // rows_inner).to(tl.int64)
    inner = (row % rows_inner).to(tl.int64)
    x_row = x_ptr + outer * stride_xo + inner * stride_xi
    res_row = res_ptr + outer * stride_ro + inner * stride_ri
    out_row = out_ptr + row.to(tl.int64) * n_cols
    cols = tl.arange(0, BLOCK)
    if ONE_PASS:
        mask = cols < n_cols
        x = _load_summed(x_row, res_row, cols, mask, HAS_RESIDUAL)
        rstd = 1.0 / tl.sqrt_rn(tl.sum(x * x, axis=0) / n_cols + eps)
        normed = (x * rstd).to(x_ptr.dtype.element_ty).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_row + cols, (normed * w).to(out_ptr.dtype.element_ty), mask=mask)
    else:
        squares = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, n_cols, BLOCK):
            offs = start + cols
            mask = offs < n_cols
            x = _load_summed(x_row, res_row, offs, mask, HAS_RESIDUAL)
            squares += x * x
        rstd = 1.0 / tl.sqrt_rn(tl.sum(squares, axis=0) / n_cols + eps)
        if HAS_RESIDUAL:
            tl.debug_barrier()  # the sums stored above are read back (by the same threads, but be sure)
        for start in range(0, n_cols, BLOCK):
            offs = start + cols
            mask = offs < n_cols
            if HAS_RESIDUAL:
                x = tl.load(res_row + offs, mask=mask, other=0.0).to(tl.float32)
            else:
                x = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
            normed = (x * rstd).to(x_ptr.dtype.element_ty).to(tl.float32)
            w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            tl.store(out_row + offs, (normed * w).to(out_ptr.dtype.element_ty), mask=mask)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as [outer, inner, N] with stride 1 along N and any strides on the other two: a view of x
    where its layout allows (2-d rows, [T, H, D] head views), else a contiguous copy."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    if x.dim() == 1:
        return x.view(1, 1, -1)
    if x.dim() == 2:
        return x.unsqueeze(1)
    return x.flatten(0, -3)  # a view when the leading dims merge, else a copy


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """splitserve.kernels.rms_norm in one launch: weight * normalise(x in float32).to(x.dtype),
    over the last dim of x (any leading dims). With `residual` (x's shape and dtype): residual =
    x + residual, rounded to the dtype and written into `residual` in place, and the norm is of
    that sum; returns (normed, residual). The output is a new contiguous tensor of x's shape, in
    the dtype torch gives weight * x."""
    n = x.shape[-1]
    out = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(
            f"residual {tuple(residual.shape)} {residual.dtype} does not match x {tuple(x.shape)} {x.dtype}"
        )
    if out.numel() == 0:
        return out, residual
    rows = _rows(x)
    res_rows = _rows(residual) if residual is not None else rows
    block = min(triton.next_power_of_2(n), MAX_ROW_BLOCK)
    _rms_norm_kernel[(rows.shape[0] * rows.shape[1],)](
        rows,
        res_rows,
        weight.contiguous(),
        out,
        rows.shape[1],
        rows.stride(0),
        rows.stride(1),
        res_rows.stride(0),
        res_rows.stride(1),
        n,
        eps,
        HAS_RESIDUAL=residual is not None,
        BLOCK=block,
        ONE_PASS=n <= block,
        num_warps=_num_warps(block),
    )
    if residual is not None and res_rows.data_ptr() != residual.data_ptr():
        residual.copy_(res_rows.view(residual.shape))  # a layout _rows had to copy
    return out, residual


# --- rotary -----------------------------------------------------------------------------------------
@triton.jit
def _rotate_heads(
    x_ptr, stride_h, n_heads, head0, c1, s1, c2, s2, HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr
):
    """Heads [head0, head0 + BLOCK_H) of one token (x_ptr: its head 0), in place:
    x1, x2 = the two halves; x1 <- x1 c1 - x2 s1, x2 <- x2 c2 + x1 s2 (c, s: [BLOCK_HALF] float32)."""
    heads = head0 + tl.arange(0, BLOCK_H)
    cols = tl.arange(0, BLOCK_HALF)
    mask = (heads < n_heads)[:, None] & (cols < HALF)[None, :]
    first = x_ptr + heads[:, None].to(tl.int64) * stride_h + cols[None, :]
    x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(first + HALF, mask=mask, other=0.0).to(tl.float32)
    y1 = x1 * c1[None, :] - x2 * s1[None, :]
    y2 = x2 * c2[None, :] + x1 * s2[None, :]
    tl.store(first, y1.to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(first + HALF, y2.to(x_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(
    q_ptr,
    k_ptr,
    cos_ptr,
    sin_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_ct,
    stride_st,
    n_q_heads,
    n_k_heads,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    """A program per (token, block of BLOCK_H heads): the first cdiv(n_q_heads, BLOCK_H) head
    blocks are q's, the rest k's, so one launch rotates both."""
    tok = tl.program_id(0).to(tl.int64)
    block = tl.program_id(1)
    cols = tl.arange(0, BLOCK_HALF)
    mask = cols < HALF
    cos_row = cos_ptr + tok * stride_ct
    sin_row = sin_ptr + tok * stride_st
    c1 = tl.load(cos_row + cols, mask=mask, other=0.0).to(tl.float32)
    c2 = tl.load(cos_row + HALF + cols, mask=mask, other=0.0).to(tl.float32)
    s1 = tl.load(sin_row + cols, mask=mask, other=0.0).to(tl.float32)
    s2 = tl.load(sin_row + HALF + cols, mask=mask, other=0.0).to(tl.float32)
    q_blocks = tl.cdiv(n_q_heads, BLOCK_H)
    if block < q_blocks:
        _rotate_heads(
            q_ptr + tok * stride_qt, stride_qh, n_q_heads, block * BLOCK_H, c1, s1, c2, s2, HALF, BLOCK_H, BLOCK_HALF
        )
    else:
        _rotate_heads(
            k_ptr + tok * stride_kt,
            stride_kh,
            n_k_heads,
            (block - q_blocks) * BLOCK_H,
            c1,
            s1,
            c2,
            s2,
            HALF,
            BLOCK_H,
            BLOCK_HALF,
        )


def rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """Rotate-half rotary, in place, of q [T, Hq, D] and k [T, Hkv, D] (any strides on the first
    two dims, 1 on the last) by cos, sin [T, 1, D] or [T, D] (stride 1 on the last dim; the
    halves of each row are read separately, as torch's rotate-half does). Returns (q, k)."""
    num_tokens, n_q, d = q.shape
    n_k = k.shape[1]
    if d % 2 or k.shape[0] != num_tokens or k.shape[2] != d:
        raise ValueError(
            f"rotary needs q [T, Hq, D] and k [T, Hkv, D] with an even D, not {tuple(q.shape)} and {tuple(k.shape)}"
        )
    if q.stride(-1) != 1 or k.stride(-1) != 1:
        raise ValueError("rotary works in place and needs q and k with stride 1 on the last dim")
    if cos.numel() != num_tokens * d or sin.numel() != num_tokens * d:
        raise ValueError(
            f"rotary needs one cos and sin row of {d} per token, not {tuple(cos.shape)} and "
            f"{tuple(sin.shape)} for {num_tokens} tokens"
        )
    cos, sin = cos.reshape(num_tokens, d), sin.reshape(num_tokens, d)
    if cos.stride(-1) != 1:
        cos = cos.contiguous()
    if sin.stride(-1) != 1:
        sin = sin.contiguous()
    if num_tokens == 0:
        return q, k
    half = d // 2
    block_half = triton.next_power_of_2(half)
    block_h = min(triton.next_power_of_2(max(n_q, n_k)), max(1, ROTARY_ELEMENTS // (2 * block_half)))
    grid = (num_tokens, triton.cdiv(n_q, block_h) + triton.cdiv(n_k, block_h))
    _rotary_kernel[grid](
        q,
        k,
        cos,
        sin,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        cos.stride(0),
        sin.stride(0),
        n_q,
        n_k,
        HALF=half,
        BLOCK_H=block_h,
        BLOCK_HALF=block_half,
        num_warps=_num_warps(block_h * block_half, most=8),
    )
    return q, k


# --- SiLU and mul ------------------------------------------------------------------------------------
@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, n_cols, BLOCK: tl.constexpr):
    """A program per (row, BLOCK columns): out = silu(gate) * up, gate = x[:, :n_cols] and
    up = x[:, n_cols:], in float32, rounded once; out contiguous [rows, n_cols]."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    x_row = x_ptr + row * stride_x
    gate = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_row + n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    y = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + row * n_cols + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """[..., 2I] = [gate | up] -> silu(gate) * up, [..., I] (a new contiguous tensor)."""
    width = x.shape[-1]
    if width % 2:
        raise ValueError(f"silu_and_mul needs an even last dim, not {width}")
    n = width // 2
    out = torch.empty(*x.shape[:-1], n, dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    rows = x.reshape(-1, width)  # a view for the usual 2-d (or row-strided) input
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    block = min(triton.next_power_of_2(n), SILU_BLOCK)
    _silu_and_mul_kernel[(rows.shape[0], triton.cdiv(n, block))](
        rows, out, rows.stride(0), n, BLOCK=block, num_warps=_num_warps(block, most=4)
    )
    return out
