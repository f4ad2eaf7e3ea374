"""LoRA on a Linear, batched over adapters: a whole step's deltas in one shrink and one expand per
layer, whatever mix of adapters its tokens use.

Each LoRA-capable Linear holds `max_loras` slots. A slot holds one adapter's A (its stacked
matrices' A rows one after the other, [width, in]) and B transposed ([width, out], scaled, each
stacked matrix's rows in its own output columns), zero-padded to the layer's slot width (the number
of stacked matrices times max_lora_rank). Viewed together the slots are one matrix A [slots x width,
in] and one B [slots x width, out], so that a step's delta is

    y += ((x A^T) * mask) B

where the mask keeps, for each token, only the columns of its own adapter's slot (and none for a
token of the base model): three kernels per layer for any mix of adapters, instead of two small
matmuls per adapter, whose fixed cost dominates on a CPU. Only the slots up to the highest one the
step uses take part. A step whose tokens all use one adapter skips the mask.

A step's tokens come in runs (start, end, slot), set by the runner in `LoRABatchContext`; the masks
are built once per step and slot width, and shared by the layers.

Under tensor parallelism a slot holds this rank's share: the B columns of its outputs for a
column-parallel layer, the A columns of its inputs for a row-parallel one, whose delta is then
summed over the ranks with the layer's own output (before the bias).
"""

from __future__ import annotations

import torch


class LoRABatchContext:
    """The current step's adapter runs, shared by every LoRA layer of a model."""

    def __init__(self) -> None:
        self.segments: list[tuple[int, int, int]] = []  # (first token, end token, slot)
        self.num_tokens = 0
        self.num_slots = 0  # slots 0..num_slots-1 take part in this step
        self.single_slot: int | None = None  # every token runs with this one slot
        self._masks: dict[tuple[int, torch.dtype, torch.device], torch.Tensor] = {}

    def set_step(self, segments: list[tuple[int, int, int]], num_tokens: int) -> None:
        self.segments, self.num_tokens = segments, num_tokens
        self.num_slots = max((slot for _, _, slot in segments), default=-1) + 1
        whole = len(segments) == 1 and segments[0][0] == 0 and segments[0][1] == num_tokens
        self.single_slot = segments[0][2] if whole else None
        self._masks = {}

    def clear(self) -> None:
        self.set_step([], 0)

    def mask(self, width: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """[tokens, num_slots * width]: 1 in the columns of each token's slot, else 0."""
        key = (width, dtype, device)
        mask = self._masks.get(key)
        if mask is None:
            mask = torch.zeros(self.num_tokens, self.num_slots, width, dtype=dtype)
            for start, end, slot in self.segments:
                mask[start:end, slot] = 1
            mask = mask.view(self.num_tokens, -1).to(device)
            self._masks[key] = mask
        return mask


class LoRASlots:
    def __init__(self, layer, max_loras: int, max_rank: int, context: LoRABatchContext, device: torch.device):
        self.width = len(layer.output_sizes) * max_rank
        self.layer = layer
        self.context = context
        self.a = torch.zeros(max_loras, self.width, layer.in_features, dtype=layer.dtype, device=device)
        self.b_t = torch.zeros(max_loras, self.width, layer.out_features, dtype=layer.dtype, device=device)
        self.used = [0] * max_loras  # rows of each slot in use (0: this layer has nothing in that slot)

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
        self.used[slot] = row

    def clear_slot(self, slot: int) -> None:
        self.a[slot].zero_()
        self.b_t[slot].zero_()
        self.used[slot] = 0

    def add_delta(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """y += each token's adapter delta, in place (y: the layer's output before any bias or reduction)."""
        ctx = self.context
        if not ctx.segments:
            return
        if ctx.single_slot is not None:
            slot = ctx.single_slot
            used = self.used[slot]
            if used:
                y.addmm_(x @ self.a[slot, :used].T, self.b_t[slot, :used])
            return
        n = ctx.num_slots
        shrunk = x @ self.a[:n].reshape(n * self.width, -1).T
        shrunk.mul_(ctx.mask(self.width, shrunk.dtype, shrunk.device))
        y.addmm_(shrunk, self.b_t[:n].reshape(n * self.width, -1))
