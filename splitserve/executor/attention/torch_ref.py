"""The reference attention backend: plain torch (index_copy + scaled_dot_product_attention).
It runs on CPU and on CUDA, and is the ground truth that faster kernels are checked against."""
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
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, v)


def gather_kv(cache: torch.Tensor, block_tables: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """[R, num_blocks * block_size, H, D]: each request's cached K (or V), in order."""
    blocks = cache[block_tables[:, :num_blocks]]  # [R, nb, bs, H, D]
    return blocks.flatten(1, 2)


def _decode(layer, q, k_cache, v_cache, meta: AttentionMetadata) -> torch.Tensor:
    """One query token per request, all requests at once over a padded gather of their blocks.
    Plain batched matmuls: for a single query row they beat SDPA's CPU kernel by far."""
    nd = meta.num_decodes
    max_len = max(meta.seq_lens[:nd])
    num_blocks = -(-max_len // meta.block_size)
    tables = meta.block_tables[:nd]
    group = layer.num_heads // layer.num_kv_heads
    keys = gather_kv(k_cache, tables, num_blocks)[:, :max_len].permute(0, 2, 3, 1)   # [B, Hkv, D, L]
    values = gather_kv(v_cache, tables, num_blocks)[:, :max_len].transpose(1, 2)     # [B, Hkv, L, D]
    queries = q.view(nd, layer.num_kv_heads, group, layer.head_dim)                  # [B, Hkv, G, D]
    scores = torch.matmul(queries, keys).float() * layer.scale                       # [B, Hkv, G, L]
    key_pos = torch.arange(max_len, device=q.device)
    seq_lens = meta.seq_lens_tensor[:nd, None]
    visible = key_pos[None, :] < seq_lens
    if layer.sliding_window:
        visible &= key_pos[None, :] >= seq_lens - layer.sliding_window
    scores.masked_fill_(~visible[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(values.dtype)
    return torch.matmul(probs, values).view(nd, layer.num_heads, layer.head_dim)


def _prefill(layer, q, k, v, k_cache, v_cache, meta: AttentionMetadata, i: int) -> torch.Tensor:
    """A prompt chunk of one request: causal attention over its cached context plus the chunk."""
    seq_len, q_len = meta.seq_lens[i], q.shape[0]
    context_len = seq_len - q_len
    gqa = layer.num_heads != layer.num_kv_heads
    if context_len == 0 and not layer.sliding_window:
        out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                             is_causal=True, scale=layer.scale, enable_gqa=gqa)
        return out.transpose(0, 1)
    num_blocks = -(-seq_len // meta.block_size)
    table = meta.block_tables[i:i + 1]
    keys = gather_kv(k_cache, table, num_blocks)[0, :seq_len].transpose(0, 1)
    values = gather_kv(v_cache, table, num_blocks)[0, :seq_len].transpose(0, 1)
    q_pos = torch.arange(context_len, seq_len, device=q.device)[:, None]
    key_pos = torch.arange(seq_len, device=q.device)[None, :]
    mask = key_pos <= q_pos
    if layer.sliding_window:
        mask &= key_pos > q_pos - layer.sliding_window
    out = F.scaled_dot_product_attention(q.transpose(0, 1), keys, values, attn_mask=mask,
                                         scale=layer.scale, enable_gqa=gqa)
    return out.transpose(0, 1)
