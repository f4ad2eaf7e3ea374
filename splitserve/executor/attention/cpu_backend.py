"""The CPU attention backend: the torch reference, with decode attention in splitserve's C++
kernel. The kernel walks each request's blocks in place, where the reference first gathers them
into a padded copy; quantized KV caches keep the reference's decode (it applies their scales)."""
from __future__ import annotations

import torch

from splitserve import kernels
from splitserve.executor.attention.backend import AttentionMetadata
from splitserve.executor.attention.torch_ref import TorchAttentionBackend


class CPUAttentionBackend(TorchAttentionBackend):
    name = "cpu"

    def decode(self, layer, q: torch.Tensor, meta: AttentionMetadata, out: torch.Tensor) -> None:
        if not kernels.decode_attention_supported(q, layer.kv_cache, layer.kv_scales):
            return super().decode(layer, q, meta, out)
        nd = meta.num_decodes
        kernels.decode_attention(out, q, layer.kv_cache, meta.block_tables[:nd], meta.seq_lens_tensor[:nd],
                                 layer.scale, layer.sliding_window)
