"""The Llama family: Llama 2/3 (and SmolLM2), Mistral, Qwen2 (q/k/v bias) and Qwen3 (q/k RMSNorm).

They differ only in a few switches read from the Hugging Face config, so one implementation serves
all four; parameter names follow the checkpoints' so that loading is a rename plus the stacking of
q/k/v and gate/up into single matmuls.

The model is built for one rank (distributed.parallel_state): under tensor parallelism each rank
holds its share of the attention heads (q/k/v column-parallel, o row-parallel), of the MLP
(gate/up column-, down row-parallel) and of the vocabulary; under pipeline parallelism each stage
holds a contiguous range of layers, the first stage the embedding and the last the final norm and
the LM head, and the stages hand each other (hidden states, residual).
"""

from __future__ import annotations

import torch
from torch import nn

from splitserve.distributed.parallel_state import get_parallel_rank
from splitserve.layers.attention import Attention
from splitserve.layers.basic import Embedding, Linear, RMSNorm, silu_and_mul
from splitserve.layers.rotary import (
    PositionEncoding,
    apply_rotary,
    logn_query_scale,
    logn_training_length,
    rotary_embedding,
)
from splitserve.models.weight_loading import CheckpointLoading, target_name

_QKV_BIASED = ("qwen2", "qwen2_vl_text", "qwen2_5_vl_text")  # model types with q/k/v biases


def _sliding_window(config, layer_idx: int) -> int | None:
    window, layer_types = getattr(config, "sliding_window", None), getattr(config, "layer_types", None)
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
    # The dtype of the rotation (None: the model's); architectures that rotate in float32 set it.
    rotary_dtype: torch.dtype | None = None

    def __init__(self, config, layer_idx: int, dtype: torch.dtype, quant_config=None, prefix: str = ""):
        super().__init__()
        tp = get_parallel_rank().tp_size
        total_heads = config.num_attention_heads
        total_kv_heads = getattr(config, "num_key_value_heads", None) or total_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // total_heads
        if total_heads % tp:
            raise ValueError(f"{total_heads} attention heads cannot be split over {tp} tensor-parallel ranks.")
        # Fewer KV heads than ranks: each rank holds one, shared by the ranks of its query heads.
        self.num_heads, self.num_kv_heads = total_heads // tp, max(total_kv_heads // tp, 1)
        q_size, kv_size = total_heads * self.head_dim, total_kv_heads * self.head_dim
        qkv_bias, o_bias = self.biases(config)
        self.qkv_proj = Linear(
            config.hidden_size,
            [q_size, kv_size, kv_size],
            bias=qkv_bias,
            dtype=dtype,
            quant_method=_method(quant_config, f"{prefix}.qkv_proj"),
            parallel="column",
            output_partitions=[tp, total_kv_heads, total_kv_heads],
        )
        self.o_proj = Linear(
            q_size,
            [config.hidden_size],
            bias=o_bias,
            dtype=dtype,
            quant_method=_method(quant_config, f"{prefix}.o_proj"),
            parallel="row",
        )
        self.qk_norm = config.model_type in ("qwen3", "qwen3_moe")
        if self.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, dtype=dtype)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, dtype=dtype)
        self.attn = Attention(
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            getattr(config, "attention_multiplier", None) or self.head_dim**-0.5,  # Granite sets its own scale
            sliding_window=_sliding_window(config, layer_idx),
        )

    @staticmethod
    def biases(config) -> tuple[bool, bool]:
        """(q/k/v, o) biases: Llama's attention_bias covers all four projections, Qwen2 biases q/k/v."""
        attention_bias = bool(getattr(config, "attention_bias", False))
        qkv_bias = config.model_type in _QKV_BIASED or bool(getattr(config, "qkv_bias", False))  # Qwen2-MoE names it
        return qkv_bias or attention_bias, attention_bias

    def rotate(self, q: torch.Tensor, k: torch.Tensor, encoding: PositionEncoding):
        return apply_rotary(q, k, encoding)

    def forward(self, x: torch.Tensor, encoding: PositionEncoding, meta) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        q, k, v = qkv.split(self.qkv_proj.output_sizes, dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k, v = k.view(-1, self.num_kv_heads, self.head_dim), v.view(-1, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotate(q, k, encoding)
        return self.o_proj(self.attn(q, k, v, meta))


class LlamaMLP(nn.Module):
    def __init__(
        self, config, dtype: torch.dtype, quant_config=None, prefix: str = "", intermediate_size: int | None = None
    ):
        super().__init__()
        bias = self.has_bias(config)
        intermediate_size = intermediate_size or config.intermediate_size
        self.gate_up_proj = Linear(
            config.hidden_size,
            [intermediate_size] * 2,
            bias=bias,
            dtype=dtype,
            quant_method=_method(quant_config, f"{prefix}.gate_up_proj"),
            parallel="column",
        )
        self.down_proj = Linear(
            intermediate_size,
            [config.hidden_size],
            bias=bias,
            dtype=dtype,
            quant_method=_method(quant_config, f"{prefix}.down_proj"),
            parallel="row",
        )
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act={config.hidden_act!r} is not supported (only silu).")

    @classmethod
    def for_layer(cls, config, layer_idx: int, dtype: torch.dtype, quant_config, prefix: str) -> nn.Module:
        return cls(config, dtype, quant_config, prefix)  # mixture-of-experts models choose per layer

    @staticmethod
    def has_bias(config) -> bool:
        return bool(getattr(config, "mlp_bias", False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self,
        config,
        layer_idx: int,
        dtype: torch.dtype,
        quant_config=None,
        attention_cls: type[LlamaAttention] = LlamaAttention,
        mlp_cls: type[LlamaMLP] = LlamaMLP,
    ):
        super().__init__()
        prefix = f"model.layers.{layer_idx}"
        self.self_attn = attention_cls(config, layer_idx, dtype, quant_config, f"{prefix}.self_attn")
        self.mlp = mlp_cls.for_layer(config, layer_idx, dtype, quant_config, f"{prefix}.mlp")
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype)
        # Granite scales each sub-layer's output before it joins the residual stream.
        self.residual_multiplier = float(getattr(config, "residual_multiplier", 1.0) or 1.0)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, encoding: PositionEncoding, meta):
        """vLLM's residual form: x is the previous layer's output, not yet added to the residual
        stream; each norm adds it in (fused on CPU). Returns (this layer's output, residual)."""
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, encoding, meta)
        if self.residual_multiplier != 1.0:
            x = x * self.residual_multiplier
        x, residual = self.post_attention_layernorm(x, residual)
        x = self.mlp(x)
        return x * self.residual_multiplier if self.residual_multiplier != 1.0 else x, residual


