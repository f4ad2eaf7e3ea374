"""GGUF files written by the tests from tiny Hugging Face checkpoints, laid out as llama.cpp's
converter lays them out (its tensor names from the gguf package, experts stacked into 3-d tensors,
routers and norms in float32, a Llama's q/k rows interleaved for its rotary pairs), with the
embedded default model's tokenizer metadata: llama.cpp's own converter is not a package the tests
can install."""

from __future__ import annotations

import functools

import torch

# the Hugging Face model type -> the GGUF architecture name llama.cpp gives it
_ARCH = {"qwen3_moe": "qwen3moe", "qwen2_moe": "qwen2moe", "llama": "llama"}
_EXPERT = ("gate_proj", "up_proj", "down_proj")


def write_gguf(hf_dir: str, path: str, qtype: str, tokenizer_gguf: str) -> str:
    """`hf_dir`'s model as a .gguf at `path`, its matrices in ggml type `qtype` ("Q8_0", "Q4_0",
    "F32", ...), its tokenizer (and chat template) copied from `tokenizer_gguf`, whose vocabulary the
    model must have."""
    import gguf
    import transformers
    from safetensors.torch import load_file

    config = transformers.AutoConfig.from_pretrained(hf_dir)
    arch_name = _ARCH[config.model_type]
    arch = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch_name)
    writer = gguf.GGUFWriter(path, arch_name)
    _write_hparams(writer, config)
    _copy_tokenizer(writer, tokenizer_gguf)
    names = gguf.get_tensor_name_map(arch, config.num_hidden_layers)
    tensors = load_file(f"{hf_dir}/model.safetensors")
    for name, tensor in _stack_experts(tensors, config).items():
        if arch_name == "llama":
            tensor = _permute_rotary_rows(name, tensor, config)
        base, suffix = name.rsplit(".", 1)
        target = names.get_name(base)
        assert target is not None, name
        data = tensor.float().numpy()
        if "ffn_gate_inp_shexp" in target:
            data = data.reshape(-1)  # llama.cpp keeps the shared expert's gate as a vector
        keep_float = data.ndim == 1 or "ffn_gate_inp" in target or target.endswith("_norm")
        kind = gguf.GGMLQuantizationType.F32 if keep_float else gguf.GGMLQuantizationType[qtype]
        if kind != gguf.GGMLQuantizationType.F32:
            data = gguf.quants.quantize(data, kind)
        writer.add_tensor(f"{target}.{suffix}", data, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _write_hparams(writer, config) -> None:
    writer.add_context_length(config.max_position_embeddings)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    writer.add_rope_dimension_count(head_dim)
    if not getattr(config, "num_experts", 0):
        return
    writer.add_expert_count(config.num_experts)
    writer.add_expert_used_count(config.num_experts_per_tok)
    writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    if getattr(config, "shared_expert_intermediate_size", 0):
        writer.add_expert_shared_feed_forward_length(config.shared_expert_intermediate_size)


def _permute_rotary_rows(name: str, tensor: torch.Tensor, config) -> torch.Tensor:
    """llama.cpp's converter interleaves each head's q/k rows for its rotary pairs (the loader
    undoes it for the llama architecture): Hugging Face's rotate-half rows in that order."""
    if name.endswith("q_proj.weight"):
        heads = config.num_attention_heads
    elif name.endswith("k_proj.weight"):
        heads = config.num_key_value_heads
    else:
        return tensor
    rows = tensor.shape[0]
    return tensor.reshape(heads, 2, rows // heads // 2, -1).swapaxes(1, 2).reshape(tensor.shape)


def _copy_tokenizer(writer, source: str) -> None:
    for name, value, vtype, sub_type in _tokenizer_fields(source):
        writer.add_key_value(name, value, vtype, sub_type=sub_type)


@functools.lru_cache(maxsize=2)
def _tokenizer_fields(source: str) -> list[tuple]:
    """The tokenizer.* fields of a .gguf, read once per session (the gguf package's reader takes
    about 3 s over the default model's 49,152 tokens)."""
    import gguf

    fields = []
    for name, field in gguf.GGUFReader(source).fields.items():
        if name.startswith("tokenizer."):
            vtype = field.types[0]
            fields.append(
                (name, field.contents(), vtype, field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None)
            )
    return fields


def _stack_experts(tensors: dict[str, torch.Tensor], config) -> dict[str, torch.Tensor]:
    """Per-expert matrices `...mlp.experts.E.gate_proj.weight` as one [experts, rows, cols] tensor
    `...mlp.experts.gate_proj.weight` per layer, as llama.cpp stores them."""
    out, stacks = {}, {}
    for name, tensor in tensors.items():
        parts = name.split(".")
        if "experts" in parts and parts[parts.index("experts") + 1].isdigit():
            i = parts.index("experts")
            key = ".".join(parts[: i + 1] + parts[i + 2 :])
            stacks.setdefault(key, {})[int(parts[i + 1])] = tensor
        else:
            out[name] = tensor
    for key, experts in stacks.items():
        assert sorted(experts) == list(range(config.num_experts)), key
        out[key] = torch.stack([experts[e] for e in range(config.num_experts)])
    return out


def tensor_types(path: str) -> dict[str, str]:
    """The ggml type of each tensor of a .gguf file, by name."""
    import gguf

    return {t.name: gguf.GGMLQuantizationType(t.tensor_type).name for t in gguf.GGUFReader(path).tensors}
