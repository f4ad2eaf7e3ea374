"""Quantized checkpoints written by the tests themselves, independently of splitserve's packing code.

Round-to-nearest quantizers and the AutoAWQ / GPTQ / compressed-tensors / fp8 layouts spelled out word
by word. Each
writer also returns the dequantized float weights, so that a transformers model carrying exactly
those weights is the reference."""

from __future__ import annotations

import json
import os
import shutil
import zlib

import numpy as np
import torch

AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # nibble i of an AutoAWQ word holds column AWQ_ORDER[i]
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def rtn_int4(w: torch.Tensor, group_size: int, g_idx: np.ndarray | None = None):
    """Asymmetric min/max int4 per group: (q [out, in], scale [out, G], zero [out, G], g_idx [in])."""
    out_f, in_f = w.shape
    g_idx = np.arange(in_f) // group_size if g_idx is None else g_idx
    groups = in_f // group_size
    wn = w.double().numpy()
    q = np.zeros((out_f, in_f), dtype=np.int64)
    scale = np.zeros((out_f, groups))
    zero = np.zeros((out_f, groups), dtype=np.int64)
    for g in range(groups):
        cols = np.nonzero(g_idx == g)[0]
        lo = np.minimum(wn[:, cols].min(axis=1), 0.0)
        hi = np.maximum(wn[:, cols].max(axis=1), 0.0)
        s = np.maximum((hi - lo) / 15.0, 1e-8).astype(np.float16).astype(np.float64)  # fp16 as stored
        z = np.clip(np.round(-lo / s), 0, 15).astype(np.int64)
        q[:, cols] = np.clip(np.round(wn[:, cols] / s[:, None]) + z[:, None], 0, 15)
        scale[:, g], zero[:, g] = s, z
    deq = (q - zero[:, g_idx]) * scale[:, g_idx]
    return q, scale, zero, g_idx, torch.tensor(deq, dtype=torch.float32)


def _word(nibbles) -> np.ndarray:
    word = np.zeros(nibbles[0].shape, dtype=np.uint64)
    for i, nib in enumerate(nibbles):
        word |= (nib.astype(np.uint64) & 0xF) << np.uint64(4 * i)
    return torch.from_numpy(word.astype(np.uint32).view(np.int32))


def awq_tensors(w: torch.Tensor, group_size: int):
    q, scale, zero, _, deq = rtn_int4(w, group_size)
    qt, zt = q.T, zero.T  # AWQ stores [in, out]
    tensors = {
        "qweight": _word([qt[:, AWQ_ORDER[i] :: 8] for i in range(8)]),
        "qzeros": _word([zt[:, AWQ_ORDER[i] :: 8] for i in range(8)]),
        "scales": torch.tensor(scale.T, dtype=torch.float16),
    }
    return tensors, deq


def _act_order(in_features: int, group_size: int, seed: int | None) -> np.ndarray | None:
    """The group of each input channel when a random permutation (act-order) formed the groups."""
    if seed is None:
        return None
    perm = np.random.default_rng(seed).permutation(in_features)
    g_idx = np.empty(in_features, dtype=np.int64)
    g_idx[perm] = np.arange(in_features) // group_size
    return g_idx


def gptq_tensors(w: torch.Tensor, group_size: int, act_order_seed: int | None = None):
    q, scale, zero, g_idx, deq = rtn_int4(w, group_size, _act_order(w.shape[1], group_size, act_order_seed))
    qt, zt = q.T, zero.T - 1  # GPTQ stores zero - 1
    tensors = {
        "qweight": _word([qt[i::8, :] for i in range(8)]),
        "qzeros": _word([zt[:, i::8] for i in range(8)]),
        "scales": torch.tensor(scale.T, dtype=torch.float16),
        "g_idx": torch.tensor(g_idx, dtype=torch.int32),
    }
    return tensors, deq


def compressed_tensors_tensors(w: torch.Tensor, group_size: int, act_order_seed: int | None = None):
    """llm-compressor's pack-quantized W4A16_ASYM: signed levels and zero points stored + 8 (so the
    unsigned q and zero as they are), eight input channels per word along the rows, the zero points
    eight output rows per word; with act-order (`actorder: group`) each channel's group in g_idx."""
    q, scale, zero, g_idx, deq = rtn_int4(w, group_size, _act_order(w.shape[1], group_size, act_order_seed))
    tensors = {
        "weight_packed": _word([q[:, i::8] for i in range(8)]),
        "weight_scale": torch.tensor(scale, dtype=torch.float16),
        "weight_zero_point": _word([zero.T[:, i::8] for i in range(8)]).T.contiguous(),
        "weight_shape": torch.tensor(w.shape),
    }
    if act_order_seed is not None:
        tensors["weight_g_idx"] = torch.tensor(g_idx, dtype=torch.int32)
    return tensors, deq


