"""Steps of Llama-family models on CPU in one C++ call (splitserve/kernels/decode_stack.cpp).

A single-stream decode step of SmolLM2-135M with its 4-bit GGUF weights reads about 100 MB and
multiplies in about 3 ms on two cores, and Python spent about as long again going through 30
layers of module calls and ~12 kernel calls each. The model runner builds a CPUDecodeStack once
the KV cache is bound; from then on a step runs the embedding lookup and the rotary tables in
Python, and all the decoder layers and the final norm in one call that releases the GIL. The
kernels, their order and their row padding are those of the Python modules (packed bfloat16
weights included, kernels/packed_linear.py; the attention backend's decode and prompt kernels),
so the hidden states are the same bit for bit. Steps with prompt tokens (prompts, prompt chunks
next to running decodes, speculative verification) go through it too, for a plain text model
(LlamaForCausalLM itself, not a vision model's language half) without batch-invariant numerics
(which split a step's rows by kind); other steps run the modules.

It is built only where it computes exactly what the modules would: a Llama-family model
(LlamaForCausalLM with the stock layers: Llama, SmolLM2, Mistral, Qwen2, Qwen3) in float32 or bfloat16
on CPU ranks of one pipeline stage (tensor-parallel ranks sum their row-parallel products inside
the call, over the same group), dense or GGUF-block linears, the `cpu` attention backend with an
unquantized KV cache, no LoRA. Anything else runs layer by layer, and the log says why once.
SPLITSERVE_CPU_DECODE_STACK=0 turns it off (to compare, or to rule it out).
"""

from __future__ import annotations

import logging

import torch

from splitserve import envs, kernels
from splitserve.distributed.parallel_state import tp_group, tp_shm
from splitserve.kernels import batch_invariant, cpu_features, row_buckets
from splitserve.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP, LlamaModel
from splitserve.quantization.gguf import GGUFLinearMethod

logger = logging.getLogger(__name__)

# DecodeStack.add_run's qtype for weights that are not GGUF blocks (decode_stack.cpp's Run).
DENSE, PACKED = -1, -2
_DTYPES = (torch.float32, torch.bfloat16)
_NO_PROMPTS = torch.empty(0, dtype=torch.long)  # query_start_loc of a decode-only step (not read)


class CPUDecodeStack:
    def __init__(self, model: LlamaForCausalLM, stack):
        self.model = model.model
        self.stack = stack
        self.attention = [layer.self_attn.attn for layer in self.model.local_layers()]
        # Prompt tokens too: a text model's own positions and embeddings, rows of one numerics.
        self.prompts = type(model) is LlamaForCausalLM and not batch_invariant.enabled()

    @classmethod
    def build(cls, model, backend, rank, lora_enabled: bool) -> CPUDecodeStack | None:
        """The stack for this model, or None (logged with the reason) where it would not compute
        exactly what the Python modules do."""
        reason = _unsupported(model, backend, rank, lora_enabled)
        if reason is not None:
            logger.info("CPU decode steps run layer by layer in Python: %s.", reason)
            return None
        layers = model.model.local_layers()
        attn = layers[0].self_attn
        stack = torch.classes.splitserve_cpu.DecodeStack(
            attn.num_heads,
            attn.num_kv_heads,
            attn.head_dim,
            layers[0].input_layernorm.eps,
            attn.attn.scale,
            cpu_features.native_bf16(),
            batch_invariant.enabled(),
        )
        for layer in layers:
            a, mlp = layer.self_attn, layer.mlp
            norms = layer.input_layernorm.weight, layer.post_attention_layernorm.weight
            stack.add_layer(*norms, a.attn.sliding_window or 0)
            if a.qk_norm:
                stack.set_qk_norm(a.q_norm.weight, a.k_norm.weight)
            for slot, linear in enumerate((a.qkv_proj, a.o_proj, mlp.gate_up_proj, mlp.down_proj)):
                if linear.packed_weight is not None:
                    stack.add_run(slot, linear.packed_weight, PACKED, linear.out_features)
                elif linear.quant_method is None:
                    stack.add_run(slot, linear.weight, DENSE, linear.out_features)
                else:
                    for qtype, rows, name in linear.gguf_runs:
                        stack.add_run(slot, getattr(linear, name), DENSE if qtype is None else qtype, rows)
                if linear.bias is not None:  # F.linear fuses a dense column linear's bias; the others add it after
                    stack.set_bias(slot, linear.bias, linear.quant_method is None and linear.parallel != "row")
        if rank.tp_size > 1:  # the row-parallel sums as tp_all_reduce makes them
            if tp_shm() is not None:
                stack.set_tp_shm(tp_shm())
            else:
                stack.set_tp_group(tp_group().group_name)
        built = cls(model, stack)
        logger.info(
            "CPU %s run their %d decoder layers in one C++ call (SPLITSERVE_CPU_DECODE_STACK=0 runs them layer by "
            "layer).",
            "steps" if built.prompts else "decode steps",
            len(layers),
        )
        return built

    def takes(self, meta, num_tokens: int) -> bool:
        """Whether this step is one the stack runs: every request decodes one token, or (where the
        stack takes prompt tokens) any step."""
        return self.prompts or meta.num_decodes == meta.num_reqs == num_tokens

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta) -> torch.Tensor:
        """The final hidden states [T, hidden] of the step, as LlamaModel.forward gives them."""
        x = self.model.embed_tokens(input_ids)
        encoding = self.model.position_encoding(positions, x.dtype, meta)
        num_tokens = x.shape[0]
        rows = row_buckets.rows_for(num_tokens)
        starts = meta.query_start_tensor() if meta.num_decodes < meta.num_reqs else _NO_PROMPTS
        return torch.ops.splitserve_cpu.decode_stack_forward(
            self.stack,
            x,
            encoding.cos,
            encoding.sin,
            [a.kv_cache for a in self.attention],
            meta.block_tables,
            meta.seq_lens_tensor,
            meta.slot_mapping,
            starts,
            meta.num_decodes,
            self.model.norm.weight,
            rows,
        )


