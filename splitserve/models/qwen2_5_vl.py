"""Qwen2.5-VL (`Qwen2_5_VLForConditionalGeneration`): Qwen2-VL (models/qwen2_vl.py: dynamic resolution,
2 x 2 merger, M-RoPE) with a tower of RMSNorms and SiLU-gated MLPs whose layers attend within windows
of `window_size` pixels, except the `fullatt_block_indexes` layers, which attend over the whole image.

For the windows, the merged units (2 x 2 patches) are reordered window by window before the layers and
the merged tokens put back in the image's order after the merger, as transformers does; the language
model side is Qwen2-VL's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from splitserve.layers.basic import Linear, RMSNorm
from splitserve.models.qwen2_vl import PatchMerger, Qwen2VisionTransformer, Qwen2VLForConditionalGeneration, VisionBlock


class Qwen2_5VisionBlock(VisionBlock):
    @staticmethod
    def _norm(dim: int, dtype: torch.dtype) -> nn.Module:
        return RMSNorm(dim, 1e-6, dtype)

    @staticmethod
    def _mlp_layers(config, dim: int, dtype: torch.dtype) -> nn.Module:
        mlp, hidden = nn.Module(), config.intermediate_size
        mlp.gate_proj = Linear(dim, [hidden], bias=True, dtype=dtype)
        mlp.up_proj = Linear(dim, [hidden], bias=True, dtype=dtype)
        mlp.down_proj = Linear(hidden, [dim], bias=True, dtype=dtype)
        return mlp

    def _mlp(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp.down_proj(self.act(self.mlp.gate_proj(x)) * self.mlp.up_proj(x))


class Qwen2_5VisionTransformer(Qwen2VisionTransformer):
    block_cls = Qwen2_5VisionBlock

    def __init__(self, config, dtype: torch.dtype):
        super().__init__(config, dtype)
        self.full_attention = set(config.fullatt_block_indexes)
        self.window_units = config.window_size // config.spatial_merge_size // config.patch_size

    def _merger(self, config, dtype: torch.dtype) -> PatchMerger:
        return PatchMerger(config, dtype, RMSNorm(config.hidden_size, 1e-6, dtype), config.out_hidden_size)

    def forward(self, pixels: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        order, window_lengths = self._windows(grids)
        unit = self.merge**2
        x = self._reorder(self._embed_patches(pixels), order, unit)
        angles = self._reorder(self._angles(grids), order, unit)
        cos, sin = angles.cos(), angles.sin()
        frame_lengths = [h * w for t, h, w in grids for _ in range(t)]
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, frame_lengths if i in self.full_attention else window_lengths)
        return self.merger(x)[torch.argsort(order)]

    @staticmethod
    def _reorder(x: torch.Tensor, order: torch.Tensor, unit: int) -> torch.Tensor:
        """Rows in groups of `unit` (one merged token's patches), the groups in `order`."""
        return x.view(-1, unit, x.shape[-1])[order].reshape(x.shape)

    def _windows(self, grids: list[tuple[int, int, int]]) -> tuple[torch.Tensor, list[int]]:
        """The merged units in window order (each frame's grid of units cut into windows of
        window_units x window_units, row by row, the last ones smaller), and the windows' lengths in patches."""
        order, lengths, first, size = [], [], 0, self.window_units
        for t, h, w in grids:
            rows, cols = h // self.merge, w // self.merge
            index = torch.arange(t * rows * cols).view(t, rows, cols) + first
            pad_h, pad_w = -rows % size, -cols % size
            padded = F.pad(index, (0, pad_w, 0, pad_h), value=-1)
            windows = padded.view(t, (rows + pad_h) // size, size, (cols + pad_w) // size, size).permute(0, 1, 3, 2, 4)
            for window in windows.reshape(-1, size * size):
                kept = window[window >= 0]
                if len(kept):
                    order.append(kept)
                    lengths.append(len(kept) * self.merge**2)
            first += t * rows * cols
        return torch.cat(order).to(self.inv_freq.device), lengths


class Qwen2_5_VLForConditionalGeneration(Qwen2VLForConditionalGeneration):
    vision_cls = Qwen2_5VisionTransformer
