"""What the engine flags left unset become on this machine and device (EngineArgs.create_engine_config,
engine/arg_utils.py): the step's token budget, overlap scheduling, the executor backend for several
ranks, and whether pooling may use the prefix cache."""

from __future__ import annotations

from typing import TYPE_CHECKING

from splitserve.config import ParallelConfig

if TYPE_CHECKING:
    import torch


def pooling_may_cache(model_config) -> bool:
    """Prefix caching skips the cached tokens' forward: MEAN and CLS pooling need every token's."""
    pooler = model_config.pooler_config
    return pooler is None or pooler.pooling_type == "LAST"


def resolve_async_scheduling(asked: bool | None, device: torch.device, parallel: ParallelConfig) -> bool:
    """Overlap pays where the device computes while the host works: on a GPU. A CPU forward runs
    on the host's own cores, so there it only reorders work (it stays available, for testing).
    Pipeline stages run one after another within a step, so with several there is no overlap."""
    if parallel.pipeline_parallel_size > 1:  # asked for too: refused by compatibility.py
        return False
    return device.type == "cuda" if asked is None else asked


def default_executor_backend(world_size: int, device: torch.device) -> str:
    """vLLM's rule: Ray when a Ray cluster is given (RAY_ADDRESS, or Ray already running in this
    process) or the world is larger than this machine's GPUs; else one process per rank here
    (on CPU, ranks share the cores when there are fewer cores than ranks)."""
    import os
    import sys

    ray = sys.modules.get("ray")
    if os.environ.get("RAY_ADDRESS") or (ray is not None and ray.is_initialized()):
        return "ray"
    import torch

    if device.type == "cuda" and world_size > torch.cuda.device_count():
        return "ray"
    return "mp"


def default_step_budget(device: torch.device, max_model_len: int, chunked_prefill: bool) -> int:
    """max_num_batched_tokens when not given. Without chunked prefill a whole prompt must fit.
    With it: 8192 on GPUs; 2048 on CPUs, where smaller prompt chunks mixed with the running decodes
    measured ~8% more output tokens/s than 8192 (docs/cpu-performance.md) and let the first
    requests of a burst start streaming after one chunk instead of after every prompt."""
    if not chunked_prefill:
        return max(8192, max_model_len)
    return 2048 if device.type == "cpu" else 8192
