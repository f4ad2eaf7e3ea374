"""Reading a PEFT LoRA checkpoint (adapter_config.json + adapter_model.safetensors, or .bin) into
per-module (A, B) pairs, checked against the base model's projection shapes.

Only LoRA on the attention and MLP projections is served (q/k/v/o, gate/up/down; every architecture
splitserve runs names them so). B comes out multiplied by the adapter's scaling (lora_alpha / r, or
lora_alpha / sqrt(r) with rsLoRA; `alpha_pattern` per module), so that applying an adapter is
y += (x A^T) B^T. Anything the engine would have to ignore (DoRA, LoRA biases, embedding LoRA,
`modules_to_save`) is refused with the reason, never dropped.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass

import torch

from splitserve.lora.request import LoRARequest

SUPPORTED_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_CONFIG_FILE = "adapter_config.json"
_WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")
_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<which>A|B)(?:\.[^.]+)?\.weight$")
_LAYER = re.compile(r"^model\.layers\.(?P<index>\d+)\.(?:self_attn|mlp)\.(?P<proj>\w+)$")


class LoRALoadError(ValueError):
    """An adapter that cannot be served: missing, malformed, or asking for what is not supported."""


@dataclass
class LoRALayerWeights:
    a: torch.Tensor  # [r, in_features]
    b: torch.Tensor  # [out_features, r], already multiplied by the scaling

    @property
    def rank(self) -> int:
        return self.a.shape[0]


@dataclass
class LoRAModel:
    """An adapter's weights, by module name (`model.layers.3.self_attn.q_proj`)."""

    lora_int_id: int
    modules: dict[str, LoRALayerWeights]

    @property
    def rank(self) -> int:
        return max(w.rank for w in self.modules.values())


@dataclass(frozen=True)
class BaseModelShapes:
    """What an adapter must fit: the number of layers and each projection's (in, out) features."""

    num_layers: int
    projections: dict[str, tuple[int, int]]

    @classmethod
    def from_hf_config(cls, config) -> BaseModelShapes:
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        hidden, inter = config.hidden_size, config.intermediate_size
        return cls(
            config.num_hidden_layers,
            {
                "q_proj": (hidden, heads * head_dim),
                "k_proj": (hidden, kv_heads * head_dim),
                "v_proj": (hidden, kv_heads * head_dim),
                "o_proj": (heads * head_dim, hidden),
                "gate_proj": (hidden, inter),
                "up_proj": (hidden, inter),
                "down_proj": (inter, hidden),
            },
        )


def read_adapter_config(path: str) -> dict:
    if not os.path.isdir(path):
        raise LoRALoadError(f"LoRA adapter path {path!r} is not a directory (a PEFT checkpoint is one).")
    config_path = os.path.join(path, _CONFIG_FILE)
    try:
        with open(config_path) as f:
            config = json.load(f)
    except FileNotFoundError:
        raise LoRALoadError(f"{path!r} has no {_CONFIG_FILE}: it is not a PEFT adapter.") from None
    except json.JSONDecodeError as exc:
        raise LoRALoadError(f"{config_path} is not valid JSON: {exc}") from None
    _check_config(config, config_path)
    return config


def _check_config(config: dict, where: str) -> None:
    peft_type = config.get("peft_type", "LORA")
    refusals = [
        (peft_type != "LORA", f"peft_type {peft_type!r}: only LORA adapters are served"),
        (config.get("use_dora"), "use_dora: DoRA adapters are not supported"),
        (config.get("bias", "none") != "none", f"bias={config.get('bias')!r}: LoRA biases are not supported"),
        (config.get("fan_in_fan_out"), "fan_in_fan_out: Conv1D-style weights are not supported"),
        (
            config.get("modules_to_save"),
            f"modules_to_save={config.get('modules_to_save')}: fully trained "
            "modules are not supported, only LoRA deltas",
        ),
    ]
    for refused, why in refusals:
        if refused:
            raise LoRALoadError(f"{where}: {why}.")


def _read_weights(path: str) -> dict[str, torch.Tensor]:
    for name in _WEIGHT_FILES:
        file = os.path.join(path, name)
        if not os.path.exists(file):
            continue
        if name.endswith(".safetensors"):
            from safetensors.torch import load_file

            return load_file(file)
        return torch.load(file, map_location="cpu", weights_only=True)
    raise LoRALoadError(f"{path!r} has neither {' nor '.join(_WEIGHT_FILES)}.")


def _pattern_value(patterns: dict, module: str, default):
    """PEFT's rank_pattern / alpha_pattern lookup: the first key that matches the end of the module name."""
    for key, value in patterns.items():
        if re.fullmatch(rf"(.*\.)?{key}", module):
            return value
    return default


def _scaling(config: dict, module: str, rank: int) -> float:
    alpha = _pattern_value(config.get("alpha_pattern") or {}, module, config.get("lora_alpha", 8))
    return alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank


def load_lora_model(
    lora: LoRARequest, shapes: BaseModelShapes, max_rank: int, dtype: torch.dtype = torch.float32
) -> LoRAModel:
    """Read and check `lora`'s checkpoint. Raises LoRALoadError saying what does not fit."""
    config = read_adapter_config(lora.lora_path)
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in _read_weights(lora.lora_path).items():
        match = _KEY.match(key)
        if match is None:
            raise LoRALoadError(f"{lora.lora_path}: tensor {key!r} is not a LoRA A/B weight of a linear layer.")
        pairs.setdefault(match["module"], {})[match["which"]] = tensor
    if not pairs:
        raise LoRALoadError(f"{lora.lora_path}: the adapter holds no LoRA weights.")
    modules = {}
    for module, ab in sorted(pairs.items()):
        a, b = _check_module(lora.lora_path, module, ab, shapes, max_rank)
        scale = _scaling(config, module, a.shape[0])
        modules[module] = LoRALayerWeights(a.to(dtype), (b.float() * scale).to(dtype))
    return LoRAModel(lora.lora_int_id, modules)


def _check_module(path: str, module: str, ab: dict, shapes: BaseModelShapes, max_rank: int):
    match = _LAYER.match(module)
    if match is None or match["proj"] not in SUPPORTED_MODULES:
        raise LoRALoadError(
            f"{path}: LoRA on {module!r} is not supported; adapters may target "
            f"{', '.join(SUPPORTED_MODULES)} of the decoder layers."
        )
    if int(match["index"]) >= shapes.num_layers:
        raise LoRALoadError(f"{path}: {module!r} is past the base model's {shapes.num_layers} layers.")
    if set(ab) != {"A", "B"}:
        raise LoRALoadError(f"{path}: {module!r} has lora_{'A' if 'A' not in ab else 'B'} missing.")
    a, b = ab["A"], ab["B"]
    in_features, out_features = shapes.projections[match["proj"]]
    rank = a.shape[0]
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != in_features or b.shape != (out_features, rank):
        raise LoRALoadError(
            f"{path}: {module!r} has lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)}; this base model "
            f"needs ({rank}, {in_features}) and ({out_features}, {rank}): was it trained on another model?"
        )
    if rank > max_rank:
        raise LoRALoadError(f"{path}: rank {rank} of {module!r} is above --max-lora-rank {max_rank}.")
    return a, b
