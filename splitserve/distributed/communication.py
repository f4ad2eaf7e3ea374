"""The collectives of tensor and pipeline parallelism, each a no-op on a single rank."""

from __future__ import annotations

import torch
import torch.distributed as dist

from splitserve.distributed.parallel_state import get_parallel_rank, pp_group, tp_group, tp_shm


def tp_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """The sum of x over the tensor-parallel ranks (row-parallel outputs, the vocabulary-parallel
    embedding), in place."""
    if get_parallel_rank().tp_size > 1:
        shm = tp_shm()
        if shm is not None and x.device.type == "cpu":
            torch.ops.splitserve_cpu.shm_all_reduce(shm, x)
        else:
            dist.all_reduce(x, group=tp_group())
    return x


def tp_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """The tensor-parallel ranks' x, concatenated along `dim` in rank order (the vocabulary-parallel
    logits)."""
    size = get_parallel_rank().tp_size
    if size == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(size)]
    dist.all_gather(parts, x, group=tp_group())
    return torch.cat(parts, dim=dim)


def tp_broadcast_object(obj, src_tp_rank: int = 0):
    """A picklable object from one tensor-parallel rank to the others."""
    rank = get_parallel_rank()
    if rank.tp_size == 1:
        return obj
    holder = [obj]
    dist.broadcast_object_list(holder, src=rank.pp_rank * rank.tp_size + src_tp_rank, group=tp_group())
    return holder[0]


def pp_send(tensors: list[torch.Tensor]) -> None:
    """Hand a stage's activations to the next stage (the same tensor-parallel rank one stage on)."""
    rank = get_parallel_rank()
    dst = (rank.pp_rank + 1) * rank.tp_size + rank.tp_rank
    for t in tensors:
        dist.send(t.contiguous(), dst, group=pp_group())


def pp_recv(shapes: list[tuple[int, ...]], dtype: torch.dtype, device: torch.device) -> list[torch.Tensor]:
    """Receive the previous stage's activations, of known shapes."""
    rank = get_parallel_rank()
    src = (rank.pp_rank - 1) * rank.tp_size + rank.tp_rank
    out = []
    for shape in shapes:
        t = torch.empty(shape, dtype=dtype, device=device)
        dist.recv(t, src, group=pp_group())
        out.append(t)
    return out
