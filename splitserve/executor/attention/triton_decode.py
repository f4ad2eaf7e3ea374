"""Triton paged decode attention: split-K ("flash-decoding") over the block table, then a merge of
the splits (see triton_attn.py for the design)."""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from splitserve.executor.attention.backend import AttentionMetadata
from splitserve.executor.attention.triton_common import (
    _DECODE_TILES,
    _NO_MAX,
    DEFAULT_NUM_SMS,
    LOG2E,
    MAX_SPLITS,
    MIN_SPLIT_TOKENS,
    _attend_paged,
    _cache_args,
    _dot_precision,
    _head_block,
    _tiles,
    _value_norm,
)


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return DEFAULT_NUM_SMS


def num_decode_splits(max_len: int, num_programs: int, num_sms: int) -> int:
    """Splits per (request, KV head) for a decode batch whose longest sequence attends to max_len
    keys: enough programs to fill the SMs, but no split shorter than MIN_SPLIT_TOKENS."""
    if num_programs >= num_sms:
        return 1
    return max(1, min(-(-num_sms // num_programs), max_len // MIN_SPLIT_TOKENS, MAX_SPLITS))


@triton.jit
def _decode_kernel(
    q_ptr,
    out_ptr,
    part_out,
    part_lse,
    table_ptr,
    seq_lens_ptr,
    k_cache,
    v_cache,
    k_scales,
    v_scales,
    stride_ch,
    stride_cb,
    stride_ct,
    stride_sh,
    stride_sb,
    stride_st,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_bt,
    qk_scale,
    window,
    GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    QUANTIZED: tl.constexpr,
    V_NORM: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """Program (request b, KV head, split): the GROUP query heads of the KV head (rows padded to
    BLOCK_G) against the split's share of the request's visible keys. q, out [B, Hq, D]. With one
    split it writes out; otherwise part_out [B, Hq, NUM_SPLITS, BLOCK_D] (normalized) and
    part_lse [B, Hq, NUM_SPLITS] (base 2; -inf for an empty split), both float32 and contiguous."""
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b)
    first = 0
    if HAS_WINDOW:
        first = tl.maximum(seq_len - window, 0)
    per_split = tl.cdiv(tl.cdiv(seq_len - first, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = first + split * per_split
    end = tl.minimum(start + per_split, seq_len)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    heads = kv_head * GROUP + offs_g
    g_mask = offs_g < GROUP
    d_mask = offs_d < HEAD_DIM
    row_mask = g_mask[:, None] & d_mask[None, :]
    q = tl.load(q_ptr + b * stride_qt + heads[:, None] * stride_qh + offs_d[None, :], mask=row_mask, other=0.0)
    m_i = tl.full([BLOCK_G], _NO_MAX, tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    m_i, l_i, acc = _attend_paged(
        q,
        m_i,
        l_i,
        acc,
        offs_g,
        start,
        end,
        window,
        qk_scale,
        table_ptr + b.to(tl.int64) * stride_bt,
        k_cache,
        v_cache,
        k_scales,
        v_scales,
        stride_ch,
        stride_cb,
        stride_ct,
        stride_sh,
        stride_sb,
        stride_st,
        kv_head,
        offs_d,
        d_mask,
        BLOCK_SIZE,
        BLOCK_N,
        False,
        HAS_WINDOW,
        QUANTIZED,
        V_NORM,
        PRECISION,
    )
    has_keys = l_i > 0
    l_safe = tl.where(has_keys, l_i, 1.0)
    acc = acc / l_safe[:, None]
    if NUM_SPLITS == 1:
        out = out_ptr + b * stride_ot + heads[:, None] * stride_oh + offs_d[None, :]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_mask)
    else:
        row = (b * (GROUP * tl.num_programs(1)) + heads) * NUM_SPLITS + split  # [BLOCK_G]
        tl.store(part_out + row[:, None] * BLOCK_D + offs_d[None, :], acc, mask=g_mask[:, None])
        lse = tl.where(has_keys, m_i + tl.log2(l_safe), float("-inf"))
        tl.store(part_lse + row, lse, mask=g_mask)


@triton.jit
def _merge_splits_kernel(
    part_out,
    part_lse,
    out_ptr,
    stride_ot,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    """Program (request b, query head h): out[b, h] = the splits' partial outputs weighted by
    exp2(lse) (see _decode_kernel for the layouts). Every request has a key, so some split does."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    row = (b * tl.num_programs(1) + h) * NUM_SPLITS
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < NUM_SPLITS
    lse = tl.load(part_lse + row + offs_s, mask=s_mask, other=float("-inf"))
    weight = tl.exp2(lse - tl.max(lse, 0))
    weight = weight / tl.sum(weight, 0)
    parts = tl.load(part_out + (row + offs_s)[:, None] * BLOCK_D + offs_d[None, :], mask=s_mask[:, None], other=0.0)
    out = tl.sum(parts * weight[:, None], 0)
    tl.store(out_ptr + b * stride_ot + h * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty), mask=offs_d < HEAD_DIM)


def decode_attention(layer, q: torch.Tensor, out: torch.Tensor, meta: AttentionMetadata) -> None:
    """Requests [0, num_decodes): q[:nd] [nd, Hq, D] -> out[:nd], in one launch (two with splits)."""
    nd, num_kv_heads, head_dim = meta.num_decodes, layer.num_kv_heads, layer.head_dim
    group = layer.num_heads // num_kv_heads
    window = layer.sliding_window or 0
    max_len = meta.decode_len_bound or max(meta.seq_lens[:nd])
    if window:
        max_len = min(max_len, window)
    splits = num_decode_splits(max_len, nd * num_kv_heads, _num_sms(q.device))
    block_d = _head_block(head_dim)
    block_n, num_warps = _tiles(_DECODE_TILES, block_d, q.dtype)
    part_out = part_lse = out  # unused stand-ins with one split
    if splits > 1:
        part_out = torch.empty(nd, layer.num_heads, splits, block_d, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(nd, layer.num_heads, splits, dtype=torch.float32, device=q.device)
    quantized = layer.kv_scales is not None
    _decode_kernel[(nd, num_kv_heads, splits)](
        q,
        out,
        part_out,
        part_lse,
        meta.block_tables,
        meta.seq_lens_tensor,
        *_cache_args(layer),
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        meta.block_tables.stride(0),
        layer.scale * LOG2E,
        window,
        GROUP=group,
        BLOCK_G=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        BLOCK_SIZE=meta.block_size,
        BLOCK_N=block_n,
        NUM_SPLITS=splits,
        HAS_WINDOW=bool(window),
        QUANTIZED=quantized,
        V_NORM=_value_norm(layer),
        PRECISION=_dot_precision(q.dtype),
        num_warps=num_warps,
        num_stages=2,
    )
    if splits > 1:
        _merge_splits_kernel[(nd, layer.num_heads)](
            part_out,
            part_lse,
            out,
            out.stride(0),
            out.stride(1),
            HEAD_DIM=head_dim,
            BLOCK_D=block_d,
            NUM_SPLITS=splits,
            BLOCK_S=triton.next_power_of_2(splits),
            num_warps=4,
        )


# --- prefill ------------------------------------------------------------------------------------
