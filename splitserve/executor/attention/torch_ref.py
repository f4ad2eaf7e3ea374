"""The reference attention backend: plain torch (index_copy + matmuls / SDPA).
It runs on CPU and on CUDA, and is the ground truth that faster kernels are checked against.

A layer's cache is [2 (K, V), num_kv_heads, num_blocks, block_size, head_dim]: gathering a
request's blocks yields [heads, tokens, head_dim] directly, ready for batched matmuls.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from splitserve.executor.attention.backend import AttentionBackend, AttentionMetadata


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def forward(self, layer, q, k, v, meta: AttentionMetadata) -> torch.Tensor:
        k_cache, v_cache = layer.kv_cache[0], layer.kv_cache[1]
        write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
        out = torch.empty_like(q)
        nd = meta.num_decodes
        if nd:
            out[:nd] = _decode(layer, q[:nd], k_cache, v_cache, meta)
        for i in range(nd, meta.num_reqs):
            start, end = meta.query_start_loc[i], meta.query_start_loc[i + 1]
            out[start:end] = _prefill(layer, q[start:end], k[start:end], v[start:end], k_cache, v_cache, meta, i)
        return out


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """k, v: [T, num_kv_heads, head_dim] into the slots (block * block_size + offset) of each token."""
    heads, dim = k_cache.shape[0], k_cache.shape[-1]
    k_cache.view(heads, -1, dim).index_copy_(1, slot_mapping, k.transpose(0, 1))
    v_cache.view(heads, -1, dim).index_copy_(1, slot_mapping, v.transpose(0, 1))


def gather_kv(cache: torch.Tensor, block_tables: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """[num_kv_heads, R, num_blocks * block_size, head_dim]: each request's cached K (or V), in order.
    (index_select on flat ids is three times faster than advanced indexing with the 2-D table.)"""
    ids = block_tables[:, :num_blocks]
    blocks = cache.index_select(1, ids.flatten())  # [H, R * nb, bs, D]
    return blocks.view(cache.shape[0], ids.shape[0], -1, cache.shape[-1])


def _decode(layer, q, k_cache, v_cache, meta: AttentionMetadata) -> torch.Tensor:
    """One query token per request, all requests at once over a padded gather of their blocks.
    Plain batched matmuls: for a single query row they beat SDPA's CPU kernel by far."""
    nd = meta.num_decodes
    num_blocks = -(-max(meta.seq_lens[:nd]) // meta.block_size)
    max_len = num_blocks * meta.block_size  # whole blocks: slicing would make matmul copy them again
    tables = meta.block_tables[:nd]
    group = layer.num_heads // layer.num_kv_heads
    keys = gather_kv(k_cache, tables, num_blocks)                                     # [Hkv, B, L, D]
    values = gather_kv(v_cache, tables, num_blocks)
    queries = q.view(nd, layer.num_kv_heads, group, layer.head_dim).transpose(0, 1)    # [Hkv, B, G, D]
    scores = torch.matmul(queries, keys.transpose(-1, -2)).float() * layer.scale      # [Hkv, B, G, L]
    key_pos = torch.arange(max_len, device=q.device)
    seq_lens = meta.seq_lens_tensor[:nd, None]
    visible = key_pos[None, :] < seq_lens
    if layer.sliding_window:
        visible &= key_pos[None, :] >= seq_lens - layer.sliding_window
    scores.masked_fill_(~visible[None, :, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(values.dtype)
    out = torch.matmul(probs, values)                                                  # [Hkv, B, G, D]
    return out.transpose(0, 1).reshape(nd, layer.num_heads, layer.head_dim)


def _prefill(layer, q, k, v, k_cache, v_cache, meta: AttentionMetadata, i: int) -> torch.Tensor:
    """A prompt chunk of one request: causal attention over its cached context plus the chunk."""
    seq_len, q_len = meta.seq_lens[i], q.shape[0]
    context_len = seq_len - q_len
    gqa = layer.num_heads != layer.num_kv_heads
    if context_len == 0 and not layer.sliding_window:
        # A 4-D call takes SDPA's fused CPU kernel; 3-D inputs fall back to a slower path.
        out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                             v.transpose(0, 1)[None], is_causal=True, scale=layer.scale,
                                             enable_gqa=gqa)
        return out[0].transpose(0, 1)
    num_blocks = -(-seq_len // meta.block_size)
    table = meta.block_tables[i:i + 1]
    keys = gather_kv(k_cache, table, num_blocks)[:, 0, :seq_len]                      # [Hkv, L, D]
    values = gather_kv(v_cache, table, num_blocks)[:, 0, :seq_len]
    q_pos = torch.arange(context_len, seq_len, device=q.device)[:, None]
    key_pos = torch.arange(seq_len, device=q.device)[None, :]
    mask = key_pos <= q_pos
    if layer.sliding_window:
        mask &= key_pos > q_pos - layer.sliding_window
    out = F.scaled_dot_product_attention(q.transpose(0, 1), keys, values, attn_mask=mask,
                                         scale=layer.scale, enable_gqa=gqa)
    return out.transpose(0, 1)
