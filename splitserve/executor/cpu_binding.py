"""CPU cores per process: instances of a PD deployment and the ranks of one instance each get their
own share of the cores, with one torch thread per core (docs/parallel.md says how to set it by hand)."""

from __future__ import annotations

import os

from splitserve import envs

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


def apply_cpu_cores_env() -> None:
    if envs.SPLITSERVE_CPU_CORES:
        bind_cpu_cores(available_cores())
