"""What `splitserve quantize` writes: the config.json `quantization_config` of each method (with the keys
AutoAWQ and AutoGPTQ write for awq and gptq) and the Hugging Face directory around the quantized
tensors (tool.py makes them)."""

from __future__ import annotations

import json
import os

import torch

from splitserve.quantization import smoothquant
from splitserve.quantization.tool import GPTQ_DAMP_PERCENT


def quantization_config(
    quant_type: str,
    *,
    alpha: float | None,
    group_size: int,
    sym: bool,
    desc_act: bool,
    tp_size: int,
    damp_percent: float = GPTQ_DAMP_PERCENT,
) -> dict:
    """The config.json `quantization_config`; awq and gptq with the keys AutoAWQ / AutoGPTQ write."""
    if quant_type == "weight_only_int8":
        qc = {"quant_method": "weight_only_int8", "bits": 8}
    elif quant_type == "smooth_quant":
        qc = {
            "quant_method": "smooth_quant",
            "bits": 8,
            "smoothing_strength": smoothquant.AUTO_MAX_STRENGTH if alpha is None else alpha,
            "smoothing_strength_choice": (
                "per linear group, least held-out W8A8 error, at most smoothing_strength"
                if alpha is None
                else "every linear group"
            ),
            "activation_scheme": "dynamic_per_token",
        }
    elif quant_type == "awq":
        qc = {
            "quant_method": "awq",
            "bits": 4,
            "group_size": group_size,
            "zero_point": True,
            "version": "gemm",
            "modules_to_not_convert": None,
        }
    else:
        qc = {
            "quant_method": "gptq",
            "bits": 4,
            "group_size": group_size,
            "desc_act": desc_act,
            "sym": sym,
            "damp_percent": damp_percent,
            "true_sequential": False,
            "checkpoint_format": "gptq",
        }
    qc["tensor_parallel_size"] = tp_size
    return qc


def write_checkpoint(
    model: torch.nn.Module,
    tokenizer,
    output: str,
    dtype: torch.dtype,
    linears: dict[str, dict[str, torch.Tensor]],
    qc: dict,
) -> int:
    """A clean Hugging Face directory: config.json (from the model's config, without GGUF
    leftovers), model.safetensors, tokenizer and generation config. Returns its size in bytes."""
    from safetensors.torch import save_file

    os.makedirs(output, exist_ok=True)
    output_embeddings = model.get_output_embeddings()
    tied = output_embeddings is not None and output_embeddings.weight is model.get_input_embeddings().weight
    replaced = {f"{name}.weight" for name in linears}
    tensors = {
        key: value.detach().to(dtype).contiguous()
        for key, value in model.state_dict().items()
        if key not in replaced and not (tied and key == "lm_head.weight")
    }
    for name, parts in linears.items():
        for suffix, tensor in parts.items():
            tensors[f"{name}.{suffix}"] = tensor.contiguous()
    save_file(tensors, os.path.join(output, "model.safetensors"), metadata={"format": "pt"})

    config = model.config.to_diff_dict()
    for key in ("_name_or_path", "_model_name_or_path", "quantization_config"):  # GGUF / source leftovers
        config.pop(key, None)
    dtype_name = str(dtype).removeprefix("torch.")
    config.update(
        architectures=[type(model).__name__],
        dtype=dtype_name,
        torch_dtype=dtype_name,
        tie_word_embeddings=tied,
        quantization_config=qc,
    )
    with open(os.path.join(output, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2, sort_keys=True)
        f.write("\n")
    tokenizer.save_pretrained(output)
    if model.generation_config is not None:
        model.generation_config.save_pretrained(output)
    return sum(
        os.path.getsize(os.path.join(output, n)) for n in os.listdir(output) if os.path.isfile(os.path.join(output, n))
    )
