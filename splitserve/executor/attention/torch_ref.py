"""The reference attention backend: plain torch (index_copy + matmuls / SDPA).
It runs on CPU and on CUDA, and is the ground truth that faster kernels are checked against.

A layer's cache is [2 (K, V), num_kv_heads, num_blocks, block_size, head_dim]: gathering a
request's blocks yields [heads, tokens, head_dim] directly, ready for batched matmuls.

A quantized cache (`layer.kv_scales` is not None) stores the quantized data in the same layout
(int4: head_dim / 2 bytes) and each cached vector's scale fields in layer.kv_scales
[2, num_kv_heads, num_blocks, block_size, fields]. New k/v are quantized as they are written.
Prefill over cached context dequantizes the blocks it gathers to the model's dtype; decode applies
the scales to its scores and probabilities instead (see _decode). A fresh prompt's attention uses
its unquantized k/v, as vLLM's does.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from splitserve.executor.attention.backend import AttentionBackend, AttentionMetadata
from splitserve.quantization.kv_cache import dequantize_kv, quantize_kv, stored_values


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def forward(self, layer, q, k, v, meta: AttentionMetadata) -> torch.Tensor:
        self.write(layer, k, v, meta)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        nd = meta.num_decodes
        if nd:
            self.decode(layer, q, meta, out)
        if nd < meta.num_reqs:
            self.prefill(layer, q, k, v, meta, out)
        return out

    def write(self, layer, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> None:
        """The step's new k/v [T, Hkv, D] into the layer's cache, quantized if the cache is."""
        if layer.kv_scales is None:
            write_kv(layer.kv_cache[0], layer.kv_cache[1], k, v, meta.slot_mapping)
        else:
            write_quantized_kv(layer.kv_cache, layer.kv_scales, k, v, meta.slot_mapping)

    def decode(self, layer, q: torch.Tensor, meta: AttentionMetadata, out: torch.Tensor) -> None:
        """Attention of the decode requests' single query tokens (the first meta.num_decodes rows of
        q [T, Hq, D]), written into the same rows of out."""
        nd = meta.num_decodes
        out[:nd] = _decode(layer, q[:nd], meta)

    def prefill(self, layer, q, k, v, meta: AttentionMetadata, out: torch.Tensor) -> None:
        """Attention of the prefill requests' tokens (prompts or prompt chunks, after the decodes),
        over their cached context and themselves, written into their rows of out."""
        for i in range(meta.num_decodes, meta.num_reqs):
            start, end = meta.query_start_loc[i], meta.query_start_loc[i + 1]
            out[start:end] = _prefill(layer, q[start:end], k[start:end], v[start:end], meta, i)


def write_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """k, v: [T, num_kv_heads, head_dim] into the slots (block * block_size + offset) of each token."""
    heads, dim = k_cache.shape[0], k_cache.shape[-1]
    k_cache.view(heads, -1, dim).index_copy_(1, slot_mapping, k.transpose(0, 1))
    v_cache.view(heads, -1, dim).index_copy_(1, slot_mapping, v.transpose(0, 1))


def write_quantized_kv(
    cache: torch.Tensor, scales: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Quantize k, v [T, num_kv_heads, head_dim] per token and head, and write data and scales into
    the tokens' slots; K and V go through one quantize call and one copy each for data and scales."""
    data, scale = quantize_kv(torch.stack((k, v)), cache.dtype)  # [2, T, H, packed], [2, T, H, fields]
    heads = cache.shape[1]
    # Through uint8 views: CPU index_copy_ has no float8 kernel, and a copy only moves bytes anyway.
    cache.view(torch.uint8).view(2, heads, -1, cache.shape[-1]).index_copy_(
        2, slot_mapping, data.view(torch.uint8).transpose(1, 2)
    )
    scales.view(2, heads, -1, scales.shape[-1]).index_copy_(2, slot_mapping, scale.transpose(1, 2))


