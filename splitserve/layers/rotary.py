"""Rotary position embeddings (the rotate-half form of Hugging Face checkpoints), with the
frequency schedules (llama3, linear, yarn, ...) computed by transformers' own rope functions;
dynamic NTK scaling, whose frequencies depend on the sequence length; and log-n attention, a
per-position factor on the queries."""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import nn

from splitserve import kernels


def rope_parameters(config) -> dict:
    params = getattr(config, "rope_parameters", None)
    if params is None:  # transformers < 5 spelled it rope_theta + rope_scaling
        params = dict(getattr(config, "rope_scaling", None) or {})
        params.setdefault("rope_type", params.get("type", "default"))
        params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    return params


def _store_rope_parameters(config, params: dict) -> None:
    """Set `config`'s rope to `params` ({"rope_type", "rope_theta", ...}) where this transformers
    version keeps it."""
    if getattr(config, "rope_parameters", None) is not None:  # transformers >= 5
        config.rope_parameters = dict(params)
    else:
        config.rope_theta = params["rope_theta"]
        config.rope_scaling = None if params["rope_type"] == "default" else dict(params)


def set_rope_scaling(config, scaling: dict | None, theta: float | None = None) -> None:
    """Give `config`'s rope the scaling `scaling` ({"rope_type" or "type": ..., "factor": ...}, as
    config.json's rope_scaling spells it; None: none) and the frequency base `theta` (None: keep
    the config's)."""
    scaling = scaling or {"rope_type": "default"}
    rope_type = scaling.get("rope_type", scaling.get("type"))
    if not isinstance(rope_type, str):
        raise ValueError(f"rope_scaling needs a 'rope_type' (or 'type'), got {scaling!r}.")
    params = {key: value for key, value in scaling.items() if key != "type"}
    params.update(rope_type=rope_type, rope_theta=theta if theta is not None else rope_parameters(config)["rope_theta"])
    _store_rope_parameters(config, params)


def is_dynamic_ntk(config) -> bool:
    """Whether the rope is dynamic NTK: its frequencies then depend on each token's sequence length
    (AttentionMetadata.rope_lengths), not on its position alone."""
    return rope_parameters(config).get("rope_type") == "dynamic"