def stage_layers(num_layers: int, pp_rank: int, pp_size: int) -> range:
    """The layers of pipeline stage `pp_rank`: contiguous, as even as possible, earlier stages first."""
    if num_layers < pp_size:
        raise ValueError(f"{num_layers} layers cannot be split over {pp_size} pipeline stages.")
    base, extra = divmod(num_layers, pp_size)
    start = pp_rank * base + min(pp_rank, extra)
    return range(start, start + base + (pp_rank < extra))


class LlamaModel(nn.Module):
    def __init__(
        self,
        config,
        dtype: torch.dtype,
        max_position: int,
        quant_config=None,
        attention_cls: type[LlamaAttention] = LlamaAttention,
        mlp_cls: type[LlamaMLP] = LlamaMLP,
    ):
        super().__init__()
        rank = get_parallel_rank()
        self.is_first_stage, self.is_last_stage = rank.is_first_stage, rank.is_last_stage
        self.layer_range = stage_layers(config.num_hidden_layers, rank.pp_rank, rank.pp_size)
        if self.is_first_stage:
            self.embed_tokens = Embedding(config.vocab_size, config.hidden_size, dtype=dtype)
        # Layers of other stages are empty placeholders, so that parameter names keep their indices.
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i, dtype, quant_config, attention_cls, mlp_cls)
            if i in self.layer_range
            else nn.Module()
            for i in range(config.num_hidden_layers)
        )
        if self.is_last_stage:
            self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype)
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.rotary = rotary_embedding(config, head_dim, max_position)
        self.rotary_dtype = attention_cls.rotary_dtype
        self.logn_length = logn_training_length(config)
        self.embedding_multiplier = float(getattr(config, "embedding_multiplier", 1.0) or 1.0)  # Granite

    def local_layers(self) -> list[LlamaDecoderLayer]:
        return [self.layers[i] for i in self.layer_range]

    def position_encoding(self, positions: torch.Tensor, dtype: torch.dtype, meta) -> PositionEncoding:
        """Computed once per forward for every layer: the rotation (in the attention's rotary dtype;
        dynamic NTK reads each token's sequence length from meta) and the log-n query factor."""
        cos, sin = self.rotary.cos_sin(positions, self.rotary_dtype or dtype, meta.rope_lengths)
        if self.logn_length is None:
            return PositionEncoding(cos, sin)
        return PositionEncoding(cos, sin, logn_query_scale(positions, self.logn_length, dtype))

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta,
        intermediate: tuple[torch.Tensor, torch.Tensor] | None = None,
        inputs_embeds: torch.Tensor | None = None,
    ):
        """The first stage starts from the token ids (or their embeddings, images placed), the others from
        the previous stage's (hidden, residual); the last returns the final hidden states, the others
        (hidden, residual)."""
        if self.is_first_stage:
            x, residual = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds, None
            if self.embedding_multiplier != 1.0:
                x = x * self.embedding_multiplier
        else:
            x, residual = intermediate
        encoding = self.position_encoding(positions, x.dtype, meta)
        for layer in self.local_layers():
            x, residual = layer(x, residual, encoding, meta)
        if not self.is_last_stage:
            return x, residual
        return self.norm(x, residual)[0]


