"""How much GPU memory the KV cache may take, as vLLM decides it: after the weights are loaded, a
profiling forward pass of the largest step the scheduler can make measures the activation peak;
the cache gets what `gpu_memory_utilization` of the GPU leaves once the weights, everything else
on the GPU (other processes included) and that peak are set aside. The profiling pass itself is
`run_largest_step` (ModelRunner.profile_run)."""

from __future__ import annotations

import gc
import logging
from dataclasses import dataclass

import torch

from splitserve.executor.host import to_device
from splitserve.executor.input_batch import CachedRequestState, InputBatch
from splitserve.executor.sampler import SamplingMetadata
from splitserve.executor.step_input import ScheduledRequest
from splitserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

_GIB = float(1 << 30)


@dataclass
class MemoryProfile:
    total: int  # the GPU's memory
    free: int  # free after loading the weights (and emptying torch's cache)
    weights: int  # what torch had allocated before the profiling pass: the weights
    activation_peak: int  # the profiling pass's peak above that, its throwaway KV cache excluded
    utilization: float
    num_tokens: int  # tokens in the profiling pass

    @property
    def kv_cache_budget(self) -> int:
        """Bytes for the KV cache: what utilization allows beyond what is already used, less the
        room that the largest step's activations need. May be <= 0 (see check)."""
        return int(self.free - self.total * (1.0 - self.utilization) - self.activation_peak)

    def describe(self) -> str:
        return (
            f"{self.total / _GIB:.1f} GiB total, {(self.total - self.free) / _GIB:.2f} GiB in use after "
            f"loading (weights {self.weights / _GIB:.2f} GiB), activation peak "
            f"{self.activation_peak / _GIB:.2f} GiB for a {self.num_tokens}-token step; "
            f"gpu_memory_utilization={self.utilization:g} leaves "
            f"{max(self.kv_cache_budget, 0) / _GIB:.2f} GiB for the KV cache"
        )

    def check(self, bytes_per_block: int) -> None:
        if self.kv_cache_budget < bytes_per_block:
            raise ValueError(
                f"No GPU memory is left for the KV cache: {self.describe()}. Raise --gpu-memory-utilization, "
                "lower --max-num-batched-tokens or --max-num-seqs (smaller activations), use a quantized "
                "model, or free the GPU of other processes."
            )


def profile_cuda_memory(runner) -> MemoryProfile:
    """Run runner.profile_run() and measure it. CUDA only."""
    device = runner.device
    gc.collect()  # an engine dropped just before (held by reference cycles) must not count as in use
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    num_tokens, throwaway_cache = runner.profile_run()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before - throwaway_cache
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    profile = MemoryProfile(
        total=total,
        free=free,
        weights=before,
        activation_peak=max(peak, 0),
        utilization=runner.config.cache_config.gpu_memory_utilization,
        num_tokens=num_tokens,
    )
    logger.info("GPU memory: %s.", profile.describe())
    return profile


@torch.inference_mode()
def run_largest_step(runner) -> tuple[int, int]:
    """The largest step the scheduler can make, on dummy tokens: max_step_tokens prompt tokens
    (the budget and the prompt tails it may finish) spread over up to max_num_seqs requests,
    then logits and top-k/top-p sampling for max_num_seqs rows, over a throwaway KV cache of
    just the blocks it needs. Returns (tokens in the step, bytes of the throwaway cache), for
    measuring the activation peak (profile_cuda_memory)."""
    sc = runner.config.scheduler_config
    num_tokens = min(sc.max_step_tokens, sc.max_num_seqs * sc.max_model_len)
    num_seqs = min(sc.max_num_seqs, num_tokens)
    lens = [num_tokens // num_seqs + (i < num_tokens % num_seqs) for i in range(num_seqs)]
    rows, num_blocks = [], 0
    for i, n in enumerate(lens):
        count = -(-n // runner.block_size)
        state = CachedRequestState(
            f"profile-{i}", [0] * n, SamplingParams(), set(), list(range(num_blocks, num_blocks + count))
        )
        rows.append((state, ScheduledRequest(state.request_id, 0, n, [0] * n, [], samples=False)))
        num_blocks += count
    bound = [(layer.kv_cache, layer.kv_scales) for layer in runner.model.attention_layers()]
    runner._allocate_kv_cache(num_blocks)
    batch = InputBatch.build(rows, runner.block_size)
    meta = runner._attention_metadata(batch)
    dev = runner.device
    hidden = runner._forward(
        to_device(batch.input_ids, torch.long, dev), to_device(batch.positions, torch.long, dev), meta
    )
    if hidden is not None:
        last_tokens = [meta.query_start_loc[i % num_seqs + 1] - 1 for i in range(sc.max_num_seqs)]
        logits = runner.model.compute_logits(hidden[last_tokens])
        vocab = logits.shape[-1]
        runner.sampler(
            logits,
            SamplingMetadata(
                temperature=torch.ones(len(logits), device=dev),
                all_greedy=False,
                top_k=torch.full((len(logits),), vocab // 2, dtype=torch.long, device=dev),
                top_p=torch.full((len(logits),), 0.9, device=dev),
            ),
        )
    for layer, (cache, scales) in zip(runner.model.attention_layers(), bound):
        layer.kv_cache, layer.kv_scales = cache, scales
    return num_tokens, num_blocks * runner.kv_bytes_per_block()
