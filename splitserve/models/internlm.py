"""InternLM (v1) and InternLM2: Llama by another name. Their config and model classes are remote
code (trust_remote_code) that transformers cannot build offline, so splitserve reads their
config.json itself, into a transformers LlamaConfig with the keys mapped onto Llama's names, and
never runs the checkpoint's Python files.

- InternLM: Llama's checkpoint names; `bias` puts a bias on q/k/v/o (Llama's attention_bias);
  `rotary: {"base", "type": "origin" | "dynamic", "scaling_factor"}` is the rope (dynamic: NTK
  scaling past max_position_embeddings). Served by LlamaForCausalLM.
- InternLM2: `bias`, `rope_theta`, `rope_scaling` as Llama's, but its own checkpoint names, and
  q/k/v fused into one `attention.wqkv` grouped per KV head: for each KV head, the rows of its
  group's query heads, then its key head, then its value head.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from splitserve.layers.rotary import set_rope_scaling
from splitserve.models.llama import LlamaForCausalLM

# config.json keys that have no LlamaConfig counterpart or are mapped by hand. auto_map and
# attn_implementation name the remote code, which never runs here.
_NOT_LLAMA_KEYS = ("model_type", "auto_map", "attn_implementation", "bias", "rotary", "rope_theta", "rope_scaling")
# InternLMConfig's defaults (its remote configuration_internlm.py), for keys a config.json omits.
_INTERNLM_DEFAULT_ROTARY = {"base": 10000, "type": "dynamic"}


def _llama_config(raw: dict, architecture: str, bias: bool):
    from transformers import LlamaConfig

    keys = {key: value for key, value in raw.items() if key not in _NOT_LLAMA_KEYS}
    keys.setdefault("architectures", [architecture])
    return LlamaConfig(**keys, attention_bias=bias)


def _internlm_rope_scaling(rotary: dict) -> dict | None:
    kind = rotary.get("type")
    if kind == "origin":
        return None
    if kind == "dynamic":
        return {"rope_type": "dynamic", "factor": float(rotary.get("scaling_factor", 1.0))}
    raise ValueError(f"InternLM rotary type {kind!r} is not supported (origin and dynamic are).")


def internlm_config(raw: dict):
    """InternLM's config.json as a LlamaConfig."""
    config = _llama_config(raw, "InternLMForCausalLM", bool(raw.get("bias", True)))
    rotary = raw.get("rotary", _INTERNLM_DEFAULT_ROTARY)
    set_rope_scaling(config, _internlm_rope_scaling(rotary), float(rotary.get("base", 10000)))
    return config


def internlm2_config(raw: dict):
    """InternLM2's config.json as a LlamaConfig (InternLM2Config's defaults: bias true, rope_theta
    10000, no rope scaling)."""
    config = _llama_config(raw, "InternLM2ForCausalLM", bool(raw.get("bias", True)))
    set_rope_scaling(config, raw.get("rope_scaling"), float(raw.get("rope_theta", 10000)))
    return config


# InternLM2 checkpoint names -> Llama's: whole names, then modules inside a layer.
_INTERNLM2_NAMES = {"model.tok_embeddings.weight": "model.embed_tokens.weight", "output.weight": "lm_head.weight"}
_INTERNLM2_LAYER_MODULES = {
    "attention.wo": "self_attn.o_proj",
    "feed_forward.w1": "mlp.gate_proj",
    "feed_forward.w3": "mlp.up_proj",
    "feed_forward.w2": "mlp.down_proj",
    "attention_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_WQKV = "attention.wqkv"


def _split_layer_name(name: str) -> tuple[str, str, str] | None:
    """`model.layers.3.attention.wo.weight` -> ("model.layers.3.", "attention.wo", "weight")."""
    parts = name.split(".")
    if len(parts) < 4 or parts[:2] != ["model", "layers"]:
        return None
    return ".".join(parts[:3]) + ".", ".".join(parts[3:-1]), parts[-1]


def llama_name(name: str) -> str:
    """An InternLM2 checkpoint name as Llama's (other than the fused wqkv, which splits in three)."""
    if name in _INTERNLM2_NAMES:
        return _INTERNLM2_NAMES[name]
    split = _split_layer_name(name)
    if split is None or split[1] not in _INTERNLM2_LAYER_MODULES:
        return name
    prefix, module, suffix = split
    return f"{prefix}{_INTERNLM2_LAYER_MODULES[module]}.{suffix}"


def split_wqkv(tensor: torch.Tensor, num_heads: int, num_kv_heads: int) -> tuple[torch.Tensor, ...]:
    """wqkv's rows (weight [rows, in] or bias [rows]), grouped per KV head as [its query heads...,
    key, value], as the (q, k, v) projections' rows."""
    group = num_heads // num_kv_heads
    head_dim = tensor.shape[0] // (num_kv_heads * (group + 2))
    rest = tensor.shape[1:]
    grouped = tensor.reshape(num_kv_heads, group + 2, head_dim, *rest)
    q = grouped[:, :group].reshape(num_heads * head_dim, *rest)
    k = grouped[:, group].reshape(num_kv_heads * head_dim, *rest)
    v = grouped[:, group + 1].reshape(num_kv_heads * head_dim, *rest)
    return q, k, v


class InternLM2ForCausalLM(LlamaForCausalLM):
    """Llama with InternLM2's checkpoint names: loading renames them and splits wqkv."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(pair for name, tensor in weights for pair in self._as_llama(name, tensor))

    def _as_llama(self, name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        split = _split_layer_name(name)
        if split is None or split[1] != _WQKV:
            yield llama_name(name), tensor
            return
        prefix, _, suffix = split
        if suffix not in ("weight", "bias"):
            raise ValueError(
                f"Checkpoint tensor {name!r}: a quantized fused wqkv is not supported (its packed rows "
                "cannot be regrouped into q, k and v); use an unquantized InternLM2 checkpoint."
            )
        heads = self.config.num_attention_heads
        kv_heads = getattr(self.config, "num_key_value_heads", None) or heads
        for proj, part in zip(("q_proj", "k_proj", "v_proj"), split_wqkv(tensor, heads, kv_heads)):
            yield f"{prefix}self_attn.{proj}.{suffix}", part

    @staticmethod
    def lora_target(module_name: str) -> tuple[str, int]:
        if module_name.endswith(_WQKV):
            raise ValueError(f"LoRA on InternLM2's fused {module_name} is not supported (q, k and v are split here).")
        return LlamaForCausalLM.lora_target(llama_name(module_name + ".weight").removesuffix(".weight"))
