"""Blocks of a rank's KV cache in host memory: tensors of the cache's layout with their own number of
blocks (pinned on CUDA, so that copies are asynchronous DMA on the step's stream), and block copies
between two such sets. Used by the offloading tier (kv_tier/copier.py) and by swap preemption
(executor/kv_swap.py)."""

from __future__ import annotations

import torch

BLOCK_DIM = 2  # caches are [2, kv heads, blocks, block_size, ...] (executor/kv_memory.allocate_kv_cache)


def host_blocks_like(tensors: list[torch.Tensor], num_blocks: int) -> list[torch.Tensor]:
    """Host tensors of the same layout with `num_blocks` blocks (pinned when the device is CUDA)."""
    pin = tensors[0].device.type == "cuda"
    return [torch.zeros(with_blocks(t.shape, num_blocks), dtype=t.dtype, device="cpu", pin_memory=pin) for t in tensors]


def copy_blocks(sources: list[torch.Tensor], destinations: list[torch.Tensor], pairs: list[tuple[int, int]]) -> None:
    """Per tensor pair: destination block d = source block s, for each (s, d)."""
    src_ids = torch.tensor([s for s, _ in pairs], dtype=torch.long)
    dst_ids = torch.tensor([d for _, d in pairs], dtype=torch.long)
    for src, dst in zip(sources, destinations):
        blocks = src.index_select(BLOCK_DIM, src_ids.to(src.device))
        dst.index_copy_(BLOCK_DIM, dst_ids.to(dst.device), blocks.to(dst.device, non_blocking=dst.is_cuda))


def with_blocks(shape: torch.Size, num_blocks: int) -> tuple[int, ...]:
    dims = list(shape)
    dims[BLOCK_DIM] = num_blocks
    return tuple(dims)
