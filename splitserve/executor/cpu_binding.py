"""CPU cores per process: instances of a PD deployment and the ranks of one instance each get their
own share of the cores, with one torch thread per core (docs/parallel.md says how to set it by hand).
"Core" here is a CPU the scheduler can run a thread on, a hardware thread where the host has SMT."""

from __future__ import annotations

import contextlib
import logging
import os

from splitserve import envs

logger = logging.getLogger(__name__)

CPU_CORES_ENV = "SPLITSERVE_CPU_CORES"  # set by launchers for their children (read through envs)


def split_cores(count: int, cores: list[int]) -> list[list[int]]:
    """`count` shares of `cores`: disjoint and equal, or one core each, round-robin, when there are
    fewer cores than shares (they then slow each other down)."""
    if len(cores) < count:
        return [[cores[i % len(cores)]] for i in range(count)]
    share = len(cores) // count
    return [cores[i * share : (i + 1) * share] for i in range(count)]


def available_cores() -> list[int]:
    """The cores this process may use: the launcher's share if it gave one, else its affinity."""
    given = envs.SPLITSERVE_CPU_CORES
    return [int(c) for c in given.split(",")] if given else sorted(os.sched_getaffinity(0))


def bind_cpu_cores(cores: list[int]) -> None:
    """Stay on these cores, one torch thread per core."""
    import torch

    os.sched_setaffinity(0, set(cores))
    torch.set_num_threads(len(cores))


THREAD_COUNT_ENVS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")  # read by torch itself at start-up
_threads_chosen = False


def configure_cpu_threads() -> None:
    """A single-rank engine's threads, once per process: the cores a launcher gave
    (SPLITSERVE_CPU_CORES), else one torch thread per CPU this process may use. Torch's own default
    is one thread per physical core, which on a host whose CPUs are hardware threads of fewer cores
    (a 2-vCPU VM on one hyperthreaded core) leaves half of them idle, where `llama-bench -t 2` and
    vLLM's `VLLM_CPU_OMP_THREADS_BIND=0-1` use both. A count the user set (OMP_NUM_THREADS,
    MKL_NUM_THREADS) is kept."""
    global _threads_chosen
    if _threads_chosen:
        return
    _threads_chosen = True
    if envs.SPLITSERVE_CPU_CORES:
        bind_cpu_cores(available_cores())
        return
    import torch

    chosen = next((name for name in THREAD_COUNT_ENVS if os.environ.get(name)), None)
    cpus = available_cores()
    if chosen is not None:
        logger.info("CPU: %d torch threads, as %s=%s says.", torch.get_num_threads(), chosen, os.environ[chosen])
        return
    default = torch.get_num_threads()
    if default != len(cpus):
        torch.set_num_threads(len(cpus))
    logger.info(
        "CPU: %d torch threads, one per CPU this process may use (%s)%s; OMP_NUM_THREADS=N sets another count.",
        len(cpus),
        ",".join(map(str, cpus)),
        f", where torch's default was {default} (one per physical core)" if default != len(cpus) else "",
    )


@contextlib.contextmanager
def one_core_left_to_the_server(forked_from_server: bool):
    """An engine forked from its server loads while that server imports its API modules and the
    tokenizer on one core (about a second): the engine's parallel regions then wait at each barrier
    for the thread the server displaced (on a 2-core host a tiny model's weights took 0.5-0.8 s
    instead of 0.2 s, and the server's imports slowed too). So the engine starts with one torch
    thread fewer than the cores it has, and takes them all once it is ready."""
    import torch

    threads = torch.get_num_threads()
    if not forked_from_server or threads < 2:
        yield
        return
    torch.set_num_threads(threads - 1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
