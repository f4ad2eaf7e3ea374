"""LoRA on a Linear, batched over adapters (the segmented matmuls of punica / S-LoRA, in torch).

Each LoRA-capable Linear holds `max_loras` slots. A slot holds one adapter's A (its stacked
matrices' A rows, one after the other, [width, in]) and B transposed ([width, out], scaled, each
stacked matrix's rows in its own output columns), so that one adapter's delta over a run of tokens
is one shrink and one expand: y[run] += (x[run] A^T) B^T, whatever the stacked q/k/v or gate/up.

A step's tokens are ordered so that the rows of one adapter sit together (the runner sorts decodes
by adapter; a prompt's tokens are consecutive anyway): `LoRABatchContext.segments` lists the runs
(start, end, slot), and every layer adds each run's delta, one adapter at a time, never one request
at a time. Rows of the base model are in no run.

Under tensor parallelism a slot holds this rank's share: the B rows of its output columns for a
column-parallel layer, the A columns of its input share for a row-parallel one, whose delta is then
summed over the ranks with the layer's own output (before the bias).
"""

from __future__ import annotations

import torch


class LoRABatchContext:
    """The current step's adapter runs, shared by every LoRA layer of a model."""

    def __init__(self) -> None:
        self.segments: list[tuple[int, int, int]] = []  # (first token, end token, slot)


class LoRASlots:
    def __init__(self, layer, max_loras: int, max_rank: int, context: LoRABatchContext, device: torch.device):
        width = len(layer.output_sizes) * max_rank
        self.layer = layer
        self.context = context
        self.a = torch.zeros(max_loras, width, layer.in_features, dtype=layer.dtype, device=device)
        self.b_t = torch.zeros(max_loras, width, layer.out_features, dtype=layer.dtype, device=device)
        self.width = [0] * max_loras  # rows of each slot in use (0: nothing for this layer)

    def set_slot(self, slot: int, shards: list) -> None:
        """Put an adapter in `slot`: per stacked matrix of the layer, its full checkpoint (A [r, in],
        scaled B [out, r]), or None where the adapter leaves that matrix alone."""
        self.a[slot].zero_()
        self.b_t[slot].zero_()
        row = 0
        for shard, weights in enumerate(shards):
            if weights is None:
                continue
            a, b = weights
            rank = a.shape[0]
            rows, cols = self.layer.checkpoint_slices(shard)
            self.a[slot, row : row + rank].copy_(a[:, cols])
            self.b_t[slot, row : row + rank, self.layer.shard_slice(shard)].copy_(b[rows].T)
            row += rank
        self.width[slot] = row

    def clear_slot(self, slot: int) -> None:
        self.width[slot] = 0

    def add_delta(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """y += each run's adapter delta, in place (y: the layer's output before any bias or reduction)."""
        for start, end, slot in self.context.segments:
            width = self.width[slot]
            if width:
                y[start:end].addmm_(x[start:end] @ self.a[slot, :width].T, self.b_t[slot, :width])