class LlamaForCausalLM(CheckpointLoading, nn.Module):
    """`quant_config` (a QuantizationConfig, or None) picks the method of every decoder-layer
    linear; embeddings and the LM head stay in the model dtype. Architectures that differ only in
    their attention or MLP subclass it with other `attention_cls` / `mlp_cls`. Loading a checkpoint
    (load_weights) is models/weight_loading.py's."""

    attention_cls: type[LlamaAttention] = LlamaAttention
    mlp_cls: type[LlamaMLP] = LlamaMLP

    def __init__(self, config, dtype: torch.dtype, max_position: int, quant_config=None):
        super().__init__()
        self.config = config
        self.model = LlamaModel(config, dtype, max_position, quant_config, self.attention_cls, self.mlp_cls)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        # Tied embeddings on a last stage that is not also the first: the head is a copy of them.
        self.head_is_embedding = self.tie_word_embeddings and self.model.is_first_stage
        if self.model.is_last_stage and not self.head_is_embedding:
            self.lm_head = Embedding(config.vocab_size, config.hidden_size, dtype=dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta, intermediate=None, inputs_embeds=None):
        """input_ids, positions: [T] -> final hidden states [T, hidden] (or, before the last pipeline
        stage, the (hidden, residual) to hand on)."""
        return self.model(input_ids, positions, meta, intermediate, inputs_embeds)

    def compute_logits_embedding(self) -> Embedding | None:
        """The Embedding whose `logits` are the LM head's (None before the last pipeline stage)."""
        if not self.model.is_last_stage:
            return None
        return self.model.embed_tokens if self.head_is_embedding else self.lm_head

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.compute_logits_embedding().logits(hidden)
        scaling = float(getattr(self.config, "logits_scaling", 1.0) or 1.0)  # Granite divides its logits
        return logits / scaling if scaling != 1.0 else logits

    @staticmethod
    def lora_target(module_name: str) -> tuple[str, int]:
        """Where a PEFT adapter's module (`model.layers.0.self_attn.k_proj`) lives here: the Linear
        that holds it and its stacked matrix in that Linear (`...qkv_proj`, 1)."""
        target, shard = target_name(module_name + ".weight")
        return target.removesuffix(".weight"), shard or 0

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.model.local_layers()]
