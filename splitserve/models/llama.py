"""The Llama family: Llama 2/3 (and SmolLM2), Mistral, Qwen2 (q/k/v bias) and Qwen3 (q/k RMSNorm).

They differ only in a few switches read from the Hugging Face config, so one implementation serves
all four; parameter names follow the checkpoints' so that loading is a rename plus the stacking of
q/k/v and gate/up into single matmuls.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from splitserve.layers.attention import Attention
from splitserve.layers.basic import Embedding, Linear, RMSNorm, silu_and_mul
from splitserve.layers.rotary import RotaryEmbedding, apply_rotary

# checkpoint projection name -> (fused module name, shard index)
_STACKED = {
    "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
}


def _sliding_window(config, layer_idx: int) -> int | None:
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if not window:
        return None
    if layer_types is not None:
        return window if layer_types[layer_idx] == "sliding_attention" else None
    if config.model_type in ("qwen2", "qwen3") and not getattr(config, "use_sliding_window", False):
        return None
    return window


def _method(quant_config, prefix: str):
    return quant_config.linear_method(prefix) if quant_config is not None else None


class LlamaAttention(nn.Module):
    def __init__(self, config, layer_idx: int, dtype: torch.dtype, quant_config=None, prefix: str = ""):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        bias = config.model_type == "qwen2" or getattr(config, "attention_bias", False)
        self.qkv_proj = Linear(config.hidden_size, [q_size, kv_size, kv_size], bias=bias, dtype=dtype,
                               quant_method=_method(quant_config, f"{prefix}.qkv_proj"))
        self.o_proj = Linear(q_size, [config.hidden_size], bias=getattr(config, "attention_bias", False),
                             dtype=dtype, quant_method=_method(quant_config, f"{prefix}.o_proj"))
        self.qk_norm = config.model_type == "qwen3"
        if self.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, dtype=dtype)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, dtype=dtype)
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim ** -0.5,
                              sliding_window=_sliding_window(config, layer_idx))

    def forward(self, x: torch.Tensor, cos_sin, meta) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        q, k, v = qkv.split(self.qkv_proj.output_sizes, dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, k, cos_sin)
        return self.o_proj(self.attn(q, k, v, meta))


class LlamaMLP(nn.Module):
    def __init__(self, config, dtype: torch.dtype, quant_config=None, prefix: str = ""):
        super().__init__()
        bias = getattr(config, "mlp_bias", False)
        self.gate_up_proj = Linear(config.hidden_size, [config.intermediate_size] * 2, bias=bias, dtype=dtype,
                                   quant_method=_method(quant_config, f"{prefix}.gate_up_proj"))
        self.down_proj = Linear(config.intermediate_size, [config.hidden_size], bias=bias, dtype=dtype,
                                quant_method=_method(quant_config, f"{prefix}.down_proj"))
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act={config.hidden_act!r} is not supported (only silu).")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx: int, dtype: torch.dtype, quant_config=None):
        super().__init__()
        prefix = f"model.layers.{layer_idx}"
        self.self_attn = LlamaAttention(config, layer_idx, dtype, quant_config, f"{prefix}.self_attn")
        self.mlp = LlamaMLP(config, dtype, quant_config, f"{prefix}.mlp")
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, cos_sin, meta):
        """vLLM's residual form: x is the previous layer's output, not yet added to the residual
        stream; each norm adds it in (fused on CPU). Returns (this layer's output, residual)."""
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, cos_sin, meta)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class LlamaModel(nn.Module):
    def __init__(self, config, dtype: torch.dtype, max_position: int, quant_config=None):
        super().__init__()
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, i, dtype, quant_config)
                                    for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype)
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.rotary = RotaryEmbedding(config, head_dim, max_position)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        cos_sin = self.rotary.cos_sin(positions, x.dtype)
        residual = None
        for layer in self.layers:
            x, residual = layer(x, residual, cos_sin, meta)
        return self.norm(x, residual)[0]


class LlamaForCausalLM(nn.Module):
    """`quant_config` (a QuantizationConfig, or None) picks the method of every decoder-layer
    linear; embeddings and the LM head stay in the model dtype."""

    def __init__(self, config, dtype: torch.dtype, max_position: int, quant_config=None):
        super().__init__()
        self.config = config
        self.model = LlamaModel(config, dtype, max_position, quant_config)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if not self.tie_word_embeddings:
            self.lm_head = Linear(config.hidden_size, [config.vocab_size], dtype=dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta) -> torch.Tensor:
        """input_ids, positions: [T] -> final hidden states [T, hidden]."""
        return self.model(input_ids, positions, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.model.embed_tokens.weight if self.tie_word_embeddings else self.lm_head.weight
        return torch.nn.functional.linear(hidden, weight)

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.model.layers]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors (Hugging Face names) in; every parameter must be filled."""
        params = dict(self.named_parameters())
        modules = dict(self.named_modules())
        missing = {key for name in params for key in self._load_keys(name)}
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name or (name == "lm_head.weight" and self.tie_word_embeddings):
                continue
            target, shard = _target_name(name)
            module_name, _, suffix = target.rpartition(".")
            method = getattr(modules.get(module_name), "quant_method", None)
            if method is not None and method.takes(suffix):
                method.load(modules[module_name], suffix, shard or 0, tensor)
                continue
            if target not in params:
                raise ValueError(f"Checkpoint tensor {name!r} has no place in {type(self).__name__}.")
            dest = params[target].data
            if shard is not None:
                dest = dest[self._owner(target).shard_slice(shard)]
            if dest.shape != tensor.shape:
                raise ValueError(f"Checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, "
                                 f"expected {tuple(dest.shape)}.")
            dest.copy_(tensor)
            missing.discard(target if shard is None else f"{target}#{shard}")
        if missing:
            raise ValueError(f"The checkpoint lacks {len(missing)} tensors, e.g. {sorted(missing)[:5]}.")

    def process_weights_after_loading(self) -> None:
        """Let quantized linears turn what they loaded into their kernels' form."""
        for module in self.modules():
            method = getattr(module, "quant_method", None)
            if method is not None:
                method.process_weights_after_loading(module)

    def _owner(self, param_name: str) -> nn.Module:
        return self.get_submodule(param_name.rsplit(".", 1)[0])

    def _load_keys(self, param_name: str) -> list[str]:
        """A stacked parameter (q/k/v, gate/up) is filled shard by shard: one key per shard."""
        shards = len(getattr(self._owner(param_name), "output_sizes", [None]))
        return [param_name] if shards == 1 else [f"{param_name}#{s}" for s in range(shards)]


def _target_name(name: str) -> tuple[str, int | None]:
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part in _STACKED:
            fused, shard = _STACKED[part]
            return ".".join(parts[:i] + [fused] + parts[i + 1:]), shard
    return name, None
