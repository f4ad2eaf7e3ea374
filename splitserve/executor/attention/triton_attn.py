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

import torch
import triton
import triton.language as tl

from splitserve.executor.attention.backend import AttentionBackend, AttentionMetadata
from splitserve.executor.attention.torch_ref import write_kv, write_quantized_kv
from splitserve.executor.attention.triton_common import (
    _NO_MAX,
    _PREFILL_TILES,
    LOG2E,
    MAX_HEAD_DIM,
    _attend_paged,
    _cache_args,
    _dot_precision,
    _head_block,
    _softmax_step,
    _tiles,
    _value_norm,
)
from splitserve.executor.attention.triton_decode import decode_attention
from splitserve.executor.host import to_device


class TritonAttentionBackend(AttentionBackend):
    name = "triton"
    supports_cuda_graphs = True

    def forward(self, layer, q, k, v, meta: AttentionMetadata) -> torch.Tensor:
        if layer.head_dim > MAX_HEAD_DIM:
            raise ValueError(
                f"The Triton attention backend supports head_dim up to {MAX_HEAD_DIM}, not "
                f"{layer.head_dim}; use SPLITSERVE_ATTENTION_BACKEND=torch."
            )
        if layer.kv_scales is None:
            write_kv(layer.kv_cache[0], layer.kv_cache[1], k, v, meta.slot_mapping)
        else:
            if layer.kv_scales.shape[-1] != 1:
                raise ValueError(
                    "The Triton attention backend has no kernel for an int4 KV cache; "
                    "use SPLITSERVE_ATTENTION_BACKEND=torch."
                )
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


@triton.jit
def _prefill_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    out_ptr,
    tiles_ptr,
    query_start_ptr,
    seq_lens_ptr,
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
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_ot,
    stride_oh,
    stride_bt,
    qk_scale,
    window,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    QUANTIZED: tl.constexpr,
    V_NORM: tl.constexpr,
    FRESH_FROM_INPUT: tl.constexpr,
    PRECISION: tl.constexpr,
):
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
        m_i, l_i, acc = _attend_new_tokens(
            q,
            m_i,
            l_i,
            acc,
            q_pos,
            end,
            qk_scale,
            k_ptr + q_start.to(tl.int64) * stride_kt + kv_head * stride_kh,
            v_ptr + q_start.to(tl.int64) * stride_vt + kv_head * stride_vh,
            stride_kt,
            stride_vt,
            offs_d,
            d_mask,
            BLOCK_N,
            PRECISION,
        )
    else:
        m_i, l_i, acc = _attend_paged(
            q,
            m_i,
            l_i,
            acc,
            q_pos,
            start,
            end,
            window,
            qk_scale,
            table_ptr + req.to(tl.int64) * stride_bt,
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
            True,
            HAS_WINDOW,
            QUANTIZED,
            V_NORM,
            PRECISION,
        )
    acc = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(
        out_ptr + tokens[:, None] * stride_ot + head * stride_oh + offs_d[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=row_mask,
    )


@triton.jit
def _attend_new_tokens(
    q,
    m_i,
    l_i,
    acc,
    q_pos,
    end,
    qk_scale,
    k_ptr,
    v_ptr,
    stride_kt,
    stride_vt,
    offs_d,
    d_mask,
    BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
):
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
        m_i, l_i, acc = _softmax_step(q, k, v, 0.0, 0.0, visible, m_i, l_i, acc, qk_scale, False, 1.0, PRECISION)
    return m_i, l_i, acc


def _prefill_tiles(meta: AttentionMetadata, block_m: int) -> torch.Tensor:
    """[num_tiles, 2] int32 on the device: (request, tile index) for every BLOCK_M query tokens of
    the prefill requests; built by a step's first layer."""
    key = ("triton_prefill_tiles", block_m)
    if key not in meta.scratch:
        tiles = [
            (i, m) for i in range(meta.num_decodes, meta.num_reqs) for m in range(-(-meta.query_len(i) // block_m))
        ]
        meta.scratch[key] = to_device(tiles, torch.int32, meta.seq_lens_tensor.device)
    return meta.scratch[key]


def _query_start_loc(meta: AttentionMetadata) -> torch.Tensor:
    """meta.query_start_loc [R + 1] as an int32 device tensor, built by a step's first layer."""
    if "triton_query_start_loc" not in meta.scratch:
        meta.scratch["triton_query_start_loc"] = to_device(
            meta.query_start_loc, torch.int32, meta.seq_lens_tensor.device
        )
    return meta.scratch["triton_query_start_loc"]


def prefill_attention(
    layer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, meta: AttentionMetadata
) -> None:
    """Requests [num_decodes, R): their query tokens of q [T, Hq, D] -> out, in one launch."""
    head_dim, window = layer.head_dim, layer.sliding_window or 0
    block_d = _head_block(head_dim)
    block_m, block_n, num_warps = _tiles(_PREFILL_TILES, block_d, q.dtype)
    tiles = _prefill_tiles(meta, block_m)
    quantized = layer.kv_scales is not None
    _prefill_kernel[(tiles.shape[0], layer.num_heads)](
        q,
        k,
        v,
        out,
        tiles,
        _query_start_loc(meta),
        meta.seq_lens_tensor,
        meta.block_tables,
        *_cache_args(layer),
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        out.stride(0),
        out.stride(1),
        meta.block_tables.stride(0),
        layer.scale * LOG2E,
        window,
        GROUP=layer.num_heads // layer.num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        BLOCK_SIZE=meta.block_size,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        HAS_WINDOW=bool(window),
        QUANTIZED=quantized,
        V_NORM=_value_norm(layer),
        FRESH_FROM_INPUT=quantized and not window,
        PRECISION=_dot_precision(q.dtype),
        num_warps=num_warps,
        num_stages=2,
    )
