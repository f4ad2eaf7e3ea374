"""What the Triton attention kernels share: constants, tile sizes, the cache as kernel arguments,
and the online-softmax steps over a paged block table (see triton_attn.py for the design)."""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634
# The running maximum starts here rather than at -inf, so that a row whose keys are all masked so
# far keeps exp2(m_old - m_new) = 1 instead of NaN.
_NO_MAX = tl.constexpr(-1.0e30)
# Decode: a split gets at least this many keys (its fixed cost: a partial output and one more row
# for the merge), and a step at most this many splits.
MIN_SPLIT_TOKENS = 256
MAX_SPLITS = 32
DEFAULT_NUM_SMS = 132  # an H100 SXM; used where the device cannot be asked (the CPU interpreter)


# --- shared pieces ------------------------------------------------------------------------------
def _cache_args(layer) -> tuple:
    """A layer's cache as kernel arguments: K and V data [num_kv_heads, num_blocks, block_size, D]
    (stride 1 along D), their scales [num_kv_heads, num_blocks, block_size, 1] (the data again, as
    an unused stand-in, when the cache is not quantized), then the strides of heads, blocks and
    slots in each."""
    cache = layer.kv_cache
    scales = cache if layer.kv_scales is None else layer.kv_scales
    return (
        cache[0],
        cache[1],
        scales[0],
        scales[1],
        cache.stride(1),
        cache.stride(2),
        cache.stride(3),
        scales.stride(1),
        scales.stride(2),
        scales.stride(3),
    )


def _value_norm(layer) -> float:
    """For a quantized cache, the power of two at or above its format's largest level (int8 128,
    fp8 e4m3 512, e5m2 65536). The probabilities are multiplied by each value's scale (s = absmax /
    largest level) before their product with the stored values, in the model's dtype: float16 would
    keep few bits of p s (down to ~1e-9 for e5m2), so the kernels take p s V_NORM, of the order of
    the values themselves, and divide the product by V_NORM (exact, as a power of two)."""
    if layer.kv_scales is None:
        return 1.0
    storage = layer.kv_cache.dtype
    largest = torch.iinfo(storage).max if storage == torch.int8 else torch.finfo(storage).max
    return float(2 ** math.ceil(math.log2(largest)))


def _dot_precision(dtype: torch.dtype) -> str:
    """float32 dots as 3xTF32, close to float32 (plain tf32 misses the reference by ~1e-3; "ieee"
    runs off the tensor cores and spills registers); 16-bit dtypes ignore it."""
    return "tf32x3" if dtype == torch.float32 else "tf32"


# Tile sizes by BLOCK_D, for 16-bit inputs and for float32: what compiles for sm_90 without
# register spills (ptxas -v; float32 at head_dim 256 spills some), not tuned for speed on a GPU.
# head_dim 16 to 64 uses the first row.
_PREFILL_TILES = {  # BLOCK_D -> ((BLOCK_M, BLOCK_N, num_warps) 16-bit, (...) float32)
    64: ((64, 64, 4), (64, 32, 4)),
    128: ((64, 64, 8), (32, 32, 8)),
    256: ((32, 32, 8), (16, 32, 4)),
}
_DECODE_TILES = {  # BLOCK_D -> ((BLOCK_N, num_warps) 16-bit, (...) float32)
    64: ((64, 4), (32, 4)),
    128: ((64, 8), (32, 8)),
    256: ((32, 8), (16, 8)),
}
MAX_HEAD_DIM = 256


def _head_block(head_dim: int) -> int:
    """head_dim padded to a power of two, at least 16 (the smallest dot)."""
    return max(16, triton.next_power_of_2(head_dim))


def _tiles(table: dict, block_d: int, dtype: torch.dtype) -> tuple[int, ...]:
    return table[max(64, block_d)][dtype == torch.float32]


@triton.jit
def _softmax_step(
    q,
    k,
    v,
    k_scale,
    v_scale,
    visible,
    m_i,
    l_i,
    acc,
    qk_scale,
    QUANTIZED: tl.constexpr,
    V_NORM: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """Fold one tile of keys into the running softmax of a tile of query rows.
    q [M, BLOCK_D] and k, v [N, BLOCK_D] in the model's dtype (k, v: stored values when QUANTIZED,
    with k_scale, v_scale [N] float32); visible [M, N]; m_i, l_i [M] (base 2) and acc [M, BLOCK_D]
    float32; v_scale comes multiplied by V_NORM (see _value_norm). Returns the updated (m_i, l_i, acc)."""
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION)
    if QUANTIZED:
        s = s * k_scale[None, :]
    s = tl.where(visible, s * qk_scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if QUANTIZED:
        p = p * v_scale[None, :]
    pv = tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    if QUANTIZED:
        pv = pv * (1.0 / V_NORM)  # a power of two: exact
    acc = acc * alpha[:, None] + pv
    return m_new, l_i, acc


@triton.jit
def _attend_paged(
    q,
    m_i,
    l_i,
    acc,
    q_pos,
    start,
    end,
    window,
    qk_scale,
    table_ptr,
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
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    QUANTIZED: tl.constexpr,
    V_NORM: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """Keys [start, end) of one request from the paged cache, BLOCK_N at a time: each key's block
    comes from the request's block table (table_ptr), whatever block_size is. q_pos [M]: the rows'
    positions (CAUSAL: key kp is visible iff kp <= q_pos, and kp > q_pos - window with HAS_WINDOW)."""
    kv_head = kv_head.to(tl.int64)
    k_cache += kv_head * stride_ch
    v_cache += kv_head * stride_ch
    k_scales += kv_head * stride_sh
    v_scales += kv_head * stride_sh
    for tok in range(start, end, BLOCK_N):
        pos = tok + tl.arange(0, BLOCK_N)
        valid = pos < end
        block = tl.load(table_ptr + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
        slot = pos % BLOCK_SIZE
        data = block[:, None] * stride_cb + slot[:, None] * stride_ct + offs_d[None, :]
        tile_mask = valid[:, None] & d_mask[None, :]
        # Zeros where masked, set after the conversion: `other` cannot be given in a float8 dtype.
        k = tl.where(tile_mask, tl.load(k_cache + data, mask=tile_mask).to(q.dtype), 0.0)
        v = tl.where(tile_mask, tl.load(v_cache + data, mask=tile_mask).to(q.dtype), 0.0)
        k_scale = 0.0
        v_scale = 0.0
        if QUANTIZED:
            scale = block * stride_sb + slot * stride_st
            k_scale = tl.load(k_scales + scale, mask=valid, other=0.0)
            v_scale = tl.load(v_scales + scale, mask=valid, other=0.0) * V_NORM
        visible = valid[None, :]
        if CAUSAL:
            visible = visible & (pos[None, :] <= q_pos[:, None])
            if HAS_WINDOW:
                visible = visible & (pos[None, :] > q_pos[:, None] - window)
        m_i, l_i, acc = _softmax_step(
            q, k, v, k_scale, v_scale, visible, m_i, l_i, acc, qk_scale, QUANTIZED, V_NORM, PRECISION
        )
    return m_i, l_i, acc