def _unsupported(model, backend, rank, lora_enabled: bool) -> str | None:
    """Why the stack cannot stand in for the model's modules, or None."""
    if not envs.SPLITSERVE_CPU_DECODE_STACK:
        return "SPLITSERVE_CPU_DECODE_STACK=0"
    if kernels.cpu_ops() is None:
        return "the C++ CPU kernels are off or did not build"
    if backend.name != "cpu":
        return f"the {backend.name} attention backend is in use"
    if rank.pp_size > 1:
        return "pipeline parallelism splits the layers between processes"
    if lora_enabled:
        return "LoRA adapters add their deltas to the linears in Python"
    plain = type(model) is LlamaForCausalLM or getattr(type(model), "decodes_as_llama", False)
    if not plain or type(model.model) is not LlamaModel:
        return f"{type(model).__name__} is not one of the Llama-family models the stack knows"
    inner = model.model
    layers = inner.local_layers()
    dtype = layers[0].input_layernorm.weight.dtype
    if dtype not in _DTYPES:
        return f"the model computes in {dtype} (the stack: float32 or bfloat16)"
    if inner.embedding_multiplier != 1.0 or any(layer.residual_multiplier != 1.0 for layer in layers):
        return "its multipliers (Granite) scale the embeddings and each layer's outputs"
    if inner.logn_length is not None:
        return "log-n attention scales the queries"
    if inner.rotary_dtype not in (None, dtype):
        return f"the rotation is computed in {inner.rotary_dtype}"
    norms = {inner.norm.eps}
    norms |= {n.eps for layer in layers for n in (layer.input_layernorm, layer.post_attention_layernorm)}
    norms |= {
        n.eps for layer in layers if layer.self_attn.qk_norm for n in (layer.self_attn.q_norm, layer.self_attn.k_norm)
    }
    scales = {layer.self_attn.attn.scale for layer in layers}
    if len(norms) > 1 or len(scales) > 1:
        return "its layers differ in their norm epsilon or attention scale"
    for layer in layers:
        if (type(layer), type(layer.self_attn), type(layer.mlp)) != (LlamaDecoderLayer, LlamaAttention, LlamaMLP):
            return f"its layers ({type(layer.self_attn).__name__}, {type(layer.mlp).__name__}) compute differently"
        attn = layer.self_attn.attn
        if attn.kv_scales is not None or attn.kv_cache is None or attn.kv_cache.dtype != dtype:
            return "the KV cache is quantized"
        for linear in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
            method = linear.quant_method
            if method is not None and not isinstance(method, GGUFLinearMethod):
                return f"its linears are quantized with {type(method).__name__}"
    return None
