"""Qwen2-VL (`Qwen2VLForConditionalGeneration`): images at their own resolution (a grid of 14-pixel
patches, two frames deep), a ViT with 2D rotary positions over the grid, a merger of each 2 x 2 patch
window into one token of the language model, and a Qwen2 language model with multimodal rope
(M-RoPE, layers/rotary.py MRotaryEmbedding): an image token is at (time, row, column) of its grid,
offset by the text before it, and the text after it continues from the largest.

The language model is LlamaForCausalLM on text_config (tensor and pipeline parallelism, quantized
linears, the CPU decode stack all hold); the vision tower sits beside it on the first pipeline stage,
whole on every tensor-parallel rank. `mrope_positions` gives the model runner a prompt's rope
positions (executor/mrope.py); `embed_images` the images' embeddings (executor/encoder_cache.py).
"""

from __future__ import annotations

import copy
from collections.abc import Iterable

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from splitserve.layers.basic import Linear
from splitserve.models.llama import LlamaForCausalLM
from splitserve.models.vision import activation, load_exact, local_name

# Checkpoint prefixes: transformers >= 4.52 saves model.{visual,language_model} and lm_head; older
# checkpoints (the hub's Qwen/Qwen2-VL-*) have visual.* and the language model's layers as model.*.
_PREFIXES = (("model.visual.", "visual."), ("model.language_model.", "model."))