def int8_tensors(w: torch.Tensor, _group_size: int):
    scale = w.abs().amax(dim=1) / 127.0
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return {"weight": q, "weight_scale": scale}, q.float() * scale[:, None]


def fp8_tensors(w: torch.Tensor, _group_size: int):
    scale = w.abs().amax() / torch.finfo(torch.float8_e4m3fn).max  # one scale per tensor, as HF/vLLM fp8
    q = (w / scale).to(torch.float8_e4m3fn)
    return {"weight": q, "weight_scale": scale.reshape(())}, q.float() * scale


def _shared_input_seed(module: str) -> int:
    """Projections that read the same input (q/k/v, gate/up) share one act-order permutation,
    as GPTQ's (it sorts channels by the Hessian of that input)."""
    path, proj = module.rsplit(".", 1)
    layer = path.split(".")[2]
    return zlib.crc32(f"{layer}:{_INPUT_OF[proj]}".encode())


_INPUT_OF = {
    "q_proj": "attn",
    "k_proj": "attn",
    "v_proj": "attn",
    "o_proj": "o",
    "gate_proj": "mlp",
    "up_proj": "mlp",
    "down_proj": "down",
}

WRITERS = {
    "awq": awq_tensors,
    "gptq": gptq_tensors,
    "weight_only_int8": int8_tensors,
    "smooth_quant": int8_tensors,
    "fp8": fp8_tensors,
}


def quantization_config(method: str, group_size: int, desc_act: bool = False) -> dict:
    if method == "awq":
        return {
            "quant_method": "awq",
            "bits": 4,
            "group_size": group_size,
            "zero_point": True,
            "version": "gemm",
            "modules_to_not_convert": None,
        }
    if method == "gptq":
        return {
            "quant_method": "gptq",
            "bits": 4,
            "group_size": group_size,
            "desc_act": desc_act,
            "sym": False,
            "checkpoint_format": "gptq",
        }
    if method == "compressed-tensors":
        weights = {"num_bits": 4, "type": "int", "symmetric": False, "strategy": "group", "dynamic": False}
        weights.update(group_size=group_size, actorder="group" if desc_act else None)
        scheme = {"targets": ["Linear"], "weights": weights, "input_activations": None, "format": "pack-quantized"}
        return {
            "quant_method": "compressed-tensors",
            "format": "pack-quantized",
            "quantization_status": "compressed",
            "config_groups": {"group_0": scheme},
            "ignore": ["lm_head"],
            "kv_cache_scheme": None,
            "sparsity_config": {},
        }
    if method == "fp8":
        return {"quant_method": "fp8", "activation_scheme": "dynamic"}
    return {"quant_method": method, "bits": 8}


def write_quantized_checkpoint(
    src: str, dst: str, method: str, group_size: int = 32, act_order: bool = False
) -> dict[str, torch.Tensor]:
    """Quantize every decoder-layer linear of the HF checkpoint `src` into `dst`; returns the
    state dict with the dequantized weights (what a reference model should carry)."""
    from safetensors.torch import load_file, save_file

    state = load_file(os.path.join(src, "model.safetensors"))
    out, reference = {}, dict(state)
    for name, tensor in state.items():
        module, _, kind = name.rpartition(".")
        if kind == "weight" and module.rsplit(".", 1)[-1] in LINEARS:
            if method in ("gptq", "compressed-tensors"):
                seed = _shared_input_seed(module) if act_order else None
                writer = gptq_tensors if method == "gptq" else compressed_tensors_tensors
                tensors, deq = writer(tensor, group_size, seed)
            else:
                tensors, deq = WRITERS[method](tensor, group_size)
            out.update({f"{module}.{k}": v.contiguous() for k, v in tensors.items()})
            reference[name] = deq
        else:
            out[name] = tensor
    os.makedirs(dst, exist_ok=True)
    for file in os.listdir(src):
        if file != "model.safetensors":
            shutil.copy(os.path.join(src, file), dst)
    save_file(out, os.path.join(dst, "model.safetensors"))
    with open(os.path.join(dst, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = quantization_config(method, group_size, act_order)
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    return reference