def inverse_frequencies(config, head_dim: int) -> tuple[torch.Tensor, float]:
    params = rope_parameters(config)
    rope_type = params.get("rope_type", "default")
    if rope_type == "longrope":
        raise ValueError("rope type 'longrope' changes with sequence length and is not supported.")
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

    def cos_sin(
        self, positions: torch.Tensor, dtype: torch.dtype, lengths: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The rotation of every token, [T, 1, D] each: looked up once per forward, used by every
        layer. `lengths` is for the dynamic rope; this one depends on positions only."""
        return self.cos_cache[positions].to(dtype)[:, None, :], self.sin_cache[positions].to(dtype)[:, None, :]


class DynamicNTKRotaryEmbedding(nn.Module):
    """transformers' "dynamic" rope: for a sequence of L tokens past max_position_embeddings M, the
    frequency base grows to base * (factor * L / M - factor + 1) ** (D / (D - 2)).

    transformers recomputes it each forward from L = the highest position + 1, and keys already in
    its cache keep the rotation they were given. Here every token carries its own L
    (AttentionMetadata.rope_lengths: max(its prompt's length, its position + 1)), which is that
    same value for a single sequence and does not depend on how prompts are chunked or batched.
    Computed per token on the device, in float32 as transformers does, with no host sync (so a
    CUDA graph can capture it)."""

    def __init__(self, config, head_dim: int):
        super().__init__()
        params = rope_parameters(config)
        if "factor" not in params:
            raise ValueError(f"Dynamic NTK rope needs a 'factor', got rope parameters {params!r}.")
        self.base, self.factor = float(params["rope_theta"]), float(params["factor"])
        self.original_length = config.max_position_embeddings
        self.exponent = head_dim / (head_dim - 2)
        steps = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim  # on the default device
        self.register_buffer("steps", steps, persistent=False)

    def cos_sin(
        self, positions: torch.Tensor, dtype: torch.dtype, lengths: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        assert lengths is not None, "the dynamic rope needs each token's sequence length"
        seq_len = lengths.clamp(min=self.original_length).float()
        base = self.base * (self.factor * seq_len / self.original_length - (self.factor - 1)) ** self.exponent
        inv_freq = 1.0 / (base[:, None] ** self.steps[None, :])
        freqs = positions.float()[:, None] * inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype)[:, None, :], emb.sin().to(dtype)[:, None, :]


class MRotaryEmbedding(RotaryEmbedding):
    """Qwen2-VL's multimodal rope (M-RoPE): a token has three positions (time, height, width; equal
    for text tokens) and each section of the rotary frequencies (`mrope_section`, e.g. [16, 24, 24]
    of head_dim / 2) turns by one of them. Positions [3, T] for a step with images' tokens; [T]
    (text and decodes, where the three are equal) is the plain rope of the same table."""

    def __init__(self, config, head_dim: int, max_position: int):
        super().__init__(config, head_dim, max_position)
        sections = rope_parameters(config)["mrope_section"]
        if sum(sections) != head_dim // 2:
            raise ValueError(f"mrope_section {sections} does not cover head_dim / 2 = {head_dim // 2}.")
        component = torch.cat([torch.full((n,), i % 3, dtype=torch.long) for i, n in enumerate(sections)])
        self.register_buffer("component", torch.cat((component, component)), persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype, lengths: torch.Tensor | None = None):
        if positions.dim() == 1:
            return super().cos_sin(positions, dtype)
        index = self.component[None, :, None].expand(positions.shape[1], -1, 1)
        cos = self.cos_cache[positions].permute(1, 2, 0).gather(-1, index)  # [T, D, 1]: component d's angle
        sin = self.sin_cache[positions].permute(1, 2, 0).gather(-1, index)
        return cos.to(dtype).transpose(1, 2).contiguous(), sin.to(dtype).transpose(1, 2).contiguous()


def rotary_embedding(config, head_dim: int, max_position: int) -> RotaryEmbedding | DynamicNTKRotaryEmbedding:
    """The fixed table for position-only schedules; the per-token computation only for dynamic NTK,
    so that the other models keep their one table lookup per forward."""
    if is_dynamic_ntk(config):
        return DynamicNTKRotaryEmbedding(config, head_dim)
    if "mrope_section" in rope_parameters(config):
        return MRotaryEmbedding(config, head_dim, max_position)
    return RotaryEmbedding(config, head_dim, max_position)


def logn_training_length(config) -> int | None:
    """log-n attention (Qwen-1's use_logn_attn, LMDeploy's use_logn_attn): the training length L
    that query scaling starts after (config seq_length, else max_position_embeddings); None: off."""
    if not getattr(config, "use_logn_attn", False):
        return None
    length = getattr(config, "seq_length", None) or config.max_position_embeddings
    if length < 2:
        raise ValueError(f"log-n attention needs a training length of at least 2, got {length}.")
    return length


def logn_query_scale(positions: torch.Tensor, training_length: int, dtype: torch.dtype) -> torch.Tensor:
    """Qwen-1's factor for the query at 0-based position p: log(p + 1) / log(L) once p + 1 > L, else
    1 (its table logn_list[p] = log_L(p + 1) if p + 1 > L else 1). [T, 1, 1]."""
    count = (positions + 1).float()
    scale = torch.where(count > training_length, torch.log(count) / math.log(training_length), 1.0)
    return scale.to(dtype)[:, None, None]


class PositionEncoding(NamedTuple):
    """What every layer of one forward applies to its q and k: the rotation, [T, 1, D] each, and
    with log-n attention the queries' factor [T, 1, 1]."""

    cos: torch.Tensor
    sin: torch.Tensor
    query_scale: torch.Tensor | None = None


def apply_rotary(q: torch.Tensor, k: torch.Tensor, encoding: PositionEncoding):
    """q: [T, Hq, D], k: [T, Hkv, D], rotated by their positions' encoding (in place on CPU: the
    returned tensors are the ones to use); the queries then scaled by log-n attention's factor."""
    q, k = kernels.apply_rotary(q, k, encoding.cos, encoding.sin)
    if encoding.query_scale is not None:
        q = q * encoding.query_scale
    return q, k