class VisionBlock(nn.Module):
    """Qwen2-VL's: LayerNorms and a GELU MLP (fc1, fc2); Qwen2.5-VL's subclass changes both."""

    def __init__(self, config, dtype: torch.dtype):
        super().__init__()
        dim = vision_width(config)
        self.num_heads, self.head_dim = config.num_heads, dim // config.num_heads
        self.norm1, self.norm2 = self._norm(dim, dtype), self._norm(dim, dtype)
        self.attn = nn.Module()
        self.attn.qkv = Linear(dim, [3 * dim], bias=True, dtype=dtype)
        self.attn.proj = Linear(dim, [dim], bias=True, dtype=dtype)
        self.mlp = self._mlp_layers(config, dim, dtype)
        self.act = activation(config.hidden_act)

    @staticmethod
    def _norm(dim: int, dtype: torch.dtype) -> nn.Module:
        return nn.LayerNorm(dim, eps=1e-6, dtype=dtype)

    @staticmethod
    def _mlp_layers(config, dim: int, dtype: torch.dtype) -> nn.Module:
        mlp, hidden = nn.Module(), int(dim * config.mlp_ratio)
        mlp.fc1, mlp.fc2 = Linear(dim, [hidden], bias=True, dtype=dtype), Linear(hidden, [dim], bias=True, dtype=dtype)
        return mlp

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        x = x + self.attn.proj(self._attention(self.norm1(x), cos, sin, lengths))
        return x + self._mlp(self.norm2(x))

    def _mlp(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp.fc2(self.act(self.mlp.fc1(x)))

    def _attention(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        """Every patch attends to the patches of its own frame (segments of `lengths`). 4-d inputs: the
        fused (flash) CPU kernel takes them, where 3-d ones fall back to the unfused math path."""
        q, k, v = self.attn.qkv(x).view(-1, 3, self.num_heads, self.head_dim).unbind(1)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        out = [
            F.scaled_dot_product_attention(*(t.transpose(0, 1)[None] for t in (qs, ks, vs)))[0].transpose(0, 1)
            for qs, ks, vs in zip(q.split(lengths), k.split(lengths), v.split(lengths))
        ]
        return torch.cat(out).reshape(x.shape[0], -1)


def vision_width(config) -> int:
    """The tower's hidden size: Qwen2-VL's embed_dim, Qwen2.5-VL's hidden_size (its out_hidden_size is the LM's)."""
    return config.hidden_size if hasattr(config, "out_hidden_size") else config.embed_dim


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half rope in float32, as transformers' vision rope: x [N, heads, D], cos/sin [N, D]."""
    x32 = x.float()
    half = torch.cat((-x32[..., x.shape[-1] // 2 :], x32[..., : x.shape[-1] // 2]), dim=-1)
    return (x32 * cos[:, None] + half * sin[:, None]).to(x.dtype)


class PatchMerger(nn.Module):
    """Each 2 x 2 window of patches (consecutive in the processor's order) into one token of the LM."""

    def __init__(self, config, dtype: torch.dtype, norm: nn.Module, out_dim: int):
        super().__init__()
        width = vision_width(config) * config.spatial_merge_size**2
        self.ln_q = norm
        self.mlp = nn.Sequential(
            Linear(width, [width], bias=True, dtype=dtype), nn.GELU(), Linear(width, [out_dim], True, dtype)
        )
        self.width = width

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.width))


class Qwen2VisionTransformer(nn.Module):
    block_cls = VisionBlock

    def __init__(self, config, dtype: torch.dtype):
        super().__init__()
        self.merge, width = config.spatial_merge_size, vision_width(config)
        self.patch_embed = nn.Module()
        kernel = (config.temporal_patch_size, config.patch_size, config.patch_size)
        self.patch_embed.proj = nn.Conv3d(config.in_channels, width, kernel, stride=kernel, bias=False, dtype=dtype)
        self.kernel, self.channels = kernel, config.in_channels
        self.blocks = nn.ModuleList(self.block_cls(config, dtype) for _ in range(config.depth))
        self.merger = self._merger(config, dtype)
        head_dim = width // config.num_heads
        theta = (getattr(config, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
        spatial = head_dim // 2
        self.register_buffer(
            "inv_freq", 1.0 / theta ** (torch.arange(0, spatial, 2, dtype=torch.float) / spatial), persistent=False
        )

    def _merger(self, config, dtype: torch.dtype) -> PatchMerger:
        return PatchMerger(config, dtype, nn.LayerNorm(config.embed_dim, eps=1e-6, dtype=dtype), config.hidden_size)

    def _embed_patches(self, pixels: torch.Tensor) -> torch.Tensor:
        weight = self.patch_embed.proj.weight
        x = self.patch_embed.proj(pixels.to(weight.dtype).view(-1, self.channels, *self.kernel))
        return x.view(pixels.shape[0], -1)

    def forward(self, pixels: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        """pixels [patches, channels * t * p * p] of several images, grids their (t, h, w) -> [tokens, hidden]."""
        x = self._embed_patches(pixels)
        angles = self._angles(grids)
        cos, sin = angles.cos(), angles.sin()
        lengths = [h * w for t, h, w in grids for _ in range(t)]
        for block in self.blocks:
            x = block(x, cos, sin, lengths)
        return self.merger(x)

    def _angles(self, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        """Each patch's rotary angles [patches, head_dim] from its (row, column), patches ordered
        window by window as the processor flattens them."""
        rows = []
        m = self.merge
        for t, h, w in grids:
            hh, ww = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
            shape = (h // m, m, w // m, m)
            hw = torch.stack(
                [hh.reshape(shape).transpose(1, 2).flatten(), ww.reshape(shape).transpose(1, 2).flatten()], -1
            )
            rows.append(hw.repeat(t, 1))
        positions = torch.cat(rows).to(self.inv_freq.device)
        freqs = (positions[..., None].float() * self.inv_freq).flatten(1)  # [N, 2 * spatial / 2]: h's, then w's
        return torch.cat((freqs, freqs), dim=-1)


class Qwen2VLForConditionalGeneration(LlamaForCausalLM):
    vision_cls = Qwen2VisionTransformer
    decodes_as_llama = True  # a decode step is its language model's alone (1D rope): the CPU decode stack runs it

    def __init__(self, config, dtype: torch.dtype, max_position: int, quant_config=None):
        text = copy.copy(config.text_config)
        text.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))  # the outer config's (2B ties)
        super().__init__(text, dtype, max_position, quant_config)
        self.merge = config.vision_config.spatial_merge_size
        if self.model.is_first_stage:
            self.visual = self.vision_cls(config.vision_config, dtype)

    def embed_images(self, images: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
        """Each image's token embeddings [t * h * w / merge^2, hidden], all images in one pass."""
        grids = [tuple(int(v) for v in image["image_grid_thw"]) for image in images]
        embeddings = self.visual(torch.cat([image["pixel_values"] for image in images]), grids)
        return list(embeddings.split([t * h * w // self.merge**2 for t, h, w in grids]))

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def mrope_positions(self, num_tokens: int, features: list) -> tuple[np.ndarray, int]:
        """The prompt's M-RoPE positions [3, num_tokens] and the offset of the tokens after it
        (position = index + delta), from where its images lie and their grids."""
        positions = np.empty((3, num_tokens), dtype=np.int64)
        start = index = 0  # the next text token's position, and its index
        for feature in sorted(features, key=lambda f: f.offset):
            positions[:, index : feature.offset] = np.arange(feature.offset - index) + start
            start += feature.offset - index
            t, h, w = (int(v) for v in feature.data["image_grid_thw"].to_array())
            grid = np.stack(
                np.meshgrid(np.arange(t), np.arange(h // self.merge), np.arange(w // self.merge), indexing="ij")
            )
            positions[:, feature.offset : feature.end] = grid.reshape(3, -1) + start
            start += max(h, w) // self.merge
            index = feature.end
        positions[:, index:] = np.arange(num_tokens - index) + start
        return positions, int(positions.max()) + 1 - num_tokens

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        vision: dict[str, torch.Tensor] = {}

        def language_model_weights():
            for name, tensor in weights:
                local = local_name(name, _PREFIXES)
                if local.startswith("visual."):
                    vision[local.removeprefix("visual.")] = tensor
                else:
                    yield local, tensor

        super().load_weights(language_model_weights())
        if self.model.is_first_stage:
            load_exact(self.visual, vision, "vision tower")

    def _load_keys(self, param_name: str) -> list[str]:
        return [] if param_name.startswith("visual.") else super()._load_keys(param_name)
