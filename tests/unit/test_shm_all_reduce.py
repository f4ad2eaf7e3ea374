"""Tensor-parallel sums through shared memory (distributed/shm_all_reduce.py, kernels/shm_all_reduce.cpp)
between real processes: the same bits as gloo's all-reduce with two ranks and gloo's sums within
rounding with three, float32 / bfloat16 / float16, tensors larger than a slot (summed slot by
slot), non-contiguous tensors, many calls in a row; a rank that stops coming makes the others fail
with an error naming it instead of hanging."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from splitserve import kernels
from tests.helpers.server import free_port

pytestmark = pytest.mark.skipif(kernels.cpu_ops() is None, reason="needs splitserve's C++ CPU kernels")


def _ranks(rank: int, world: int, port: int) -> None:
    from splitserve.distributed import shm_all_reduce

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    shm_all_reduce.SLOT_BYTES = 4096  # small slots: the larger tensors below go slot by slot
    groups = {3: dist.new_group([0, 1, 2]), 2: dist.new_group([0, 1])}
    mine = {size: shm_all_reduce.create(g, rank, size, 30.0) for size, g in groups.items() if rank < size}
    for size, shm in mine.items():
        assert shm is not None
        for step, (dtype, n) in enumerate([(torch.float32, 7), (torch.bfloat16, 5000), (torch.float16, 3000)] * 3):
            gen = torch.Generator().manual_seed(1000 * step + rank)
            x = torch.randn(n, generator=gen).to(dtype)
            expected = x.clone()
            dist.all_reduce(expected, group=groups[size])
            torch.ops.splitserve_cpu.shm_all_reduce(shm, x)
            if size == 2:
                assert torch.equal(x, expected), (size, dtype, n)
            else:
                assert torch.allclose(x.float(), expected.float(), rtol=1e-2, atol=1e-2), (size, dtype, n)
        # A non-contiguous tensor is summed in place too.
        y = torch.full((4, 6), float(rank + 1)).t()
        torch.ops.splitserve_cpu.shm_all_reduce(shm, y)
        assert torch.equal(y, torch.full((6, 4), float(sum(range(1, size + 1)))))
    dist.barrier()
    # Rank 1 stops coming: rank 0 fails within the timeout, naming it.
    if rank < 2:
        slow = shm_all_reduce.create(groups[2], rank, 2, 1.0)
        if rank == 0:
            with pytest.raises(RuntimeError, match=r"waited more than 1 s for rank\(s\) 1"):
                torch.ops.splitserve_cpu.shm_all_reduce(slow, torch.ones(8))
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.slow  # starts worker processes
def test_shm_sums_equal_gloo_between_processes():
    before = set(os.listdir("/dev/shm"))
    mp.spawn(_ranks, args=(3, free_port()), nprocs=3, join=True)
    left = {f for f in set(os.listdir("/dev/shm")) - before if f.startswith("splitserve-tp-")}
    assert not left  # each segment's file is gone once every rank has mapped it
