"""Weight sources. Each yields (Hugging Face tensor name, tensor) pairs; the model copies them in."""

from __future__ import annotations

import glob
import json
import logging
import os
import time
from collections.abc import Iterator

import numpy as np
import torch
from tqdm.auto import tqdm

from splitserve.config import ModelConfig
from splitserve.layers.basic import pack_cpu_weights
from splitserve.layers.gguf_weight import GGUFWeight
from splitserve.loader.gguf_file import GGUFFile, GGUFTensor
from splitserve.models.registry import get_model_class
from splitserve.quantization.linear import weight_bytes

logger = logging.getLogger(__name__)

WeightIterator = Iterator[tuple[str, torch.Tensor]]

# Hugging Face module paths of a Llama-family layer, used to translate GGUF tensor names.
_LAYER_MODULES = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "self_attn.q_norm",
    "self_attn.k_norm",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
    "input_layernorm",
    "post_attention_layernorm",
    # mixture-of-experts layers: the router, the experts stacked (3-d in a GGUF), the shared expert
    "mlp.gate",
    "mlp.experts.gate_proj",
    "mlp.experts.up_proj",
    "mlp.experts.down_proj",
    "mlp.shared_expert.gate_proj",
    "mlp.shared_expert.up_proj",
    "mlp.shared_expert.down_proj",
    "mlp.shared_expert_gate",
)
# llama.cpp's converter permutes q/k rows for its interleaved rope; HF checkpoints rotate halves.
_GGUF_PERMUTED_ARCHS = ("llama",)


def load_model(model_config: ModelConfig, device: torch.device, show_progress: bool = True) -> torch.nn.Module:
    start = time.perf_counter()
    cls = get_model_class(model_config.hf_config)
    with torch.device(device):
        model = cls(
            model_config.hf_config,
            model_config.dtype,
            model_config.max_model_len,
            quant_config=model_config.quant_config,
        )
    if model_config.load_format == "dummy":
        fill_dummy(model, model_config.seed)
    else:
        weights = _weight_iterator(model_config)
        model.load_weights(
            tqdm(
                weights,
                desc="Loading weights",
                unit="tensor",
                disable=not show_progress,
                total=_count_tensors(model_config),
            )
        )
    model.process_weights_after_loading()
    model.eval()
    quant = f", {model_config.quant_config}" if model_config.quant_config is not None else ""
    logger.info(
        "Loaded %s (%s, %s%s, weights %.1f MiB) from %s in %.1f s",
        type(model).__name__,
        model_config.load_format,
        model_config.dtype,
        quant,
        weight_bytes(model) / (1 << 20),
        model_config.model,
        time.perf_counter() - start,
    )
    if device.type == "cpu":  # after counting: the packed copies replace the dense weights
        pack_cpu_weights(model)
    return model


def _weight_iterator(model_config: ModelConfig) -> WeightIterator:
    fmt, path = model_config.load_format, model_config.model
    if fmt == "gguf":
        qc = model_config.quant_config
        return gguf_weights(path, model_config.hf_config, keep_quantized=qc is not None and qc.method == "gguf")
    if fmt == "safetensors":
        return safetensors_weights(path)
    return pt_weights(path)


def _count_tensors(model_config: ModelConfig) -> int | None:
    if model_config.load_format == "gguf":
        return None
    if model_config.load_format == "safetensors":
        from safetensors import safe_open

        total = 0
        for file in _safetensors_files(model_config.model):
            with safe_open(file, framework="pt") as f:
                total += len(f.keys())
        return total
    return None


