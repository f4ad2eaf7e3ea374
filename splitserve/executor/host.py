"""Moving a step's inputs and outputs between host and GPU without stalling the host.

A plain host-to-GPU copy from pageable memory makes the host wait until the GPU has finished all
the work queued before it, and reading a GPU tensor (`.tolist()`) waits for all the work queued
so far. With overlap scheduling the GPU's queue already holds the next step, so the model runner
copies through pinned memory asynchronously, and reads a step's sampled tokens after an event
recorded right after that step. On CPU these are the plain tensors.
"""

from __future__ import annotations

import torch


def to_device(values, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host list (or nested list) as a tensor on `device`."""
    return move(torch.tensor(values, dtype=dtype), device)


def move(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device`: on CUDA, staged in pinned memory and copied asynchronously (torch's
    pinned allocator keeps the staging buffer until the copy is done)."""
    if device.type != "cuda":
        return tensor
    return tensor.pin_memory().to(device, non_blocking=True)


def start_host_copy(tensor: torch.Tensor) -> torch.Tensor:
    """Start copying a device tensor into pinned host memory; read it once StepReady.wait() returns."""
    if tensor.device.type != "cuda":
        return tensor
    out = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    return out.copy_(tensor, non_blocking=True)


class StepReady:
    """Marks the point in the GPU's queue after one step's work; wait() blocks until it is reached
    (and not until the later steps queued behind it are done)."""

    def __init__(self, device: torch.device):
        self.event = None
        if device.type == "cuda":
            self.event = torch.cuda.Event()
            self.event.record()

    def wait(self) -> None:
        if self.event is not None:
            self.event.synchronize()