def read_kv(
    layer, block_tables: torch.Tensor, num_blocks: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values [num_kv_heads, R, num_blocks * block_size, head_dim] of the requests' blocks,
    dequantized to `dtype` when the cache is quantized."""
    cache, scales = layer.kv_cache, layer.kv_scales
    keys, values = gather_kv(cache[0], block_tables, num_blocks), gather_kv(cache[1], block_tables, num_blocks)
    if scales is None:
        return keys, values
    return (
        dequantize_kv(keys, gather_kv(scales[0], block_tables, num_blocks), dtype),
        dequantize_kv(values, gather_kv(scales[1], block_tables, num_blocks), dtype),
    )


def gather_kv(cache: torch.Tensor, block_tables: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """[num_kv_heads, R, num_blocks * block_size, head_dim]: each request's cached K (or V), in order.
    (index_select on flat ids is three times faster than advanced indexing with the 2-D table.)"""
    ids = block_tables[:, :num_blocks]
    blocks = cache.index_select(1, ids.flatten())  # [H, R * nb, bs, D]
    return blocks.view(cache.shape[0], ids.shape[0], -1, cache.shape[-1])


def _decode(layer, q, meta: AttentionMetadata) -> torch.Tensor:
    """One query token per request, all requests at once over a padded gather of their blocks.
    Plain batched matmuls: for a single query row they beat SDPA's CPU kernel by far.

    A quantized cache's blocks are not dequantized: a cached vector is x = s * x' (+ m for int4)
    with a scalar s (and m) per token and head, so the scales can multiply the scores and the
    probabilities [Hkv, B, G, L] instead of every element of the blocks [Hkv, B, L, D]:
        q . x = s (q . x') + m sum(q),    sum_t p_t x_t = (p s) . x' + p . m
    which rounds to the model's dtype at the same points as dequantizing first would."""
    nd = meta.num_decodes
    num_blocks = -(-max(meta.seq_lens[:nd]) // meta.block_size)
    max_len = num_blocks * meta.block_size  # whole blocks: slicing would make matmul copy them again
    tables = meta.block_tables[:nd]
    group = layer.num_heads // layer.num_kv_heads
    fields = layer.kv_scales
    keys = gather_kv(layer.kv_cache[0], tables, num_blocks)  # [Hkv, B, L, D]
    values = gather_kv(layer.kv_cache[1], tables, num_blocks)
    queries = q.view(nd, layer.num_kv_heads, group, layer.head_dim).transpose(0, 1)  # [Hkv, B, G, D]
    if fields is None:
        scores = torch.matmul(queries, keys.transpose(-1, -2)).float() * layer.scale  # [Hkv, B, G, L]
    else:
        # float16 cannot hold q . x' for fp8_e5m2's values (up to 57344), nor p s (s = absmax / 57344)
        # without losing bits: float16 works in float32 here (bfloat16 has float32's range).
        work = torch.float32 if q.dtype == torch.float16 else q.dtype
        queries = queries.to(work)
        keys, values = stored_values(keys, work), stored_values(values, work)
        k_fields = gather_kv(fields[0], tables, num_blocks).transpose(-1, -2)  # [Hkv, B, F, L]
        scores = torch.matmul(queries, keys.transpose(-1, -2)).float() * k_fields[:, :, :1]
        if k_fields.shape[2] == 2:  # int4's min
            scores += queries.float().sum(-1, keepdim=True) * k_fields[:, :, 1:]
        scores *= layer.scale
    key_pos = torch.arange(max_len, device=q.device)
    seq_lens = meta.seq_lens_tensor[:nd, None]
    visible = key_pos[None, :] < seq_lens
    if layer.sliding_window:
        visible &= key_pos[None, :] >= seq_lens - layer.sliding_window
    scores.masked_fill_(~visible[None, :, None, :], float("-inf"))
    if fields is None:
        probs = torch.softmax(scores, dim=-1).to(values.dtype)
        out = torch.matmul(probs, values)  # [Hkv, B, G, D]
    else:
        probs = torch.softmax(scores, dim=-1)
        v_fields = gather_kv(fields[1], tables, num_blocks).transpose(-1, -2)  # [Hkv, B, F, L]
        out = torch.matmul((probs * v_fields[:, :, :1]).to(values.dtype), values)
        if v_fields.shape[2] == 2:
            out += torch.matmul(probs, v_fields[:, :, 1:].transpose(-1, -2))  # [Hkv, B, G, 1]
    return out.transpose(0, 1).reshape(nd, layer.num_heads, layer.head_dim).to(q.dtype)


def _prefill(layer, q, k, v, meta: AttentionMetadata, i: int) -> torch.Tensor:
    """A prompt chunk of one request: causal attention over its cached context plus the chunk."""
    seq_len, q_len = meta.seq_lens[i], q.shape[0]
    context_len = seq_len - q_len
    gqa = layer.num_heads != layer.num_kv_heads
    if context_len == 0 and not layer.sliding_window:
        # A 4-D call takes SDPA's fused CPU kernel; 3-D inputs fall back to a slower path.
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None],
            k.transpose(0, 1)[None],
            v.transpose(0, 1)[None],
            is_causal=True,
            scale=layer.scale,
            enable_gqa=gqa,
        )
        return out[0].transpose(0, 1)
    num_blocks = -(-seq_len // meta.block_size)
    table = meta.block_tables[i : i + 1]
    keys, values = read_kv(layer, table, num_blocks, q.dtype)
    keys, values = keys[:, 0, :seq_len], values[:, 0, :seq_len]  # [Hkv, L, D]
    q_pos = torch.arange(context_len, seq_len, device=q.device)[:, None]
    key_pos = torch.arange(seq_len, device=q.device)[None, :]
    mask = key_pos <= q_pos
    if layer.sliding_window:
        mask &= key_pos > q_pos - layer.sliding_window
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), keys, values, attn_mask=mask, scale=layer.scale, enable_gqa=gqa
    )
    return out.transpose(0, 1)