def _safetensors_files(directory: str) -> list[str]:
    index = os.path.join(directory, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(directory, s) for s in shards]
    files = sorted(glob.glob(os.path.join(directory, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"No .safetensors files in {directory}.")
    return files


def safetensors_weights(directory: str) -> WeightIterator:
    from safetensors import safe_open

    for file in _safetensors_files(directory):
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def pt_weights(directory: str) -> WeightIterator:
    files = sorted(glob.glob(os.path.join(directory, "*.bin")) + glob.glob(os.path.join(directory, "*.pt")))
    if not files:
        raise FileNotFoundError(f"No .safetensors, .bin or .pt weight files in {directory}.")
    for file in files:
        yield from torch.load(file, map_location="cpu", weights_only=True).items()


def gguf_weights(path: str, hf_config, keep_quantized: bool = False) -> WeightIterator:
    """Tensors of a .gguf file under HF names: matrices as GGUFWeights in their blocks when
    `keep_quantized` (--quantization gguf), every tensor dequantized to float32 otherwise."""
    gguf_file = GGUFFile(path)
    arch_name = gguf_file.architecture
    names = _gguf_to_hf_names(arch_name, hf_config.num_hidden_layers)
    for tensor in gguf_file.tensors:
        base, _, suffix = tensor.name.rpartition(".")
        if base not in names:
            raise ValueError(f"GGUF tensor {tensor.name!r} ({arch_name}) has no Hugging Face counterpart.")
        hf_name = f"{names[base]}.{suffix}"
        if len(tensor.shape) == 3:  # [experts, rows, cols]: one matrix per expert, as HF checkpoints name them
            yield from _gguf_experts(hf_name, tensor, keep_quantized)
            continue
        if hf_name.endswith("shared_expert_gate.weight") and len(tensor.shape) == 1:  # llama.cpp: [hidden]
            tensor = GGUFTensor(tensor.name, tensor.qtype, (1, *tensor.shape), tensor.data.view(1, -1))
        if keep_quantized and len(tensor.shape) == 2:
            weight = GGUFWeight(tensor.qtype, tensor.shape, tensor.data)
        else:
            weight = dequantize_gguf(tensor)
        yield hf_name, _unpermute_gguf(hf_name, weight, hf_config) if arch_name in _GGUF_PERMUTED_ARCHS else weight


def _gguf_experts(hf_name: str, tensor: GGUFTensor, keep_quantized: bool) -> WeightIterator:
    """llama.cpp's stacked experts (`blk.N.ffn_gate_exps`: [experts, rows, cols]) as the per-expert
    matrices of a Hugging Face checkpoint (`model.layers.N.mlp.experts.E.gate_proj.weight`), in
    their blocks or dequantized."""
    prefix, _, projection = hf_name.removesuffix(".weight").rpartition(".")
    if not prefix.endswith(".mlp.experts"):
        raise ValueError(f"GGUF tensor {tensor.name!r} is 3-d but not a stack of experts.")
    experts, rows, cols = tensor.shape
    for expert in range(experts):
        weight = GGUFWeight(tensor.qtype, (rows, cols), tensor.data[expert * rows : (expert + 1) * rows])
        yield f"{prefix}.{expert}.{projection}.weight", weight if keep_quantized else weight.dense(torch.float32)


def dequantize_gguf(tensor: GGUFTensor) -> torch.Tensor:
    """A GGUF tensor in float32, in its torch shape: matrices by splitserve's kernels (the gguf
    package's numpy code where they are off), vectors by the gguf package."""
    import gguf

    if len(tensor.shape) == 2:
        return GGUFWeight(tensor.qtype, tensor.shape, tensor.data).dense(torch.float32)
    values = gguf.dequantize(tensor.data.numpy(), gguf.GGMLQuantizationType(tensor.qtype))
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).reshape(tensor.shape)


def _gguf_to_hf_names(arch_name: str, num_layers: int) -> dict[str, str]:
    import gguf

    archs = {name: arch for arch, name in gguf.MODEL_ARCH_NAMES.items()}
    if arch_name not in archs:
        raise ValueError(f"GGUF architecture {arch_name!r} is unknown to the gguf package.")
    name_map = gguf.get_tensor_name_map(archs[arch_name], num_layers)
    hf_names = ["model.embed_tokens", "model.norm", "lm_head"]
    hf_names += [f"model.layers.{i}.{m}" for i in range(num_layers) for m in _LAYER_MODULES]
    mapping = {}
    for hf in hf_names:
        gguf_name = name_map.get_name(hf)
        if gguf_name is not None:
            mapping[gguf_name] = hf
    return mapping


def _unpermute_gguf(hf_name: str, weight, hf_config):
    """llama.cpp stores q/k rows of each head interleaved (its rotary pairs neighbours): back to
    Hugging Face's rotate-half order, as rows of a dense tensor or of a GGUFWeight's blocks."""
    if hf_name.endswith("q_proj.weight"):
        heads = hf_config.num_attention_heads
    elif hf_name.endswith("k_proj.weight"):
        heads = getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads
    else:
        return weight
    rows = weight.shape[0]
    order = torch.arange(rows).reshape(heads, rows // heads // 2, 2).swapaxes(1, 2).reshape(rows)
    return weight.permute_rows(order) if isinstance(weight, GGUFWeight) else weight.index_select(0, order)


@torch.no_grad()
def fill_dummy(model: torch.nn.Module, seed: int) -> None:
    """Random weights for benchmarks: small uniform values (as vLLM's dummy loader) so activations stay finite."""
    generator = torch.Generator().manual_seed(seed)
    on_device: dict[torch.device, torch.Generator] = {}
    for param in model.parameters():
        if param.device.type == "cuda" and param.dtype in (torch.float16, torch.bfloat16, torch.float32):
            # Drawn where the weight lives: one CPU core drawing Qwen3-30B-A3B's 30.5B values in float32
            # and copying them over took more than two minutes on an H200 host.
            if param.device not in on_device:
                on_device[param.device] = torch.Generator(device=param.device).manual_seed(seed)
            param.data.uniform_(-1e-3, 1e-3, generator=on_device[param.device])
            continue
        values = torch.empty(param.shape, dtype=torch.float32).uniform_(-1e-3, 1e-3, generator=generator)
        param.data.copy_(values)
