"""Where this process stands in a distributed engine, and its torch.distributed groups.

Ranks are laid out as vLLM lays them out: tensor-parallel ranks are neighbours, pipeline stages
come in blocks of them (rank = pp_rank * tp_size + tp_rank). One process is one rank; an engine
without parallelism is rank 0 of a world of 1 and needs no process group at all. The state is
per process (a model is built for the rank it runs on), set once by `init_distributed`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ParallelRank:
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    # Mixture-of-experts layers hold whole experts per tensor-parallel rank (--enable-expert-parallel).
    expert_parallel: bool = False

    @property
    def rank(self) -> int:
        return self.pp_rank * self.tp_size + self.tp_rank

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def is_output_rank(self) -> bool:
        """The rank whose sampled tokens the engine reads: the first TP rank of the last stage."""
        return self.is_last_stage and self.tp_rank == 0

    def __str__(self) -> str:
        return f"tensor-parallel rank {self.tp_rank} of {self.tp_size}, pipeline stage {self.pp_rank} of {self.pp_size}"

    @classmethod
    def of(cls, rank: int, tp_size: int, pp_size: int) -> ParallelRank:
        if not 0 <= rank < tp_size * pp_size:
            raise ValueError(f"rank {rank} is outside a world of {tp_size} x {pp_size} ranks.")
        return cls(rank % tp_size, tp_size, rank // tp_size, pp_size)


_RANK = ParallelRank()
_TP_GROUP: dist.ProcessGroup | None = None
_PP_GROUP: dist.ProcessGroup | None = None
_TP_SHM = None  # the TP group's shared-memory sums (distributed/shm_all_reduce.py), CPU ranks of one machine


def get_parallel_rank() -> ParallelRank:
    return _RANK


def tp_group() -> dist.ProcessGroup | None:
    return _TP_GROUP


def tp_shm():
    """The tensor-parallel group's ShmAllReduce, or None where its sums go through the process group."""
    return _TP_SHM


def pp_group() -> dist.ProcessGroup | None:
    return _PP_GROUP


def init_distributed(rank: ParallelRank, init_method: str, device: torch.device, timeout_s: float = 600.0) -> None:
    """Join the world (gloo on CPU, nccl on CUDA) and make this rank's tensor- and pipeline-parallel
    groups. Every rank must call it with the same sizes and init_method."""
    global _RANK, _TP_GROUP, _PP_GROUP, _TP_SHM
    import datetime

    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(
        backend,
        init_method=init_method,
        rank=rank.rank,
        world_size=rank.world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    # Every rank must create every group, in the same order, even those it is not in.
    for pp in range(rank.pp_size):
        group = dist.new_group([pp * rank.tp_size + t for t in range(rank.tp_size)])
        if pp == rank.pp_rank:
            _TP_GROUP = group
    for tp in range(rank.tp_size):
        group = dist.new_group([p * rank.tp_size + tp for p in range(rank.pp_size)])
        if tp == rank.tp_rank:
            _PP_GROUP = group
    if device.type == "cpu" and rank.tp_size > 1:
        from splitserve.distributed import shm_all_reduce

        _TP_SHM = shm_all_reduce.create(_TP_GROUP, rank.tp_rank, rank.tp_size, timeout_s)
    _RANK = rank
    logger.info(
        "Rank %d of %d joined (%s): tensor-parallel rank %d of %d, pipeline stage %d of %d",
        rank.rank,
        rank.world_size,
        backend,
        rank.tp_rank,
        rank.tp_size,
        rank.pp_rank,
        rank.pp_size,
    )


def set_parallel_rank(rank: ParallelRank) -> None:
    """Build models for `rank` without a process group (tests that inspect one rank's shards)."""
    global _RANK
    _RANK = rank


def shutdown_distributed() -> None:
    global _RANK, _TP_GROUP, _PP_GROUP, _TP_SHM
    if dist.is_initialized():
        dist.destroy_process_group()
    _RANK, _TP_GROUP, _PP_GROUP, _TP_SHM = ParallelRank(), None, None, None
