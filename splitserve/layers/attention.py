"""The attention layer a model calls. It owns no algorithm: the per-step batch description
(`meta`, built by the model runner) carries the backend that writes the paged KV cache and
computes attention, so that CPU and GPU kernels plug in without touching model code."""

from __future__ import annotations

import torch
from torch import nn


class Attention(nn.Module):
    def __init__(
        self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, sliding_window: int | None = None
    ):
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.sliding_window = sliding_window
        self.kv_cache: torch.Tensor | None = None  # [2, num_kv_heads, num_blocks, block_size, head_dim]
        self.kv_scales: torch.Tensor | None = None  # per token and KV head, when the cache is quantized

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta) -> torch.Tensor:
        """q: [T, num_heads, head_dim], k/v: [T, num_kv_heads, head_dim] -> [T, num_heads * head_dim]."""
        assert self.kv_cache is not None, "the KV cache must be bound before the first forward"
        out = meta.backend.forward(self, q, k, v, meta)
        return out.reshape(q.shape[0], self.num_heads * self.head_dim)
