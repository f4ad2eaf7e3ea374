"""Vision encoders of vision-language models: the ViTs of CLIP and SigLIP, as the towers of LLaVA-style
models run them (patch embedding, position embedding, bidirectional attention layers), returning the
hidden states of the layer the model takes its image features from.

Their parameters carry the checkpoint's names (`embeddings.patch_embedding.weight`,
`encoder.layers.0.self_attn.q_proj.weight` ...), q/k/v stacked into one product; only the layers up
to the feature layer are built, so a tower whose last layers the model never reads loads none of them.
Every tensor-parallel rank holds the whole tower (it is small next to the language model).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from splitserve.layers.basic import Linear

_ACTIVATIONS = {
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "silu": F.silu,
}


def activation(name: str):
    if name not in _ACTIVATIONS:
        raise ValueError(f"The activation {name!r} of this vision model is not supported ({', '.join(_ACTIVATIONS)}).")
    return _ACTIVATIONS[name]


def layers_for_feature_layer(num_layers: int, feature_layer: int) -> int:
    """How many encoder layers produce hidden state `feature_layer` (transformers' `hidden_states`
    index: 0 is the embeddings' output, -1 the last layer's)."""
    count = feature_layer if feature_layer >= 0 else num_layers + 1 + feature_layer
    if not 0 <= count <= num_layers:
        raise ValueError(f"vision_feature_layer {feature_layer} is outside the tower's {num_layers} layers.")
    return count


class VisionAttention(nn.Module):
    def __init__(self, config, dtype: torch.dtype):
        super().__init__()
        hidden = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_dim = hidden // self.num_heads
        self.qkv_proj = Linear(hidden, [hidden] * 3, bias=True, dtype=dtype)
        self.out_proj = Linear(hidden, [hidden], bias=True, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [images, patches, hidden]; every patch attends to every patch of its image."""
        b, n, hidden = x.shape
        qkv = self.qkv_proj(x.reshape(b * n, hidden)).view(b, n, 3, self.num_heads, self.head_dim)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
        out = F.scaled_dot_product_attention(q, k, v)
        return self.out_proj(out.transpose(1, 2).reshape(b * n, hidden)).view(b, n, hidden)


