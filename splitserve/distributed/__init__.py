"""Tensor and pipeline parallelism: the process groups of this rank and the collectives the model
layers call (no-ops in a single-rank engine)."""

import importlib

# Each name's module, imported when the name is first asked for: both import torch, which the
# torch-free parts of this package (kv_transfer/stats.py, what the router and the API layer import)
# must not pull in.
_HOMES = {
    "pp_recv": "communication",
    "pp_send": "communication",
    "tp_all_gather": "communication",
    "tp_all_reduce": "communication",
    "tp_broadcast_object": "communication",
    "ParallelRank": "parallel_state",
    "get_parallel_rank": "parallel_state",
    "init_distributed": "parallel_state",
    "shutdown_distributed": "parallel_state",
}

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


def __getattr__(name: str):
    if name in _HOMES:
        return getattr(importlib.import_module(f"splitserve.distributed.{_HOMES[name]}"), name)
    raise AttributeError(f"module 'splitserve.distributed' has no attribute {name!r}")
