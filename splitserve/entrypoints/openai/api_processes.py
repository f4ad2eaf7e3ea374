"""How many API server processes `splitserve serve` starts when `--api-server-count` (`--workers`) is
not given. On a CPU host one: the model's own threads need the cores. On a GPU host the model runs on
the card, and one API process (HTTP, JSON, detokenizing, streaming every request's chunks) becomes
what caps a busy server (vLLM's measurements: an API process saturates near a few hundred streams),
so the server starts one per 8 CPU cores, at most 4, leaving the rest to the engine's processes. The
choice is logged with its reason. Decided without importing torch (the server starts its engine
before its own torch import)."""

from __future__ import annotations

import logging
import os

from splitserve.process_utils import nvidia_driver_present

logger = logging.getLogger(__name__)

CORES_PER_API_PROCESS = 8
MAX_DEFAULT_API_PROCESSES = 4


def is_gpu_host(device: str) -> bool:
    """Whether the engine will run on a GPU: `--device cuda`, or `auto` on a host with NVIDIA's driver."""
    if device == "auto":
        return nvidia_driver_present()
    return device.startswith("cuda")


def default_api_server_count(device: str, cores: int | None = None) -> int:
    cores = cores if cores is not None else len(os.sched_getaffinity(0))
    if not is_gpu_host(device):
        return 1
    count = max(1, min(MAX_DEFAULT_API_PROCESSES, cores // CORES_PER_API_PROCESS))
    logger.info(
        "API server processes: %d (a GPU host with %d CPU cores: one per %d cores, at most %d, so that the API "
        "side keeps up with the GPU at high concurrency; --api-server-count N to choose)",
        count,
        cores,
        CORES_PER_API_PROCESS,
        MAX_DEFAULT_API_PROCESSES,
    )
    return count
