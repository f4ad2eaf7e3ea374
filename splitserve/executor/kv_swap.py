"""Host memory for the KV of preempted requests (preemption_mode "swap", LMDeploy's
eviction_type="copy"): per layer, a copy of the device cache's layout with `num_cpu_blocks`
blocks (pinned on CUDA, so the copies are asynchronous DMA on the step's stream), and the block
copies a step asks for, made before its forward: out to host first, then in to the device, since
a block freed by a swap-out may be given to a swap-in of the same step.
"""

from __future__ import annotations

import torch

BLOCK_DIM = 2  # caches are [2, kv heads, blocks, block_size, ...] (kv_memory.allocate_kv_cache)


class HostKVSwap:
    def __init__(self, caches: list[torch.Tensor], scales: list[torch.Tensor] | None, num_cpu_blocks: int):
        self.device_tensors = list(caches) + list(scales or [])
        self.host_tensors = host_blocks_like(self.device_tensors, num_cpu_blocks)
        self.num_cpu_blocks = num_cpu_blocks

    def apply(self, swap_out: list[tuple[int, int]], swap_in: list[tuple[int, int]]) -> None:
        if swap_out:
            copy_blocks(self.device_tensors, self.host_tensors, swap_out)
        if swap_in:
            copy_blocks(self.host_tensors, self.device_tensors, swap_in)


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
