"""Rotary position embeddings (the rotate-half form of Hugging Face checkpoints), with the
frequency schedules (llama3, linear, yarn, ...) computed by transformers' own rope functions."""

from __future__ import annotations

import torch
from torch import nn

from splitserve import kernels

_POSITION_DEPENDENT = ("dynamic", "longrope")


def rope_parameters(config) -> dict:
    params = getattr(config, "rope_parameters", None)
    if params is None:  # transformers < 5 spelled it rope_theta + rope_scaling
        params = dict(getattr(config, "rope_scaling", None) or {})
        params.setdefault("rope_type", params.get("type", "default"))
        params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    return params


def inverse_frequencies(config, head_dim: int) -> tuple[torch.Tensor, float]:
    params = rope_parameters(config)
    rope_type = params.get("rope_type", "default")
    if rope_type in _POSITION_DEPENDENT:
        raise ValueError(f"rope type {rope_type!r} changes with sequence length and is not supported.")
    if rope_type == "default":
        exponent = torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim
        return 1.0 / (params["rope_theta"] ** exponent), 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise ValueError(f"Unknown rope type {rope_type!r}; known: default, {', '.join(ROPE_INIT_FUNCTIONS)}.")
    with torch.device("cpu"):  # they allocate on the default device, which a model build may have set
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"))
    return inv_freq, float(scaling)


class RotaryEmbedding(nn.Module):
    def __init__(self, config, head_dim: int, max_position: int):
        super().__init__()
        inv_freq, scaling = inverse_frequencies(config, head_dim)
        positions = torch.arange(max_position, dtype=torch.float)  # on the default device (cuda, meta ...)
        freqs = positions[:, None] * inv_freq.to(positions.device)[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos_cache", emb.cos() * scaling, persistent=False)
        self.register_buffer("sin_cache", emb.sin() * scaling, persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The rotation of every token, [T, 1, D] each: looked up once per forward, used by every layer."""
        return self.cos_cache[positions].to(dtype)[:, None, :], self.sin_cache[positions].to(dtype)[:, None, :]


def apply_rotary(q: torch.Tensor, k: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]):
    """q: [T, Hq, D], k: [T, Hkv, D], rotated by RotaryEmbedding.cos_sin of their positions
    (in place on CPU: the returned tensors are the ones to use)."""
    return kernels.apply_rotary(q, k, *cos_sin)
