"""The CPU attention backend: the torch reference, with the paged-cache work in splitserve's C++
kernels: KV writes in one call per layer, decode attention that walks each request's blocks in
place (the reference first gathers them into a padded copy), and prompt attention for all the
prefill requests of a step in one call per layer (the reference makes one SDPA call per request).
Quantized KV caches keep the reference's write, decode and prefill (they quantize and apply
scales)."""

from __future__ import annotations

import torch

from splitserve import kernels
from splitserve.executor.attention.backend import AttentionMetadata
from splitserve.executor.attention.torch_ref import TorchAttentionBackend


class CPUAttentionBackend(TorchAttentionBackend):
    name = "cpu"

    def write(self, layer, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> None:
        if not kernels.paged_kv_supported(k, layer.kv_cache, layer.kv_scales):
            return super().write(layer, k, v, meta)
        kernels.write_kv(layer.kv_cache, k, v, meta.slot_mapping)

    def decode(self, layer, q: torch.Tensor, meta: AttentionMetadata, out: torch.Tensor) -> None:
        if not kernels.paged_kv_supported(q, layer.kv_cache, layer.kv_scales):
            return super().decode(layer, q, meta, out)
        kernels.decode_attention(
            out,
            q,
            layer.kv_cache,
            meta.block_tables,
            meta.seq_lens_tensor,
            meta.num_decodes,
            layer.scale,
            layer.sliding_window,
        )

    def prefill(self, layer, q, k, v, meta: AttentionMetadata, out: torch.Tensor) -> None:
        if not kernels.paged_kv_supported(q, layer.kv_cache, layer.kv_scales):
            return super().prefill(layer, q, k, v, meta, out)
        starts = meta.query_start_tensor()
        kernels.prefill_attention(
            out,
            q,
            layer.kv_cache,
            meta.block_tables,
            meta.seq_lens_tensor,
            starts,
            meta.num_decodes,
            layer.scale,
            layer.sliding_window,
        )
