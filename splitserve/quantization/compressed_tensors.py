"""Checkpoints in the compressed-tensors format (what llm-compressor writes, and what vLLM serves as
`quant_method: compressed-tensors`): the weight-only int4 schemes (W4A16, W4A16_ASYM, GPTQ and AWQ
recipes) in the "pack-quantized" layout, run by the same int4 kernels as AWQ and GPTQ checkpoints.

Per linear, the checkpoint holds:
  weight_packed      [out, in/8] int32: eight input channels per word, lowest nibble first, each
                     level stored as q + 8 (q the signed level in [-8, 7]);
  weight_scale       [out, groups] float (one group per row for the "channel" strategy);
  weight_zero_point  [ceil(out/8), groups] int32, asymmetric schemes only: the signed zero points
                     packed along the output dim, likewise + 8;
  weight_shape       [2] the unpacked [out, in];
  weight_g_idx       [in] int32, with `actorder: group` only: each input channel's group.
so that w = (q - zero_point) * scale, which is `Int4Weight` with levels and zeros shifted by 8.

Other compressed-tensors schemes (fp8 or int8 activations, 8-bit weights, sparsity, transforms) are
refused with the scheme named, not loaded wrongly.
"""

from __future__ import annotations

import torch

from splitserve.quantization.packing import SEQUENTIAL, Int4Weight, pack_cols, unpack_cols

METHOD = "compressed-tensors"
REQUIRED = ("weight_packed", "weight_scale", "weight_shape")
OPTIONAL = ("weight_zero_point", "weight_g_idx")


def int4_settings(qc: dict) -> tuple[int, list[str], bool]:
    """(group size, -1 for one group per row; the modules left unquantized; whether a group index per
    input channel comes with the weights: actorder "group") of a weight-only int4
    pack-quantized `quantization_config`; a clear error for any other scheme."""
    groups = qc.get("config_groups") or {}
    if len(groups) != 1:
        raise ValueError(
            f"compressed-tensors checkpoints with {len(groups)} quantization groups are not supported "
            "(only one weight-only int4 scheme for every Linear)."
        )
    (scheme,) = groups.values()
    weights = scheme.get("weights") or {}
    layout = scheme.get("format") or qc.get("format")
    activations = "quantized" if scheme.get("input_activations") else "not quantized"
    described = (
        f"format {layout!r}, weights {weights.get('type')} {weights.get('num_bits')}-bit "
        f"{weights.get('strategy')}, input activations {activations}"
    )
    supported = (
        layout == "pack-quantized"
        and weights.get("num_bits") == 4
        and weights.get("type") == "int"
        and weights.get("strategy") in ("group", "channel")
        and not weights.get("dynamic")
        and not scheme.get("input_activations")
        and not scheme.get("output_activations")
        and not qc.get("kv_cache_scheme")
        and not qc.get("sparsity_config")
        and not qc.get("transform_config")
    )
    if not supported:
        raise ValueError(
            f"This compressed-tensors checkpoint ({described}) is not supported: splitserve loads the "
            "weight-only int4 schemes (W4A16, W4A16_ASYM: pack-quantized, group or channel strategy, no "
            "sparsity or transforms, unquantized KV cache)."
        )
    if "Linear" not in (scheme.get("targets") or []):
        raise ValueError(f"compressed-tensors targets {scheme.get('targets')} are not supported (only 'Linear').")
    group_size = weights.get("group_size") if weights.get("strategy") == "group" else -1
    return group_size, list(qc.get("ignore") or []), weights.get("actorder") == "group"


def unpack(tensors: dict[str, torch.Tensor], group_size: int) -> Int4Weight:
    """A linear's pack-quantized tensors in `Int4Weight`'s plain form."""
    out_features, in_features = (int(n) for n in tensors["weight_shape"].tolist())
    q = unpack_cols(tensors["weight_packed"], SEQUENTIAL)[:, :in_features].contiguous()
    scale = tensors["weight_scale"].float().contiguous()
    group = in_features if group_size <= 0 else group_size
    if tuple(q.shape) != (out_features, in_features) or tuple(scale.shape) != (out_features, -(-in_features // group)):
        raise ValueError(
            f"compressed-tensors tensors do not agree: weight_shape {out_features}x{in_features}, "
            f"weight_packed unpacks to {tuple(q.shape)}, weight_scale {tuple(scale.shape)} for group size {group}."
        )
    if "weight_zero_point" in tensors:
        zero = unpack_cols(tensors["weight_zero_point"].t().contiguous(), SEQUENTIAL)[:, :out_features].t()
    else:
        zero = torch.full_like(scale, 8, dtype=torch.int32)  # symmetric: the signed zero point 0
    g_idx = tensors.get("weight_g_idx")
    if g_idx is not None:
        g_idx = g_idx.to(torch.int32)
        if torch.equal(g_idx.cpu(), torch.arange(in_features, dtype=torch.int32) // group):
            g_idx = None
    return Int4Weight(q, scale, zero.contiguous().to(torch.int32), group, g_idx)


def pack(weight: Int4Weight, sym: bool) -> dict[str, torch.Tensor]:
    """The pack-quantized tensors of an `Int4Weight` (tests, and checkpoints written in this format)."""
    out_features, in_features = weight.q.shape
    tensors = {
        "weight_packed": pack_cols(weight.q, SEQUENTIAL),
        "weight_scale": weight.scale.to(torch.bfloat16).contiguous(),
        "weight_shape": torch.tensor([out_features, in_features]),
    }
    if not sym:
        tensors["weight_zero_point"] = pack_cols(weight.zero.t(), SEQUENTIAL).t().contiguous()
    elif not bool((weight.zero == 8).all()):
        raise ValueError("A symmetric compressed-tensors weight needs every zero point at 8 (the signed 0).")
    if weight.g_idx is not None:
        tensors["weight_g_idx"] = weight.g_idx.to(torch.int32)
    return tensors
