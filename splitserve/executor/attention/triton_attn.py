"""The Triton attention backend for CUDA: paged KV cache, one decode launch and one prefill launch
per layer and step, whatever the number of requests.

- Decode (one query token per request) is split-K ("flash-decoding"): a program per (request,
  KV head, split) runs an online softmax over its share of the request's keys for all the query
  heads of its KV head at once, and writes a partial output and log-sum-exp; a second kernel
  merges the splits. With one split the first kernel writes the output itself.
- Prefill (prompt chunks of any length, with or without cached context) is varlen: a program per
  (tile of BLOCK_M query tokens of one request, query head) walks the request's keys through its
  block table, causal with the chunk's offset in the sequence, sliding window included.

The cache layout is the reference backend's (see torch_ref): [2, num_kv_heads, num_blocks,
block_size, head_dim], and a quantized cache (int8, fp8 e4m3fn / e5m2) keeps one float32 scale per
cached vector in kv_scales [2, num_kv_heads, num_blocks, block_size, 1]. The kernels apply the
scales as the reference decode does: q . x = s (q . x') on the scores and sum_t p_t x_t =
(p s) . x' on the probabilities, x' the stored values converted to the model's dtype (exactly).
As in the reference, a fresh prompt (no cached context, no sliding window) over a quantized cache
attends to its own unquantized k/v; every other request reads all its keys from the cache.

Softmax runs in base 2 (scores times scale * log2(e), exp2) with float32 statistics and
accumulators; inputs may be float16, bfloat16 or float32 (float32 dots in full precision).
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from splitserve.executor.attention.backend import AttentionBackend, AttentionMetadata
from splitserve.executor.attention.torch_ref import write_kv, write_quantized_kv
from splitserve.executor.host import to_device

LOG2E = 1.4426950408889634
# The running maximum starts here rather than at -inf, so that a row whose keys are all masked so
# far keeps exp2(m_old - m_new) = 1 instead of NaN.
_NO_MAX = tl.constexpr(-1.0e30)
# Decode: a split gets at least this many keys (its fixed cost: a partial output and one more row
# for the merge), and a step at most this many splits.
MIN_SPLIT_TOKENS = 256
MAX_SPLITS = 32
DEFAULT_NUM_SMS = 132  # an H100 SXM; used where the device cannot be asked (the CPU interpreter)


class TritonAttentionBackend(AttentionBackend):
    name = "triton"
    supports_cuda_graphs = True

    def forward(self, layer, q, k, v, meta: AttentionMetadata) -> torch.Tensor:
        if layer.head_dim > MAX_HEAD_DIM:
            raise ValueError(f"The Triton attention backend supports head_dim up to {MAX_HEAD_DIM}, not "
                             f"{layer.head_dim}; use SPLITSERVE_ATTENTION_BACKEND=torch.")
        if layer.kv_scales is None:
            write_kv(layer.kv_cache[0], layer.kv_cache[1], k, v, meta.slot_mapping)
        else:
            if layer.kv_scales.shape[-1] != 1:
                raise ValueError("The Triton attention backend has no kernel for an int4 KV cache; "
                                 "use SPLITSERVE_ATTENTION_BACKEND=torch.")
            write_quantized_kv(layer.kv_cache, layer.kv_scales, k, v, meta.slot_mapping)
        q, k, v = _unit_last_stride(q), _unit_last_stride(k), _unit_last_stride(v)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        if meta.num_decodes:
            decode_attention(layer, q, out, meta)
        if meta.num_decodes < meta.num_reqs:
            prefill_attention(layer, q, k, v, out, meta)
        return out


def _unit_last_stride(x: torch.Tensor) -> torch.Tensor:
    """The kernels address head_dim with stride 1 and the other two dims by their strides."""
    return x if x.stride(-1) == 1 else x.contiguous()


# --- shared pieces ------------------------------------------------------------------------------
def _cache_args(layer) -> tuple:
    """A layer's cache as kernel arguments: K and V data [num_kv_heads, num_blocks, block_size, D]
    (stride 1 along D), their scales [num_kv_heads, num_blocks, block_size, 1] (the data again, as
    an unused stand-in, when the cache is not quantized), then the strides of heads, blocks and
    slots in each."""
    cache = layer.kv_cache
    scales = cache if layer.kv_scales is None else layer.kv_scales
    return (cache[0], cache[1], scales[0], scales[1], cache.stride(1), cache.stride(2), cache.stride(3),
            scales.stride(1), scales.stride(2), scales.stride(3))


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
def _softmax_step(q, k, v, k_scale, v_scale, visible, m_i, l_i, acc, qk_scale,
                  QUANTIZED: tl.constexpr, PRECISION: tl.constexpr):
    """Fold one tile of keys into the running softmax of a tile of query rows.
    q [M, BLOCK_D] and k, v [N, BLOCK_D] in the model's dtype (k, v: stored values when QUANTIZED,
    with k_scale, v_scale [N] float32); visible [M, N]; m_i, l_i [M] (base 2) and acc [M, BLOCK_D]
    float32. Returns the updated (m_i, l_i, acc)."""
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
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_new, l_i, acc


@triton.jit
def _attend_paged(q, m_i, l_i, acc, q_pos, start, end, window, qk_scale, table_ptr,
                  k_cache, v_cache, k_scales, v_scales,
                  stride_ch, stride_cb, stride_ct, stride_sh, stride_sb, stride_st, kv_head,
                  offs_d, d_mask,
                  BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
                  HAS_WINDOW: tl.constexpr, QUANTIZED: tl.constexpr, PRECISION: tl.constexpr):
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
            v_scale = tl.load(v_scales + scale, mask=valid, other=0.0)
        visible = valid[None, :]
        if CAUSAL:
            visible = visible & (pos[None, :] <= q_pos[:, None])
            if HAS_WINDOW:
                visible = visible & (pos[None, :] > q_pos[:, None] - window)
        m_i, l_i, acc = _softmax_step(q, k, v, k_scale, v_scale, visible, m_i, l_i, acc, qk_scale,
                                      QUANTIZED, PRECISION)
    return m_i, l_i, acc


# --- decode -------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
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
def _decode_kernel(q_ptr, out_ptr, part_out, part_lse, table_ptr, seq_lens_ptr,
                   k_cache, v_cache, k_scales, v_scales,
                   stride_ch, stride_cb, stride_ct, stride_sh, stride_sb, stride_st,
                   stride_qt, stride_qh, stride_ot, stride_oh, stride_bt,
                   qk_scale, window,
                   GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr,
                   BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
                   NUM_SPLITS: tl.constexpr, HAS_WINDOW: tl.constexpr, QUANTIZED: tl.constexpr,
                   PRECISION: tl.constexpr):
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
    m_i, l_i, acc = _attend_paged(q, m_i, l_i, acc, offs_g, start, end, window, qk_scale,
                                  table_ptr + b.to(tl.int64) * stride_bt,
                                  k_cache, v_cache, k_scales, v_scales,
                                  stride_ch, stride_cb, stride_ct, stride_sh, stride_sb, stride_st, kv_head,
                                  offs_d, d_mask, BLOCK_SIZE, BLOCK_N, False, HAS_WINDOW, QUANTIZED, PRECISION)
    has_keys = l_i > 0
    l_safe = tl.where(has_keys, l_i, 1.0)
    acc = acc / l_safe[:, None]
    if NUM_SPLITS == 1:
        out = out_ptr + b * stride_ot + heads[:, None] * stride_oh + offs_d[None, :]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_mask)
    else:
        row = (b * (GROUP * tl.num_programs(1)) + heads) * NUM_SPLITS + split   # [BLOCK_G]
        tl.store(part_out + row[:, None] * BLOCK_D + offs_d[None, :], acc, mask=g_mask[:, None])
        lse = tl.where(has_keys, m_i + tl.log2(l_safe), float("-inf"))
        tl.store(part_lse + row, lse, mask=g_mask)


@triton.jit
def _merge_splits_kernel(part_out, part_lse, out_ptr, stride_ot, stride_oh,
                         HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, NUM_SPLITS: tl.constexpr,
                         BLOCK_S: tl.constexpr):
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
    tl.store(out_ptr + b * stride_ot + h * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty),
             mask=offs_d < HEAD_DIM)


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
        q, out, part_out, part_lse, meta.block_tables, meta.seq_lens_tensor, *_cache_args(layer),
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), meta.block_tables.stride(0),
        layer.scale * LOG2E, window,
        GROUP=group, BLOCK_G=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim, BLOCK_D=block_d,
        BLOCK_SIZE=meta.block_size, BLOCK_N=block_n, NUM_SPLITS=splits, HAS_WINDOW=bool(window),
        QUANTIZED=quantized, PRECISION=_dot_precision(q.dtype), num_warps=num_warps, num_stages=2)
    if splits > 1:
        _merge_splits_kernel[(nd, layer.num_heads)](
            part_out, part_lse, out, out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, BLOCK_D=block_d, NUM_SPLITS=splits,
            BLOCK_S=triton.next_power_of_2(splits), num_warps=4)


# --- prefill ------------------------------------------------------------------------------------
@triton.jit
def _prefill_kernel(q_ptr, k_ptr, v_ptr, out_ptr, tiles_ptr, query_start_ptr, seq_lens_ptr, table_ptr,
                    k_cache, v_cache, k_scales, v_scales,
                    stride_ch, stride_cb, stride_ct, stride_sh, stride_sb, stride_st,
                    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh, stride_bt,
                    qk_scale, window,
                    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                    BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    HAS_WINDOW: tl.constexpr, QUANTIZED: tl.constexpr, FRESH_FROM_INPUT: tl.constexpr,
                    PRECISION: tl.constexpr):
    """Program (tile, query head): tiles_ptr [num_tiles, 2] int32 gives the tile's request r and its
    index m among the request's tiles of BLOCK_M query tokens. Query token j of r sits at position
    context + j (context = seq_len - query_len) and sees keys up to it (and within the window).
    q, out [T, Hq, D]; k, v [T, Hkv, D] (the step's new tokens, read only with FRESH_FROM_INPUT
    for a request without context; the cache holds them too)."""
    tile = tl.program_id(0)
    head = tl.program_id(1)
    req = tl.load(tiles_ptr + 2 * tile)
    m_block = tl.load(tiles_ptr + 2 * tile + 1)
    kv_head = head // GROUP
    q_start = tl.load(query_start_ptr + req)
    q_len = tl.load(query_start_ptr + req + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + req)
    context = seq_len - q_len

    rows = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    row_mask = (rows < q_len)[:, None] & d_mask[None, :]
    tokens = (q_start + rows).to(tl.int64)
    q = tl.load(q_ptr + tokens[:, None] * stride_qt + head * stride_qh + offs_d[None, :], mask=row_mask, other=0.0)
    q_pos = context + rows
    end = tl.minimum(seq_len, context + (m_block + 1) * BLOCK_M)  # past the tile's last query
    start = 0
    if HAS_WINDOW:
        start = tl.maximum(context + m_block * BLOCK_M - window + 1, 0)
    m_i = tl.full([BLOCK_M], _NO_MAX, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    from_input = False
    if FRESH_FROM_INPUT:
        from_input = context == 0
    if from_input:
        m_i, l_i, acc = _attend_new_tokens(q, m_i, l_i, acc, q_pos, end, qk_scale,
                                           k_ptr + q_start.to(tl.int64) * stride_kt + kv_head * stride_kh,
                                           v_ptr + q_start.to(tl.int64) * stride_vt + kv_head * stride_vh,
                                           stride_kt, stride_vt, offs_d, d_mask, BLOCK_N, PRECISION)
    else:
        m_i, l_i, acc = _attend_paged(q, m_i, l_i, acc, q_pos, start, end, window, qk_scale,
                                      table_ptr + req.to(tl.int64) * stride_bt,
                                      k_cache, v_cache, k_scales, v_scales,
                                      stride_ch, stride_cb, stride_ct, stride_sh, stride_sb, stride_st, kv_head,
                                      offs_d, d_mask, BLOCK_SIZE, BLOCK_N, True, HAS_WINDOW, QUANTIZED, PRECISION)
    acc = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + tokens[:, None] * stride_ot + head * stride_oh + offs_d[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=row_mask)


@triton.jit
def _attend_new_tokens(q, m_i, l_i, acc, q_pos, end, qk_scale, k_ptr, v_ptr, stride_kt, stride_vt,
                       offs_d, d_mask, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr):
    """Causal attention of a fresh prompt's rows (positions q_pos) to its own keys [0, end), read
    from the step's k, v (k_ptr, v_ptr: the prompt's first token in the kernel's KV head)."""
    for tok in range(0, end, BLOCK_N):
        pos = tok + tl.arange(0, BLOCK_N)
        valid = pos < end
        pos_64 = pos[:, None].to(tl.int64)
        tile_mask = valid[:, None] & d_mask[None, :]
        k = tl.load(k_ptr + pos_64 * stride_kt + offs_d[None, :], mask=tile_mask, other=0.0)
        v = tl.load(v_ptr + pos_64 * stride_vt + offs_d[None, :], mask=tile_mask, other=0.0)
        visible = valid[None, :] & (pos[None, :] <= q_pos[:, None])
        m_i, l_i, acc = _softmax_step(q, k, v, 0.0, 0.0, visible, m_i, l_i, acc, qk_scale, False, PRECISION)
    return m_i, l_i, acc


