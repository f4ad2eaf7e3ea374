"""Host memory for the KV of preempted requests (preemption_mode "swap", LMDeploy's
eviction_type="copy"): per layer, a copy of the device cache's layout with `num_cpu_blocks`
blocks (pinned on CUDA, so the copies are asynchronous DMA on the step's stream), and the block
copies a step asks for, made before its forward: out to host first, then in to the device, since
a block freed by a swap-out may be given to a swap-in of the same step.
"""

from __future__ import annotations

import torch

from splitserve.kv_tier.host_blocks import copy_blocks, host_blocks_like


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
