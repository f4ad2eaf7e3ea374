"""How many API server processes `splitserve serve` starts when `--api-server-count` (`--workers`) is
not given, and how they start (forked or spawned: start_api_workers). On a CPU host one: the model's
own threads need the cores. On a GPU host the model runs on the card, and one API process (HTTP,
JSON, detokenizing, streaming every request's chunks) becomes what caps a busy server (vLLM's
measurements: an API process saturates near a few hundred streams), so the server starts one per 8
CPU cores, at most 4, leaving the rest to the engine's processes. The choice is logged with its
reason. Decided without importing torch (the server starts its engine before its own torch import)."""

from __future__ import annotations

import logging
import os

from splitserve.process_utils import nvidia_driver_present, os_threads

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


def start_api_workers(target, args_for, count: int, fork_baseline: set[int] | None) -> list:
    """Start `count` API server processes running `target(*args_for(index))`. Forked from this process on
    the CPU (`fork_baseline`: its OS threads when its engine was forked, this process then being safe to
    fork) when it has started no thread since, so that each starts with torch, transformers, the config
    and the tokenizer already in memory (a spawned one imports them again: about 2.5 s of CPU each);
    spawned otherwise, saying why."""
    import multiprocessing

    if fork_baseline is None:
        method, why = "spawn", "the engine process was spawned (a GPU host, data parallelism, or spawn asked for)"
    elif started := os_threads() - fork_baseline:  # Python's threads and native pools alike (OpenMP's)
        method, why = "spawn", f"this process started {len(started)} threads since its engine was forked"
    else:
        method, why = "fork", "torch, transformers, the config and the tokenizer already loaded"
    ctx = multiprocessing.get_context(method)
    workers = []
    for index in range(count):
        args = args_for(index)
        if method == "fork":
            target_here, args = _forked_worker, (target, *args)
        else:
            target_here = target
        workers.append(ctx.Process(target=target_here, args=args, name=f"splitserve-api-{index}"))
        workers[-1].start()
    logger.info("Started %d API server processes, %s: %s", count, "forked" if method == "fork" else "spawned", why)
    return workers


def _forked_worker(target, *args) -> None:
    """A forked API process starts as a spawned one would: default signal handlers (the server's unwind
    on SIGTERM is its own), no start-up phases of the server's, and its own log format."""
    import signal

    from splitserve.engine import startup

    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGHUP, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    startup.forget()
    logging.getLogger().handlers.clear()
    target(*args)
