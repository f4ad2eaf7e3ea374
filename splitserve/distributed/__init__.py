"""Tensor and pipeline parallelism: the process groups of this rank and the collectives the model
layers call (no-ops in a single-rank engine)."""

from splitserve.distributed.communication import pp_recv, pp_send, tp_all_gather, tp_all_reduce, tp_broadcast_object
from splitserve.distributed.parallel_state import (
    ParallelRank,
    get_parallel_rank,
    init_distributed,
    shutdown_distributed,
)

__all__ = [
    "ParallelRank",
    "get_parallel_rank",
    "init_distributed",
    "shutdown_distributed",
    "pp_recv",
    "pp_send",
    "tp_all_gather",
    "tp_all_reduce",
    "tp_broadcast_object",
]