def _prefill_tiles(meta: AttentionMetadata, block_m: int) -> torch.Tensor:
    """[num_tiles, 2] int32 on the device: (request, tile index) for every BLOCK_M query tokens of
    the prefill requests; built by a step's first layer."""
    key = ("triton_prefill_tiles", block_m)
    if key not in meta.scratch:
        tiles = [(i, m) for i in range(meta.num_decodes, meta.num_reqs)
                 for m in range(-(-meta.query_len(i) // block_m))]
        meta.scratch[key] = to_device(tiles, torch.int32, meta.seq_lens_tensor.device)
    return meta.scratch[key]


def _query_start_loc(meta: AttentionMetadata) -> torch.Tensor:
    """meta.query_start_loc [R + 1] as an int32 device tensor, built by a step's first layer."""
    if "triton_query_start_loc" not in meta.scratch:
        meta.scratch["triton_query_start_loc"] = to_device(meta.query_start_loc, torch.int32,
                                                           meta.seq_lens_tensor.device)
    return meta.scratch["triton_query_start_loc"]


def prefill_attention(layer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                      meta: AttentionMetadata) -> None:
    """Requests [num_decodes, R): their query tokens of q [T, Hq, D] -> out, in one launch."""
    head_dim, window = layer.head_dim, layer.sliding_window or 0
    block_d = _head_block(head_dim)
    block_m, block_n, num_warps = _tiles(_PREFILL_TILES, block_d, q.dtype)
    tiles = _prefill_tiles(meta, block_m)
    quantized = layer.kv_scales is not None
    _prefill_kernel[(tiles.shape[0], layer.num_heads)](
        q, k, v, out, tiles, _query_start_loc(meta), meta.seq_lens_tensor, meta.block_tables, *_cache_args(layer),
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), out.stride(0), out.stride(1),
        meta.block_tables.stride(0), layer.scale * LOG2E, window,
        GROUP=layer.num_heads // layer.num_kv_heads, HEAD_DIM=head_dim, BLOCK_D=block_d,
        BLOCK_SIZE=meta.block_size, BLOCK_M=block_m, BLOCK_N=block_n, HAS_WINDOW=bool(window),
        QUANTIZED=quantized, FRESH_FROM_INPUT=quantized and not window,
        PRECISION=_dot_precision(q.dtype), num_warps=num_warps, num_stages=2)
