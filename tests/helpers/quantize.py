"""`splitserve quantize` run in-process, and its checkpoints read back into float transformers models."""

from __future__ import annotations

import argparse
import json
import os

import safetensors.torch
import torch
import transformers

from splitserve.entrypoints import quantize_cli
from splitserve.quantization.packing import unpack_awq, unpack_gptq


def run_tool(*argv: str) -> str:
    parser = argparse.ArgumentParser()
    quantize_cli.add_arguments(parser)
    return quantize_cli.main(parser.parse_args(list(argv)))


def load_float(directory: str):
    return transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()


def dequantized_model(out_dir: str, float_dir: str):
    """The float model with every tensor of the quantized checkpoint, dequantized."""
    tensors = safetensors.torch.load_file(os.path.join(out_dir, "model.safetensors"))
    qc = read_config(out_dir)["quantization_config"]
    state = {}
    for name, tensor in tensors.items():
        base, suffix = name.rsplit(".", 1)
        if suffix == "weight" and tensor.dtype == torch.int8:
            state[name] = tensor.float() * tensors[f"{base}.weight_scale"][:, None]
        elif suffix == "qweight" and qc["quant_method"] == "awq":
            state[f"{base}.weight"] = unpack_awq(
                tensor, tensors[f"{base}.qzeros"], tensors[f"{base}.scales"], qc["group_size"]
            ).dequantize()
        elif suffix == "qweight":
            state[f"{base}.weight"] = unpack_gptq(
                tensor, tensors[f"{base}.qzeros"], tensors[f"{base}.scales"], tensors[f"{base}.g_idx"], qc["group_size"]
            ).dequantize()
        elif suffix not in ("weight_scale", "qzeros", "scales", "g_idx"):
            state[name] = tensor.float()
    if any(".experts." in name for name in state):
        return _through_a_checkpoint(state, float_dir, out_dir)
    model = load_float(float_dir)
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected
    assert set(missing) <= {"lm_head.weight"} and (not missing or model.config.tie_word_embeddings)
    return model


def _through_a_checkpoint(state: dict, float_dir: str, out_dir: str):
    """A mixture-of-experts model: transformers 5 stacks the per-expert tensors while loading a
    checkpoint, so the dequantized tensors go in as one (beside the quantized one, with the float
    model's config); every tensor of the float checkpoint must have its dequantized counterpart."""
    float_names = set(safetensors.torch.load_file(os.path.join(float_dir, "model.safetensors")))
    assert float_names - {"lm_head.weight"} <= set(state), sorted(float_names - set(state))[:5]
    directory = os.path.join(out_dir, "dequantized")
    os.makedirs(directory, exist_ok=True)
    safetensors.torch.save_file(state, os.path.join(directory, "model.safetensors"))
    with open(os.path.join(float_dir, "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    with open(os.path.join(directory, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f)
    return load_float(directory)


def read_config(out_dir: str) -> dict:
    with open(os.path.join(out_dir, "config.json"), encoding="utf-8") as f:
        return json.load(f)