class VisionMLP(nn.Module):
    def __init__(self, config, dtype: torch.dtype):
        super().__init__()
        self.fc1 = Linear(config.hidden_size, [config.intermediate_size], bias=True, dtype=dtype)
        self.fc2 = Linear(config.intermediate_size, [config.hidden_size], bias=True, dtype=dtype)
        self.act = activation(config.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        return self.fc2(self.act(self.fc1(x.reshape(-1, shape[-1])))).view(shape)


class VisionEncoderLayer(nn.Module):
    def __init__(self, config, dtype: torch.dtype):
        super().__init__()
        eps = config.layer_norm_eps
        self.layer_norm1 = nn.LayerNorm(config.hidden_size, eps=eps, dtype=dtype)
        self.self_attn = VisionAttention(config, dtype)
        self.layer_norm2 = nn.LayerNorm(config.hidden_size, eps=eps, dtype=dtype)
        self.mlp = VisionMLP(config, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class VisionEncoder(nn.Module):
    def __init__(self, config, num_layers: int, dtype: torch.dtype):
        super().__init__()
        self.layers = nn.ModuleList(VisionEncoderLayer(config, dtype) for _ in range(num_layers))


class VisionEmbeddings(nn.Module):
    """Patches of a square image of the config's size, plus a class token for CLIP."""

    def __init__(self, config, class_token: bool, dtype: torch.dtype):
        super().__init__()
        hidden, patch = config.hidden_size, config.patch_size
        self.image_size, self.patch_size = config.image_size, patch
        self.patch_embedding = nn.Conv2d(
            config.num_channels, hidden, kernel_size=patch, stride=patch, bias=not class_token, dtype=dtype
        )
        num_positions = (config.image_size // patch) ** 2 + class_token
        self.class_embedding = nn.Parameter(torch.empty(hidden, dtype=dtype)) if class_token else None
        self.position_embedding = nn.Embedding(num_positions, hidden, dtype=dtype)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """pixel_values: [images, channels, size, size] -> [images, positions, hidden]."""
        if tuple(pixel_values.shape[-2:]) != (self.image_size, self.image_size):
            raise ValueError(
                f"The vision tower takes {self.image_size} x {self.image_size} images; the processor gave "
                f"{tuple(pixel_values.shape[-2:])}."
            )
        x = self.patch_embedding(pixel_values.to(self.patch_embedding.weight.dtype)).flatten(2).transpose(1, 2)
        if self.class_embedding is not None:
            x = torch.cat([self.class_embedding.expand(x.shape[0], 1, -1), x], dim=1)
        return x + self.position_embedding.weight


class VisionTransformer(nn.Module):
    """CLIP's (class token, a LayerNorm before the layers, `pre_layrnorm` as the checkpoint spells it)
    or SigLIP's (neither) ViT, up to `num_layers` layers; `forward` returns that layer's output
    (hidden_states[num_layers] in transformers' terms; the final LayerNorm is never applied there)."""

    def __init__(self, config, num_layers: int, dtype: torch.dtype):
        super().__init__()
        is_clip = config.model_type == "clip_vision_model"
        if not is_clip and config.model_type != "siglip_vision_model":
            raise ValueError(f"Vision towers of type {config.model_type!r} are not supported (CLIP, SigLIP).")
        self.embeddings = VisionEmbeddings(config, is_clip, dtype)
        self.pre_layrnorm = (
            nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps, dtype=dtype) if is_clip else None
        )
        self.encoder = VisionEncoder(config, num_layers, dtype)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        x = self.embeddings(pixel_values)
        if self.pre_layrnorm is not None:
            x = self.pre_layrnorm(x)
        for layer in self.encoder.layers:
            x = layer(x)
        return x

    def load_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """The tower's checkpoint tensors by their names under the tower (`vision_model.` optional);
        tensors of layers it does not build are skipped, and every parameter must be filled."""
        params = dict(self.named_parameters())
        missing = {key for name in params for key in _load_keys(name)}
        for name, tensor in weights.items():
            name = name.removeprefix("vision_model.")
            target, shard = _vision_target(name)
            if target not in params:
                if _unused(name, len(self.encoder.layers)):
                    continue
                raise ValueError(f"Checkpoint tensor {name!r} has no place in the vision tower.")
            dest = params[target].data
            if shard is not None:
                dest = dest[shard * dest.shape[0] // 3 : (shard + 1) * dest.shape[0] // 3]
            if dest.shape != tensor.shape:
                raise ValueError(
                    f"Vision tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(dest.shape)}."
                )
            dest.copy_(tensor)
            missing.discard(target if shard is None else f"{target}#{shard}")
        if missing:
            raise ValueError(f"The checkpoint lacks {len(missing)} vision tensors, e.g. {sorted(missing)[:5]}.")


_QKV = {"q_proj": 0, "k_proj": 1, "v_proj": 2}


def _vision_target(name: str) -> tuple[str, int | None]:
    parts = name.split(".")
    if len(parts) >= 2 and parts[-2] in _QKV:
        return ".".join(parts[:-2] + ["qkv_proj", parts[-1]]), _QKV[parts[-2]]
    return name, None


def _load_keys(param_name: str) -> list[str]:
    """q/k/v stacked in one parameter are filled one at a time: a key per piece."""
    if ".qkv_proj." not in param_name:
        return [param_name]
    return [f"{param_name}#{s}" for s in range(3)]


def _unused(name: str, num_layers: int) -> bool:
    """Checkpoint tensors the tower never reads: layers past the feature layer, the final LayerNorm,
    SigLIP's pooling head, a saved position_ids buffer."""
    if name.startswith("encoder.layers."):
        return int(name.split(".")[2]) >= num_layers
    return name.startswith(("post_layernorm.", "head.")) or name.endswith("position_ids")


def load_exact(module: nn.Module, weights: dict[str, torch.Tensor], what: str) -> None:
    """Checkpoint tensors named as `module`'s parameters, every one of them and no other."""
    params = dict(module.named_parameters())
    unknown, missing = sorted(set(weights) - set(params)), sorted(set(params) - set(weights))
    if unknown or missing:
        raise ValueError(f"The {what}'s tensors do not match the model: unknown {unknown[:5]}, missing {missing[:5]}.")
    for name, tensor in weights.items():
        if params[name].shape != tensor.shape:
            raise ValueError(
                f"{what} tensor {name!r} has shape {tuple(tensor.shape)}, not {tuple(params[name].shape)}."
            )
        params[name].data.copy_(tensor)


def local_name(name: str, prefixes: tuple[tuple[str, str], ...]) -> str:
    """A checkpoint tensor's name with the first matching (checkpoint prefix, model prefix) swapped."""
    for prefix, local in prefixes:
        if name.startswith(prefix):
            return local + name[len(prefix) :]
    return name
