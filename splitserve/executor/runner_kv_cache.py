"""The model runner's KV cache (a mixin of ModelRunner, executor/model_runner.py): how many blocks a
rank can hold (on CUDA after a profiling pass, executor/gpu_memory.py; on CPU from
SPLITSERVE_CPU_KVCACHE_SPACE), the cache tensors of every attention layer, host blocks for swapped-out
KV and for the offloading tier, and the CPU decode stack bound to them."""

from __future__ import annotations

import logging

import torch

from splitserve.devices import cpu_kv_cache_bytes
from splitserve.executor.cpu_decode_stack import CPUDecodeStack
from splitserve.executor.gpu_memory import profile_cuda_memory
from splitserve.executor.kv_memory import allocate_kv_cache, kv_memory_use
from splitserve.executor.kv_swap import HostKVSwap
from splitserve.kv_tier.copier import KVOffloadCopier

logger = logging.getLogger(__name__)


class RunnerKVCache:
    def kv_bytes_per_block(self) -> int:
        """Of this rank: its layers (pipeline stage) and KV heads (tensor-parallel share)."""
        layers = self.model.attention_layers()
        head = layers[0]
        target = 2 * len(layers) * self.block_size * head.num_kv_heads * self.kv_spec.bytes_per_vector(head.head_dim)
        return target + (self.draft.kv_bytes_per_block() if self.draft is not None else 0)

    def determine_num_blocks(self) -> int:
        cc = self.config.cache_config
        if cc.num_gpu_blocks_override is not None:
            return cc.num_gpu_blocks_override
        if cc.kv_cache_memory_bytes is not None:
            budget = cc.kv_cache_memory_bytes
        elif self.device.type == "cuda":
            profile = profile_cuda_memory(self)
            profile.check(self.kv_bytes_per_block())
            budget = profile.kv_cache_budget
        else:
            budget = cpu_kv_cache_bytes()
        # More blocks than max_num_seqs full-length sequences can use is only wasted memory.
        sc = self.config.scheduler_config
        useful = sc.max_num_seqs * -(-sc.max_model_len // self.block_size)
        return min(budget // self.kv_bytes_per_block(), useful)

    def determine_num_cpu_blocks(self, nbytes: int | None = None) -> int:
        cc = self.config.cache_config
        if nbytes is None and cc.num_cpu_blocks_override is not None:
            return cc.num_cpu_blocks_override
        return (cc.swap_space_bytes if nbytes is None else nbytes) // self.kv_bytes_per_block()

    def _allocate_kv_cache(self, num_blocks: int) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
        return allocate_kv_cache(self.model.attention_layers(), self.kv_spec, self.block_size, self.device, num_blocks)

    def kv_cache_memory(self) -> tuple[int, int]:
        """(bytes allocated, bytes resident) of this rank's KV cache, values and scales."""
        return kv_memory_use(self.kv_caches + (self.kv_scales or []))

    def initialize_kv_cache(self, num_blocks: int, num_cpu_blocks: int = 0, num_offload_blocks: int = 0) -> None:
        """Blocks 0..num_blocks-1 are the block manager's; with CUDA graphs one more is allocated,
        block num_blocks, where padding rows write (see cuda_graph). `num_cpu_blocks`: host blocks
        that preempted requests' KV is swapped to (kv_swap.py); `num_offload_blocks`: the KV
        offloading tier's (kv_tier/copier.py, on with --kv-offloading-size or --kv-cache-dir)."""
        self.kv_caches, self.kv_scales = self._allocate_kv_cache(num_blocks + self.use_cuda_graphs)
        self.swap = HostKVSwap(self.kv_caches, self.kv_scales, num_cpu_blocks) if num_cpu_blocks else None
        if self.config.cache_config.offloads_kv:
            self.offload = KVOffloadCopier(self.kv_caches, self.kv_scales, num_offload_blocks, self.rank.rank)
        if self.draft is not None:
            self.draft.initialize_kv_cache(num_blocks + self.use_cuda_graphs)
        if self.device.type == "cpu":  # deciding builds the CPU kernels: never on another device
            self.decode_stack = CPUDecodeStack.build(self.model, self.backend, self.rank, self.lora_manager is not None)
        spec = self.kv_spec
        logger.info(
            "KV cache: %d blocks of %d tokens (%d tokens, %.2f GiB, %s)",
            num_blocks,
            self.block_size,
            num_blocks * self.block_size,
            num_blocks * self.kv_bytes_per_block() / (1 << 30),
            spec.describe(),
        )
