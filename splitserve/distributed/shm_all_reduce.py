"""Tensor-parallel sums through shared memory for the CPU ranks of one machine.

gloo sums over loopback TCP: about a millisecond a call on two cores, and a decode step sums twice
per layer, so a tensor-parallel CPU engine spent more time in its all-reduces than in its layers.
When every rank of a tensor-parallel group runs on the CPU of the same machine (the same hostname
and boot id) and the C++ kernels are built, the group's first rank creates a segment in /dev/shm
(header and one 4 MiB slot per rank), every rank maps it, and the file is unlinked at once (the
mapping stays; nothing is left behind by a crash). The sums then go through
kernels/shm_all_reduce.cpp: each rank copies its tensor into its slot and every rank adds the slots
in rank order (with two ranks, the same bits as gloo's sum). Other collectives (the logits' gather,
broadcasts) stay on gloo. SPLITSERVE_CPU_SHM_ALL_REDUCE=0 keeps gloo for the sums too.
"""

from __future__ import annotations

import logging
import os
import socket
import uuid

import torch
import torch.distributed as dist

from splitserve import envs, kernels

logger = logging.getLogger(__name__)

SLOT_BYTES = 4 << 20  # per rank; larger tensors are summed slot by slot
_SHM_DIR = "/dev/shm"


def _machine() -> str:
    """This machine, as ranks on it see it (containers on one host may share a hostname, not a boot)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def create(group, tp_rank: int, tp_size: int, timeout_s: float):
    """The group's ShmAllReduce, or None (with the reason logged by the first rank) where the sums
    stay on gloo. Every rank of `group` must call it (it exchanges a few objects over gloo)."""
    reason = None
    if not envs.SPLITSERVE_CPU_SHM_ALL_REDUCE:
        reason = "SPLITSERVE_CPU_SHM_ALL_REDUCE=0"
    elif kernels.cpu_ops() is None:
        reason = "the C++ CPU kernels are off or did not build"
    elif not os.path.isdir(_SHM_DIR):
        reason = f"{_SHM_DIR} does not exist"
    machines = [None] * tp_size
    dist.all_gather_object(machines, (_machine(), reason), group=group)
    reasons = {r for _, r in machines if r}
    if len({m for m, _ in machines}) > 1:
        reasons.add("the tensor-parallel ranks run on several machines")
    if reasons:
        if tp_rank == 0:
            logger.info("Tensor-parallel sums go through gloo: %s.", "; ".join(sorted(reasons)))
        return None
    world_bytes = torch.classes.splitserve_cpu.ShmAllReduce.header_bytes(tp_size) + tp_size * SLOT_BYTES
    name = [os.path.join(_SHM_DIR, f"splitserve-tp-{os.getpid()}-{uuid.uuid4().hex[:8]}") if tp_rank == 0 else None]
    if tp_rank == 0:
        torch.from_file(name[0], shared=True, size=world_bytes, dtype=torch.uint8)  # created, zero-filled
    dist.broadcast_object_list(name, src=dist.get_global_rank(group, 0), group=group)
    segment = torch.from_file(name[0], shared=True, size=world_bytes, dtype=torch.uint8)
    dist.barrier(group=group)  # every rank has mapped it: the name can go
    if tp_rank == 0:
        os.unlink(name[0])
        logger.info(
            "Tensor-parallel sums of the %d CPU ranks go through shared memory (%.0f MiB; "
            "SPLITSERVE_CPU_SHM_ALL_REDUCE=0 uses gloo).",
            tp_size,
            world_bytes / (1 << 20),
        )
    return torch.classes.splitserve_cpu.ShmAllReduce(segment, tp_rank, tp_size, SLOT_BYTES, timeout_s)
